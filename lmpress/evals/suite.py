"""Run a recipe's eval suite on a baseline (cached) or a candidate model.

The baseline's results and artifacts (e.g. KLD reference distributions) live in
``<cache>/baseline/<key>/`` where the key hashes the model fingerprint, the eval's
name and settings, and the eval text; a second run with the same model and suite
skips the baseline.
"""

from __future__ import annotations

import shutil
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmpress.cache import cache_root, read_json, sha256_json, write_json_atomic
from lmpress.calib.compute_dtype import calibration_compute_dtype, layers_in_float32, model_dtype, widens_to_float32
from lmpress.data import Text, load_text, tokenize
from lmpress.evals.gates import Gate, derived_metrics, evaluate_gates
from lmpress.progress import QUIET, Bars
from lmpress.registry import EVAL_HANDLERS, EvalConfig, EvalContext, EvalResult

SUITE_VERSION = 2  # bump when an eval's numbers change for the same inputs


def baseline_identity(fingerprint: str, model: nn.Module) -> dict[str, Any]:
    """Everything about the baseline model that changes its numbers: weights, dtype, device, kernels, versions."""
    import transformers

    param = next(model.parameters())
    dtype, device = model_dtype(model)
    compute = calibration_compute_dtype(dtype, device)  # layers_in_float32: float32 where 16-bit matmuls are slow
    return {
        "model": fingerprint,
        "dtype": str(getattr(model, "dtype", param.dtype)),
        "device": param.device.type,
        **({"compute": str(compute)} if compute != dtype else {}),
        "attention": getattr(getattr(model, "config", None), "_attn_implementation", None),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def baseline_store(baseline: dict[str, Any], name: str, config: EvalConfig, text: Text) -> Path:
    """The cache directory of one eval's baseline results and artifacts (e.g. the KLD reference)."""
    key = sha256_json(
        {**baseline, "eval": name, "config": config.model_dump(), "text": text.sha256, "v": SUITE_VERSION}
    )
    return cache_root() / "baseline" / key[:24]


def run_eval(
    name: str,
    config: EvalConfig,
    model: nn.Module,
    tokenizer,
    text: Text,
    role: str,
    store: Path,
    bars: Bars = QUIET,
) -> EvalResult:
    ids = cache(lambda: tokenize(tokenizer, text))
    device = next(model.parameters()).device
    ctx = EvalContext(text=text, ids=ids, role=role, store=store, bars=bars, device=device)
    handler = EVAL_HANDLERS[type(config)]
    with layers_in_float32(model):
        return handler(model, tokenizer, config, ctx)


def run_suite(
    evals: dict[str, EvalConfig],
    text_source: str,
    model: nn.Module,
    tokenizer,
    baseline: str | dict[str, Any],
    role: str,
    bars: Bars = QUIET,
) -> dict[str, EvalResult]:
    """Every eval of the suite. ``role="baseline"`` reads and fills the cache; ``"candidate"`` reads its store.

    ``baseline`` is the baseline's ``baseline_identity``, or its checkpoint fingerprint, completed from
    ``model`` (right for the baseline itself; a candidate should pass the baseline's identity).
    """
    if isinstance(baseline, str):
        baseline = baseline_identity(baseline, model)
    text = load_text(text_source) if evals else None
    dtype, device = model_dtype(model)
    if evals and widens_to_float32(dtype, device):
        kind = str(dtype).removeprefix("torch.")
        bars.log(f"evals ({role}): each decoder layer and the head compute in float32 (no {kind} matrix unit here)")
    results = {}
    for name, config in evals.items():
        store = baseline_store(baseline, name, config, text)
        if role == "baseline":
            results[name] = cached_baseline(name, config, model, tokenizer, text, store, bars)
        else:
            with torch.inference_mode():
                results[name] = run_eval(name, config, model, tokenizer, text, role, store, bars)
    return results


def cache_sensitive(evals: dict[str, EvalConfig]) -> dict[str, EvalConfig]:
    """The evals of a suite whose numbers a quantized KV cache moves and that stand alone (no baseline artifact):
    perplexity, passkey retrieval and perplexity by position. A run with ``kv_cache:`` scores them once more on the
    candidate with a float cache, so its report tells the weights' loss from the cache's."""
    from lmpress.evals.longctx import PasskeyConfig, PositionNLLConfig
    from lmpress.evals.perplexity import PerplexityConfig

    kinds = (PerplexityConfig, PasskeyConfig, PositionNLLConfig)
    return {name: config for name, config in evals.items() if isinstance(config, kinds)}


def cached_baseline(
    name: str, config: EvalConfig, model: nn.Module, tokenizer, text: Text, store: Path, bars: Bars
) -> EvalResult:
    saved = read_json(store / "result.json")
    if saved is not None:
        bars.log(f"baseline {name}: cached in {store}")
        return EvalResult(**saved)
    # Compute into a fresh directory and rename, so an interrupted run leaves no half-written store.
    store.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=store.parent, prefix=f".{store.name}."))
    with torch.inference_mode():
        result = run_eval(name, config, model, tokenizer, text, "baseline", tmp, bars)
    write_json_atomic(tmp / "result.json", result.__dict__)
    shutil.rmtree(store, ignore_errors=True)
    tmp.rename(store)
    return result


def merged(results: dict[str, EvalResult], field: str) -> dict[str, Any]:
    """Metrics of all evals in one flat dict; details and protocols keyed by eval name."""
    out: dict[str, Any] = {}
    for name, result in results.items():
        if field == "metrics":
            out.update(result.metrics)
        else:
            out[name] = getattr(result, field)
    return out


def suite_report(
    baseline: dict[str, EvalResult], candidate: dict[str, EvalResult], gates: list[Gate]
) -> dict[str, Any]:
    """Both sides' metrics, the derived deltas/ratios, and one verdict per gate."""
    base_metrics, cand_metrics = merged(baseline, "metrics"), merged(candidate, "metrics")
    derived = derived_metrics(base_metrics, cand_metrics)
    verdicts = evaluate_gates(gates, {**cand_metrics, **derived})
    return {
        "baseline": {k: merged(baseline, k) for k in ("metrics", "details", "protocol")},
        "candidate": {k: merged(candidate, k) for k in ("metrics", "details", "protocol")},
        "derived": derived,
        "gates": verdicts,
        "passed": all(v["passed"] for v in verdicts),
    }


def evaluate_models(
    recipe, baseline_source: str | None, bars: Bars = QUIET, device: torch.device | None = None
) -> dict[str, Any]:
    """``lmpress eval``: the recipe's suite on its model, against ``baseline_source`` when given, computed on
    ``device`` (default: the CPU)."""
    from lmpress.loader import load_model
    from lmpress.placement import CPU, on_device
    from lmpress.weights.float8 import require_fp8_kernels

    device = device or CPU

    spec = recipe.model
    evals = recipe.eval.evals
    candidate = load_model(spec.source, spec.dtype, spec.revision, spec.trust_remote_code)
    for config in evals.values():
        config.check(candidate.model)
    require_fp8_kernels(candidate.model, device, spec.source)
    if baseline_source:
        base = load_model(baseline_source, spec.dtype, spec.revision, spec.trust_remote_code)
        require_fp8_kernels(base.model, device, baseline_source)
        with on_device(device, base.model):
            identity, role = baseline_identity(base.fingerprint, base.model), "candidate"
            base_results = run_suite(evals, recipe.eval.text, base.model, base.tokenizer, identity, "baseline", bars)
        del base
    else:
        base_results, role = {}, "baseline"
    with on_device(device, candidate.model):
        if not baseline_source:
            identity = baseline_identity(candidate.fingerprint, candidate.model)
        cand_results = run_suite(evals, recipe.eval.text, candidate.model, candidate.tokenizer, identity, role, bars)
    report = suite_report(base_results, cand_results, recipe.gates)
    report["model"] = {"source": spec.source, "checkpoint": str(candidate.path), "baseline": baseline_source}
    report["measured_on"] = {"baseline": baseline_source, "candidate": f"{spec.source} ({spec.dtype})"}
    report["stages"], report["exports"], report["recipe"] = [], [], recipe.as_dict()
    return report
