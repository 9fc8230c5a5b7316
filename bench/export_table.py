"""lmpress's calibrated W4 exports against each runtime's own 4-bit quantizer, in that runtime (issue 15).

    python bench/export_table.py            # build what is missing, measure every row, write the table
    python bench/export_table.py --reuse    # keep rows already measured (artifacts are always reused)
    python bench/export_table.py --reuse --rows llama-lmpress-q4k,llama-own-q4k   # build and measure just these

SmolLM2-135M-Instruct. For llama.cpp (llama-cpp-python) and ONNX Runtime (CPU) each:

- FP32: the float model in that runtime (an F32 GGUF; an ONNX graph with float MatMuls), both
  written by lmpress;
- lmpress: AWQ scales then GPTQ rounding, W4 g32 symmetric (act-order with static groups, MSE scales; calibration
  128 x 512 tokens of wiki.valid.tokens, seed 0: bench/quant_table.py's) exported as GGUF Q4_0
  / as MatMulNBits (block 32);
- the runtime's own quantizer on the same FP32 weights: llama.cpp's ``llama_model_quantize`` to
  Q4_0 (every linear Q4_0, token embedding F32 as in lmpress's file: ``pure``, token embedding and
  output types F32), and ONNX Runtime's ``MatMulNBitsQuantizer`` (its default RTN, 4 bits, block
  32, symmetric) on the FP32 graph.

And a Q4_K pair in llama.cpp: lmpress's same AWQ + GPTQ stage with ``k_quant_scales: true``
written as GGUF Q4_K, against ``llama_model_quantize`` to Q4_K (``pure``, file type Q4_K_S,
token embedding and output F32). Q4_K needs rows of whole 256-column blocks: in SmolLM2 only
ffn_down (1536 columns) has them; the other linears read 576 columns, so lmpress's recipe turns
the key off there (its file holds them as Q4_0) and llama.cpp's row is told, by tensor-type
overrides, to write those as Q4_0 too, so both files hold the same block types. (Left to
itself, llama.cpp's pure Q4_K falls back to the 5-bit Q5_0 for them: row ``llama-own-q4k-pure``.)

Perplexity: bench/quant_table.py's protocol (first 20 windows of 2048 tokens of wiki.test.raw,
CRLF -> LF, no BOS, lmpress's tokenizer), the runtime's logits scored with lmpress's token_nll.
Decode: 128-token prompt, 64 greedy tokens, median of 3, 2 threads. Goal (issue 15, the Q4_0 and
MatMulNBits pairs): in each runtime, lmpress's degradation over that runtime's FP32 at most half of
the runtime quantizer's. The Q4_K pair is reported the same way, without a goal.
Each row is measured in its own process, one at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.quant_table import CALIBRATION, EVAL, SMOLLM2, WIKITEXT, cpu_description  # noqa: E402

RESULTS = REPO / "bench" / "results"
ROW_DIR = RESULTS / "export_rows"
# AWQ scales, then GPTQ rounding (static groups keep Q4_0's contiguous blocks); GPTQ alone scored 23.92 / 23.87.
LMPRESS_STAGE = {
    "method": "awq",
    "bits": 4,
    "group_size": 32,
    "rounding": "gptq",
    "act_order": True,
    "static_groups": True,
    "mse": True,
}
# The same with k-quant scales (GGUF Q4_K) where a layer reads whole 256-column blocks: SmolLM2's ffn_down only.
NARROW = ".*(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj)"
LMPRESS_Q4K_STAGE = {**LMPRESS_STAGE, "k_quant_scales": True, "overrides": {NARROW: {"k_quant_scales": False}}}
# llama.cpp's tensors of those 576-column layers (its Q4_K row writes them as Q4_0, as lmpress's file holds them)
LLAMA_NARROW = r"attn_(q|k|v|output)\.weight|ffn_(gate|up)\.weight"
# One thread: on this shared 2-core machine (load average ~5), 2 threads made every op wait for a
# descheduled worker (llama.cpp Q4_0 decoded at 0.7 tok/s with 2 threads).
THREADS = 1
PROMPT_TOKENS, NEW_TOKENS, REPEATS = 128, 64, 3
# row -> (runtime, label, artifact under the work directory, the builds it needs in order)
ROWS: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    "llama-fp32": ("llama.cpp", "FP32 (F32 GGUF written by lmpress)", "f32.gguf", ("f32-gguf",)),
    "llama-lmpress": (
        "llama.cpp",
        "lmpress AWQ + GPTQ W4 g32 sym -> GGUF Q4_0",
        "lmpress-q4_0.gguf",
        ("lmpress",),
    ),
    "llama-own": ("llama.cpp", "llama.cpp's own Q4_0 (llama_model_quantize)", "llama-q4_0.gguf", ("f32-gguf", "llama")),
    "llama-lmpress-q4k": (
        "llama.cpp",
        "lmpress AWQ + GPTQ W4 g32 sym, k-quant scales -> GGUF Q4_K (ffn_down; 576-column layers Q4_0)",
        "lmpress-q4_k.gguf",
        ("lmpress-q4k",),
    ),
    "llama-own-q4k": (
        "llama.cpp",
        "llama.cpp's own Q4_K (llama_model_quantize, pure Q4_K_S; 576-column layers Q4_0)",
        "llama-q4_k.gguf",
        ("f32-gguf", "llama-q4k"),
    ),
    "llama-own-q4k-pure": (
        "llama.cpp",
        "llama.cpp's own pure Q4_K_S (its Q5_0 fallback for the 576-column layers)",
        "llama-q4_k-pure.gguf",
        ("f32-gguf", "llama-q4k-pure"),
    ),
    "ort-fp32": ("onnxruntime", "FP32 (ONNX written by lmpress)", "fp32-onnx", ("fp32-onnx",)),
    "ort-lmpress": ("onnxruntime", "lmpress AWQ + GPTQ W4 g32 sym -> MatMulNBits", "lmpress-w4-onnx", ("lmpress",)),
    "ort-own": (
        "onnxruntime",
        "onnxruntime's own RTN int4 (MatMulNBitsQuantizer, block 32, sym)",
        "ort-rtn-onnx",
        ("fp32-onnx", "ort"),
    ),
}
# runtime -> its FP32 row and its (lmpress row, the runtime quantizer's row) pairs, in the table's order
TABLE = {
    "llama.cpp": ("llama-fp32", [("llama-lmpress", "llama-own"), ("llama-lmpress-q4k", "llama-own-q4k")]),
    "onnxruntime": ("ort-fp32", [("ort-lmpress", "ort-own")]),
}
EXTRA_ROWS = {"llama.cpp": ["llama-own-q4k-pure"]}  # measured for reference, no goal
# Issue 15's goal is for the Q4_0 and MatMulNBits pairs; the Q4_K pair is compared the same way, as a report
REPORTED_PAIRS = {"llama-lmpress-q4k"}


def work_dir() -> Path:
    from lmpress.cache import cache_root

    path = cache_root() / "bench-export"
    path.mkdir(parents=True, exist_ok=True)
    return path


# Artifacts -------------------------------------------------------------------------------------


def quantized_smollm2(stage: dict, record: Path):
    """SmolLM2 (model, tokenizer) quantized by ``stage`` on the calibration set; its time goes to ``record``."""
    import tempfile

    import torch

    from lmpress.data import calibration_samples, load_text, tokenize
    from lmpress.loader import load_model
    from lmpress.registry import StageContext, stage_config, stage_handler_for

    torch.manual_seed(0)
    loaded = load_model(SMOLLM2)
    model, tokenizer = loaded.model, loaded.tokenizer
    config = stage_config(stage["method"])(**stage)
    ids = tokenize(tokenizer, load_text(str(WIKITEXT / "wiki.valid.tokens")))
    calibration = calibration_samples(ids, **CALIBRATION)
    with tempfile.TemporaryDirectory() as state:
        ctx = StageContext(calibration=lambda: calibration, state_dir=Path(state), resume=False, fingerprint="export")
        began = time.perf_counter()
        stage_handler_for(config)(model, config, ctx)
        seconds = time.perf_counter() - began
    record.write_text(json.dumps({"stage": stage, "seconds": seconds, "load": os.getloadavg()[0]}))
    return model, tokenizer


def build_f32_gguf(work: Path) -> None:
    from lmpress.export.gguf import write_gguf
    from lmpress.loader import load_model

    loaded = load_model(SMOLLM2)
    write_gguf(loaded.model, loaded.tokenizer, work / "f32.gguf")


def build_fp32_onnx(work: Path) -> None:
    from lmpress.export.onnx import write_onnx
    from lmpress.loader import load_model

    (work / "fp32-onnx").mkdir(exist_ok=True)
    write_onnx(load_model(SMOLLM2).model, work / "fp32-onnx" / "model.onnx")


def build_lmpress(work: Path) -> None:
    """AWQ + GPTQ W4 g32 sym, written as GGUF Q4_0 and as ONNX MatMulNBits (one quantization serves both)."""
    from lmpress.export.gguf import write_gguf
    from lmpress.export.onnx import write_onnx

    model, tokenizer = quantized_smollm2(LMPRESS_STAGE, work / "quantize.json")
    write_gguf(model, tokenizer, work / "lmpress-q4_0.gguf")
    (work / "lmpress-w4-onnx").mkdir(exist_ok=True)
    write_onnx(model, work / "lmpress-w4-onnx" / "model.onnx")


def build_lmpress_q4_k(work: Path) -> None:
    """The same stage with k-quant scales, written as GGUF (ffn_down Q4_K, the 576-column layers Q4_0)."""
    from lmpress.export.gguf import write_gguf

    model, tokenizer = quantized_smollm2(LMPRESS_Q4K_STAGE, work / "quantize-q4_k.json")
    write_gguf(model, tokenizer, work / "lmpress-q4_k.gguf")


def llama_cpp_quantize(work: Path, ftype: int, out: str, overrides: dict[str, int] | None = None) -> None:
    """``llama_model_quantize`` of the F32 GGUF to ``ftype``: ``pure`` (every linear that type, unless a
    tensor-type override regex says otherwise), token embedding and output kept F32 as in lmpress's files."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = THREADS
    params.pure = True
    params.token_embedding_type = llama_cpp.GGML_TYPE_F32
    params.output_tensor_type = llama_cpp.GGML_TYPE_F32
    entries = [llama_cpp.llama_model_tensor_override(p.encode(), t) for p, t in (overrides or {}).items()]
    table = (llama_cpp.llama_model_tensor_override * (len(entries) + 1))(*entries)  # ends with a null pattern
    if entries:
        params.tt_overrides = ctypes.cast(table, ctypes.POINTER(llama_cpp.llama_model_tensor_override))
    tmp = work / f"{out}.tmp"
    status = llama_cpp.llama_model_quantize(str(work / "f32.gguf").encode(), str(tmp).encode(), params)
    if status != 0:
        raise RuntimeError(f"llama_model_quantize returned {status}")
    os.replace(tmp, work / out)


def build_llama_cpp_q4_0(work: Path) -> None:
    import llama_cpp

    llama_cpp_quantize(work, llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, "llama-q4_0.gguf")


def build_llama_cpp_q4_k(work: Path) -> None:
    import llama_cpp

    overrides = {LLAMA_NARROW: llama_cpp.GGML_TYPE_Q4_0}
    llama_cpp_quantize(work, llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_S, "llama-q4_k.gguf", overrides)


def build_llama_cpp_q4_k_pure(work: Path) -> None:
    import llama_cpp

    llama_cpp_quantize(work, llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_S, "llama-q4_k-pure.gguf")


def build_ort_rtn(work: Path) -> None:
    """onnxruntime's MatMulNBitsQuantizer (default RTN algorithm), 4 bits, block 32, symmetric, on the FP32 graph."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    model = onnx.load(str(work / "fp32-onnx" / "model.onnx"))
    config = DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=True, bits=4)
    quantizer = MatMulNBitsQuantizer(model, block_size=32, is_symmetric=True, bits=4, algo_config=config)
    quantizer.process()
    out = work / "ort-rtn-onnx"
    out.mkdir(exist_ok=True)
    quantizer.model.save_model_to_file(str(out / "model.onnx"), use_external_data_format=True)


# build -> (builder, the files it writes, the stage record whose stage must be current, that stage)
BUILDS: dict[str, tuple[Callable[[Path], None], tuple[str, ...], str | None, dict | None]] = {
    "f32-gguf": (build_f32_gguf, ("f32.gguf",), None, None),
    "fp32-onnx": (build_fp32_onnx, ("fp32-onnx/model.onnx",), None, None),
    "lmpress": (build_lmpress, ("lmpress-q4_0.gguf", "lmpress-w4-onnx/model.onnx"), "quantize.json", LMPRESS_STAGE),
    "lmpress-q4k": (build_lmpress_q4_k, ("lmpress-q4_k.gguf",), "quantize-q4_k.json", LMPRESS_Q4K_STAGE),
    "llama": (build_llama_cpp_q4_0, ("llama-q4_0.gguf",), None, None),
    "llama-q4k": (build_llama_cpp_q4_k, ("llama-q4_k.gguf",), None, None),
    "llama-q4k-pure": (build_llama_cpp_q4_k_pure, ("llama-q4_k-pure.gguf",), None, None),
    "ort": (build_ort_rtn, ("ort-rtn-onnx/model.onnx",), None, None),
}


def built(work: Path, build: str) -> bool:
    _, files, record, stage = BUILDS[build]
    if record is not None and not (
        (work / record).exists() and json.loads((work / record).read_text())["stage"] == stage
    ):
        return False
    return all((work / f).exists() for f in files)


def build_all(work: Path, rows: list[str]) -> None:
    """What ``rows`` need and is missing (or was quantized by another stage), each build in its own process."""
    for build in dict.fromkeys(b for row in rows for b in ROWS[row][3]):
        if not built(work, build):
            run_child(["--build", build])


# Measuring ---------------------------------------------------------------------------------------


def eval_windows():
    from transformers import AutoTokenizer

    from lmpress.data import load_text, token_windows, tokenize
    from lmpress.loader import resolve_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(resolve_checkpoint(SMOLLM2))
    ids = tokenize(tokenizer, load_text(str(WIKITEXT / "wiki.test.raw")))
    return token_windows(ids, EVAL["seq_len"], EVAL["windows"]), ids[:PROMPT_TOKENS].tolist()


class LlamaCppRunner:
    def __init__(self, path: Path) -> None:
        import llama_cpp

        self.llm = llama_cpp.Llama(
            str(path), n_ctx=EVAL["seq_len"], n_batch=512, logits_all=True, n_threads=THREADS, verbose=False
        )

    def window_logits(self, window: list[int]):
        import torch

        self.llm.reset()
        self.llm.eval(window)
        return torch.from_numpy(self.llm.scores[: len(window)].copy())

    def decode_seconds(self, prompt: list[int]) -> float:
        self.llm.reset()
        self.llm.eval(prompt)
        began = time.perf_counter()
        for _ in range(NEW_TOKENS):
            token = int(self.llm.scores[self.llm.n_tokens - 1].argmax())
            self.llm.eval([token])
        return time.perf_counter() - began


class OnnxRunner:
    def __init__(self, path: Path) -> None:
        from lmpress.export.onnx import onnx_session

        self.session = onnx_session(path / "model.onnx", threads=THREADS)

    def window_logits(self, window: list[int]):
        import numpy as np
        import torch

        from lmpress.export.onnx import run_decoder

        logits, _ = run_decoder(self.session, np.array([window], np.int64))
        return torch.from_numpy(logits[0])

    def decode_seconds(self, prompt: list[int]) -> float:
        import numpy as np

        from lmpress.export.onnx import run_decoder

        logits, past = run_decoder(self.session, np.array([prompt], np.int64))
        began = time.perf_counter()
        for _ in range(NEW_TOKENS):
            token = int(logits[0, -1].argmax())
            logits, past = run_decoder(self.session, np.array([[token]], np.int64), past)
        return time.perf_counter() - began


def measure_row(name: str, part: str) -> dict:
    """``part`` "ppl" (the reference perplexity) or "decode" (tokens/s) of row ``name``."""
    import math

    import torch

    from lmpress.metrics import token_nll

    runtime, label, artifact, _ = ROWS[name]
    path = work_dir() / artifact
    windows, prompt = eval_windows()
    runner = LlamaCppRunner(path) if runtime == "llama.cpp" else OnnxRunner(path)
    files = [path] if path.is_file() else [p for p in path.iterdir() if p.is_file()]
    row = {"row": name, "runtime": runtime, "label": label, "cpu": cpu_description()}
    for build in ROWS[name][3]:
        record = BUILDS[build][2]
        if record is not None:
            row["quantize"] = json.loads((work_dir() / record).read_text())
    row["size_mb"] = sum(p.stat().st_size for p in files) / 1e6
    if part == "ppl":  # the same number with any thread count (each thread computes whole rows)
        began, nll = time.perf_counter(), []
        for window in windows:
            logits = runner.window_logits(window.tolist()).float()
            nll.append(token_nll(logits[None], window[None]).double())
        row["ppl"] = math.exp(torch.cat(nll, dim=1).mean().item())
        row["eval_seconds"] = time.perf_counter() - began
        row["eval_threads"] = THREADS
    else:
        decode = [runner.decode_seconds(prompt) for _ in range(REPEATS)]
        row["decode_tok_s"] = NEW_TOKENS / statistics.median(decode)
        row["decode_runs_s"] = decode
        row["decode_threads"] = THREADS
        row["load_average"] = os.getloadavg()[0]
    return row


def run_child(args: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, cwd=REPO, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{done.stderr[-4000:]}")
    return done.stdout


# Table --------------------------------------------------------------------------------------------


def table_line(rows: dict[str, dict], name: str, fp32: dict | None, own: dict | None) -> str:
    """One row of the table; an lmpress row (``own`` given) with the goal against the runtime quantizer's row."""
    runtime, label, _, _ = ROWS[name]
    r = rows.get(name)
    if r is None or "ppl" not in r:
        return f"| {runtime} | {label} | not measured | | | | | |"
    delta = "" if name == TABLE[runtime][0] or fp32 is None else f"{r['ppl'] - fp32['ppl']:+.2f}"
    goal = met = ""
    if own is not None and fp32 and "ppl" in fp32 and "ppl" in own:
        removed = 1 - (r["ppl"] - fp32["ppl"]) / (own["ppl"] - fp32["ppl"])
        if name in REPORTED_PAIRS:
            goal = f"none (reported: removes {removed:.0%} of the runtime quantizer's {own['ppl'] - fp32['ppl']:+.2f})"
        else:
            limit = own["ppl"] - (own["ppl"] - fp32["ppl"]) / 2
            goal = f"ppl <= {limit:.2f} (half of the runtime quantizer's {own['ppl'] - fp32['ppl']:+.2f})"
            met = "yes" if r["ppl"] <= limit else "NO"
    speed = f"{r['decode_tok_s']:.1f}" if "decode_tok_s" in r else "not measured"
    return f"| {runtime} | {label} | {r['ppl']:.2f} | {delta} | {speed} | {r['size_mb']:.0f} | {goal} | {met} |"


def render(rows: dict[str, dict]) -> str:
    lines = [
        "| runtime | artifact | ppl | delta vs FP32 in that runtime | decode tok/s | size (MB) | goal | met |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for runtime, (fp32_name, pairs) in TABLE.items():
        fp32 = rows.get(fp32_name)
        lines.append(table_line(rows, fp32_name, fp32, None))
        for ours, theirs in pairs:
            lines.append(table_line(rows, ours, fp32, rows.get(theirs)))
            lines.append(table_line(rows, theirs, fp32, None))
        lines += [table_line(rows, name, fp32, None) for name in EXTRA_ROWS.get(runtime, []) if name in rows]
    notes = [
        "",
        f"SmolLM2-135M-Instruct; perplexity on the first {EVAL['windows']} windows of {EVAL['seq_len']} tokens of "
        "wiki.test.raw (bench/quant_table.py's protocol), decode: "
        f"{PROMPT_TOKENS}-token prompt, {NEW_TOKENS} greedy tokens, median of {REPEATS}, {THREADS} threads.",
        f"lmpress rows: {json.dumps(LMPRESS_STAGE)}, calibration {CALIBRATION['n_samples']} x "
        f"{CALIBRATION['seq_len']} tokens of wiki.valid.tokens (seed {CALIBRATION['seed']}); the Q4_K row: the same "
        f"with {json.dumps({k: v for k, v in LMPRESS_Q4K_STAGE.items() if k not in LMPRESS_STAGE})}.",
        f"llama.cpp's Q4_K row: pure Q4_K_S with tensor-type override `{LLAMA_NARROW}` -> Q4_0.",
    ]
    quantized: dict[tuple[float, float], list[str]] = {}  # one quantization serves several rows
    for name, r in rows.items():
        if "quantize" in r:
            quantized.setdefault((r["quantize"]["seconds"], r["quantize"]["load"]), []).append(name)
    for (seconds, load), names in quantized.items():
        notes.append(
            f"Quantizing for {' and '.join(names)} took {seconds:.0f} s "
            f"(1-minute load average {load:.1f} when it ended)."
        )
    cpus = sorted({r["cpu"] for r in rows.values()})
    loads = "; ".join(f"{n}: {r['load_average']:.1f}" for n, r in rows.items() if "load_average" in r)
    threads = "; ".join(f"{n}: {r['eval_threads']}" for n, r in rows.items() if "eval_threads" in r)
    notes.append(
        f"CPU: {'; '.join(cpus)}, {os.cpu_count()} cores shared with other jobs; 1-minute load average after each "
        f"decode measurement: {loads}. Threads of each perplexity run (the number does not depend on them): {threads}."
    )
    return "\n".join(lines + notes) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {', '.join(ROWS)}")
    parser.add_argument("--reuse", action="store_true", help="keep rows already measured")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--build", choices=list(BUILDS), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS / "export_table.md")
    args = parser.parse_args()
    if args.build:
        BUILDS[args.build][0](work_dir())
        return 0
    if args.one:
        name, _, part = args.one.partition(":")
        print(json.dumps(measure_row(name, part)))
        return 0
    wanted = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in wanted if r not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    print("building artifacts (reused when present) ...", file=sys.stderr, flush=True)
    build_all(work_dir(), wanted)
    ROW_DIR.mkdir(parents=True, exist_ok=True)
    for part in ("ppl", "decode"):  # every row's perplexity first, then every row's decode speed
        for name in wanted:
            path = ROW_DIR / f"{name}.json"
            row = json.loads(path.read_text()) if path.exists() else {}
            if args.reuse and (part in row if part == "ppl" else "decode_tok_s" in row):
                continue
            print(f"measuring {name} {part} ...", file=sys.stderr, flush=True)
            row.update(json.loads(run_child(["--one", f"{name}:{part}"]).strip().splitlines()[-1]))
            path.write_text(json.dumps(row, indent=2) + "\n")
            value = row["ppl"] if part == "ppl" else row["decode_tok_s"]
            print(f"  {part} {value:.3f}", file=sys.stderr, flush=True)
    rows = {n: json.loads((ROW_DIR / f"{n}.json").read_text()) for n in ROWS if (ROW_DIR / f"{n}.json").exists()}
    table = render(rows)
    args.out.write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
