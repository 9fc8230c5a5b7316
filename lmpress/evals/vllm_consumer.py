"""vLLM as a consumer of lmpress's exports, in the agreement check.

vLLM brings its own torch and transformers, so it lives in its own virtual environment (see
docs/serving.md). This module has two halves:

- the worker (:func:`worker_main`): run by the vLLM environment's Python on this file
  (``/path/to/vllm-venv/bin/python lmpress/evals/vllm_consumer.py request.json``); it imports nothing but
  the standard library and vLLM, loads each export named in the request with ``vllm.LLM`` (no flags
  beyond what a user would pass: the model directory, ``max_model_len``, eager mode), and writes, per
  export, vLLM's raw next-token logits at every position of each prompt (``logprobs_mode="raw_logits"``,
  the whole vocabulary) and its greedy continuation, or the one-line reason vLLM refused it;
- the side (:func:`vllm_sides`): in lmpress's environment, it runs the worker once for a list of
  exports and turns each answer into an agreement :class:`~lmpress.evals.agreement.Side`.

vLLM's CPU backend runs a float32 checkpoint in bfloat16 by itself ("Downcasting torch.float32 to
torch.bfloat16"), which its GPTQ/AWQ CPU kernels need, so lmpress's exports load with no ``dtype`` flag;
the vLLM side's unit roundoff is bfloat16's (or the scheme's activation unit where coarser).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

VLLM_PYTHON_ENV = "LMPRESS_VLLM_PYTHON"  # the vLLM environment's python; unset: the vLLM checks skip


# The worker: runs in the vLLM environment, standard library + vLLM only -----------------------------------


def _first_line(error: BaseException) -> str:
    """The error as one line: its lines joined (pydantic's last line is only a URL)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip() and "errors.pydantic" not in line]
    return f"{type(error).__name__}: {' | '.join(lines)}"[:400]


def _load(model: str, tokenizer: str | None, max_model_len: int, flags: dict[str, Any]) -> Any:
    from vllm import LLM

    return LLM(
        model=model,
        tokenizer=tokenizer,
        max_model_len=max_model_len,
        enforce_eager=True,
        logprobs_mode="raw_logits",
        max_logprobs=-1,
        seed=0,
        **flags,  # what a user adds for this export (kv_cache_dtype="fp8" for a calibrated FP8 cache)
    )


def run_job(job: dict[str, Any], prompts: list[list[int]], new_tokens: int, out: Path) -> dict[str, Any]:
    """One export through vLLM: logits over each prompt and greedy tokens, written to ``out`` (safetensors)."""
    began = time.perf_counter()
    try:
        llm = _load(job["model"], job.get("tokenizer"), job.get("max_model_len", 256), job.get("flags", {}))
    except Exception as e:  # vLLM's refusal, whatever its type: the check reports it, one line
        return {"model": job["model"], "error": _first_line(e), "load_s": time.perf_counter() - began}
    loaded = time.perf_counter()
    try:
        return _score(llm, job, prompts, new_tokens, out, began, loaded)
    except Exception as e:  # loaded, then failed to run (a kernel this host's build lacks): one line too
        return {"model": job["model"], "error": "running: " + _first_line(e), "load_s": loaded - began}
    finally:
        del llm
        import gc

        gc.collect()


def _score(
    llm: Any, job: dict[str, Any], prompts: list[list[int]], new_tokens: int, out: Path, began: float, loaded: float
) -> dict[str, Any]:
    import torch
    from safetensors.torch import save_file
    from vllm import SamplingParams, TokensPrompt

    config = llm.llm_engine.model_config
    vocab = config.get_vocab_size()
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    scored = llm.generate(inputs, SamplingParams(max_tokens=1, temperature=0.0, logprobs=-1, prompt_logprobs=-1))
    tensors: dict[str, torch.Tensor] = {}
    for i, (prompt, result) in enumerate(zip(prompts, scored, strict=True)):
        rows = [*result.prompt_logprobs[1:], result.outputs[0].logprobs[0]]  # position t predicts token t + 1
        logits = torch.full((len(prompt), vocab), float("-inf"))
        for t, row in enumerate(rows):
            ids = torch.tensor(list(row.keys()), dtype=torch.long)
            logits[t, ids] = torch.tensor([lp.logprob for lp in row.values()])
        tensors[f"logits.{i}"] = logits
    greedy = llm.generate(inputs, SamplingParams(max_tokens=new_tokens, temperature=0.0))
    save_file(tensors, str(out))
    answer = {
        "model": job["model"],
        "dtype": str(config.dtype).removeprefix("torch."),
        "quantization": config.quantization,
        "greedy": [list(r.outputs[0].token_ids) for r in greedy],
        "logits_file": str(out),
        "load_s": loaded - began,
        "run_s": time.perf_counter() - loaded,
    }
    return answer


def worker_main(request_path: str) -> int:
    request = json.loads(Path(request_path).read_text())
    out_dir = Path(request["out_dir"])
    answers = []
    for i, job in enumerate(request["jobs"]):
        answers.append(run_job(job, request["prompts"], request["new_tokens"], out_dir / f"logits-{i}.safetensors"))
        (out_dir / "answers.json").write_text(json.dumps(answers, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: exports load one after another
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache (default 4: the machine is shared)
    sys.exit(worker_main(sys.argv[1]))


# The side: runs in lmpress's environment ------------------------------------------------------------------


def vllm_python() -> Path | None:
    """The vLLM environment's python, ``$LMPRESS_VLLM_PYTHON``, if set and present (an explicit opt-in: the
    check takes minutes)."""
    value = os.environ.get(VLLM_PYTHON_ENV)
    return Path(value) if value and Path(value).is_file() else None


def vllm_model_path(export_dir: Path) -> tuple[str, str | None]:
    """What ``vllm.LLM(model=..., tokenizer=...)`` is given for an export: its directory, or for a GGUF
    export its .gguf file with the directory's tokenizer."""
    gguf = sorted(export_dir.glob("*.gguf"))
    if gguf and not (export_dir / "config.json").is_file():
        return str(gguf[0]), str(export_dir)
    return str(export_dir), None


def run_vllm(
    exports: list[Path],
    prompts: list[list[int]],
    new_tokens: int,
    workdir: Path,
    timeout: float = 1800,
    flags: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Every export through vLLM in one worker process; one answer per export (``error`` where vLLM refused).
    ``flags``: per export, ``vllm.LLM`` arguments beyond the model (none by default)."""
    python = vllm_python()
    if python is None:
        raise FileNotFoundError(f"no vLLM environment: set {VLLM_PYTHON_ENV} to its python (docs/serving.md)")
    workdir.mkdir(parents=True, exist_ok=True)
    jobs = []
    for export, extra in zip(exports, flags or [{}] * len(exports), strict=True):
        model, tokenizer = vllm_model_path(export)
        jobs.append({"model": model, "tokenizer": tokenizer, "max_model_len": 256, "flags": extra})
    request = workdir / "request.json"
    request.write_text(
        json.dumps({"out_dir": str(workdir), "new_tokens": new_tokens, "prompts": prompts, "jobs": jobs})
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}  # lmpress's tree must not shadow vLLM's packages
    log = workdir / "vllm.log"
    # -P: this file's directory (lmpress/evals: compare.py, report.py, ...) must not shadow vLLM's imports
    with log.open("w") as sink:
        done = subprocess.run(
            [str(python), "-P", __file__, str(request)], stdout=sink, stderr=subprocess.STDOUT, env=env, timeout=timeout
        )
    answers_file = workdir / "answers.json"
    if done.returncode != 0 or not answers_file.is_file():
        tail = log.read_text().strip().splitlines()[-5:]
        raise RuntimeError(f"the vLLM worker failed (exit {done.returncode}; {log}): " + " | ".join(tail))
    return json.loads(answers_file.read_text())


def vllm_side(answer: dict[str, Any], prompts: list[list[int]], unit: float) -> Any:
    """An agreement side from one worker answer: its logits over each prompt and its greedy tokens.

    The worker ran exactly ``prompts``; the side answers for those sequences only (what the agreement
    check asks of a side that cannot be called back)."""
    import torch
    from safetensors.torch import load_file

    from lmpress.evals.agreement import Side

    tensors = load_file(answer["logits_file"])
    by_prompt = {tuple(p): i for i, p in enumerate(prompts)}

    def logits(ids: torch.Tensor) -> torch.Tensor:
        return tensors[f"logits.{by_prompt[tuple(ids[0].tolist())]}"]

    def greedy(prompt: list[int], n: int) -> list[int]:
        return list(answer["greedy"][by_prompt[tuple(prompt)]])[:n]

    return Side("vllm", logits, greedy, unit)


# The check: each pair's export through vLLM, against the float reference and lmpress's runtime ------------

# (scheme, format) pairs of the agreement matrix that the check sends to vLLM: every format vLLM's loader
# knows (GPTQ, AWQ, compressed-tensors) with every scheme lmpress writes in it, and GGUF, which vLLM 0.32
# refuses (the check asserts the refusal ``lmpress inspect`` predicts).
VLLM_PAIRS = (
    ("W4 g32 sym", "gptq"),
    ("W4 g32 asym", "gptq"),
    ("W8 g32 sym", "gptq"),
    ("W8 g32 asym", "gptq"),
    ("W4 g32 act-order (GPTQ)", "gptq"),
    ("W4 g32 sym", "awq"),
    ("W4 g32 asym", "awq"),
    ("W4 g32 sym", "compressed-tensors"),
    ("W4 g32 asym", "compressed-tensors"),
    ("W8 g32 sym", "compressed-tensors"),
    ("W8 g32 asym", "compressed-tensors"),
    ("2:4 sparse + W4 g32 (SparseGPT)", "compressed-tensors"),
    ("W8A8 int8 (SmoothQuant)", "compressed-tensors"),
    ("FP8 W8A8 (E4M3)", "compressed-tensors"),
    ("W4 g32 sym", "gguf"),
    ("W8A8 int8, rotated with R4 (rotate + SmoothQuant)", "compressed-tensors"),
    ("W4A8 g64, int8 activations (RTN)", "compressed-tensors"),
)
DTYPE_UNITS = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-20}


def check_vllm_pairs(
    model_dir: Path,
    pairs: tuple[tuple[str, str], ...],
    calibration: Any,
    workdir: Path,
    new_tokens: int = 8,
) -> list[Any]:
    """Each pair quantized, written, and run by vLLM (one worker process for all) and by lmpress's runtime;
    vLLM compared with the float reference and with the runtime. A pair whose export vLLM refuses is
    ``refused by vllm`` when ``lmpress inspect`` predicts it (:func:`lmpress.export.consumers.vllm_refusal`),
    ``disagree`` otherwise; vLLM loading what inspect says it refuses is a disagreement too."""
    from transformers import AutoTokenizer

    from lmpress.evals.agreement import (
        FLOAT32_UNIT,
        compare,
        execution_unit,
        hf_side,
        logit_scale,
        read_side,
        runtime_side,
    )
    from lmpress.evals.agreement_matrix import (
        STORAGE_UNIT,
        PairOutcome,
        build_candidate,
        encode_prompts,
        reference_model,
        refusal_before_work,
        scheme_named,
    )
    from lmpress.export.consumers import vllm_refusal
    from lmpress.export.inspect import inspect_artifact
    from lmpress.loader import model_skeleton
    from lmpress.registry import exporter
    from lmpress.runtime.text import load_runtime

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = encode_prompts(tokenizer)
    prepared = []
    outcomes: list[PairOutcome] = []
    candidates: dict[str, Any] = {}
    for scheme, fmt in pairs:
        spec = scheme_named(scheme)
        refusal = refusal_before_work(spec, fmt, model_skeleton(model_dir))
        if refusal:
            outcomes.append(PairOutcome(scheme, fmt, "refused before work", refusal))
            continue
        if scheme not in candidates:
            candidates[scheme] = build_candidate(model_dir, spec, calibration, workdir / "state" / str(len(candidates)))
        candidate = candidates[scheme]
        out = workdir / f"export-{len(prepared)}"
        out.mkdir(parents=True, exist_ok=True)
        exporter(fmt)(candidate, tokenizer, out)
        reference = hf_side("reference", reference_model(candidate), STORAGE_UNIT.get(fmt, FLOAT32_UNIT))
        runtime_unit = execution_unit(candidate, runtime=True)
        predicted = vllm_refusal(inspect_artifact(out) if (out / "config.json").is_file() else {"format": fmt})
        scheme_unit = execution_unit(candidate, runtime=False)
        prepared.append((scheme, fmt, out, reference, runtime_unit, predicted, scheme_unit))
    began = time.perf_counter()
    answers = run_vllm([p[2] for p in prepared], prompts, new_tokens, workdir / "vllm") if prepared else []
    seconds = (time.perf_counter() - began) / max(1, len(prepared))
    for (scheme, fmt, out, reference, runtime_unit, predicted, scheme_unit), answer in zip(
        prepared, answers, strict=True
    ):
        outcome = PairOutcome(scheme, fmt, "agree", seconds=seconds)
        if "error" in answer:
            outcome.status = "refused by vllm" if predicted else "disagree"
            outcome.detail = f"vLLM: {answer['error']}" + (f" (inspect: {predicted})" if predicted else "")
            outcomes.append(outcome)
            continue
        if predicted:
            outcome.status, outcome.detail = "disagree", f"vLLM loaded it, but inspect says: {predicted}"
        unit = max(DTYPE_UNITS.get(answer["dtype"], FLOAT32_UNIT), scheme_unit)
        side = vllm_side(answer, prompts, unit)
        ref_reading = read_side(reference, prompts, new_tokens)
        scale = logit_scale(ref_reading)
        reading = read_side(side, prompts, new_tokens)
        runtime = runtime_side(load_runtime(str(out))[0], runtime_unit)  # read only where vLLM ran the export
        runtime_reading = read_side(runtime, prompts, new_tokens)
        outcome.results.append(compare(side, reading, reference, ref_reading, prompts, scale, reference.logits))
        outcome.results.append(compare(side, reading, runtime, runtime_reading, prompts, scale, reference.logits))
        outcome.skipped = {"vllm": f"{answer['quantization']} in {answer['dtype']}, load {answer['load_s']:.1f} s"}
        failed = [r for r in outcome.results if not r.agrees]
        if failed and outcome.status == "agree":
            outcome.status = "disagree"
            outcome.detail = "; ".join(
                f"{r.side} vs {r.against}: max |diff| {r.max_abs_diff:.3g} (tolerance {r.tolerance:.3g}), "
                f"greedy {r.greedy_same}+{r.greedy_ties}/{r.prompts} {r.first_split}"
                for r in failed
            )
        outcomes.append(outcome)
    return outcomes
