"""lmpress's calibrated W4 exports against each runtime's own 4-bit quantizer, in that runtime (issue 15).

    python bench/export_table.py            # build what is missing, measure every row, write the table
    python bench/export_table.py --reuse    # keep rows already measured (artifacts are always reused)

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

Perplexity: bench/quant_table.py's protocol (first 20 windows of 2048 tokens of wiki.test.raw,
CRLF -> LF, no BOS, lmpress's tokenizer), the runtime's logits scored with lmpress's token_nll.
Decode: 128-token prompt, 64 greedy tokens, median of 3, 2 threads. Goal: in each runtime,
lmpress's degradation over that runtime's FP32 at most half of the runtime quantizer's.
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
# One thread: on this shared 2-core machine (load average ~5), 2 threads made every op wait for a
# descheduled worker (llama.cpp Q4_0 decoded at 0.7 tok/s with 2 threads).
THREADS = 1
PROMPT_TOKENS, NEW_TOKENS, REPEATS = 128, 64, 3
# row -> (runtime, label, artifact under the work directory)
ROWS: dict[str, tuple[str, str, str]] = {
    "llama-fp32": ("llama.cpp", "FP32 (F32 GGUF written by lmpress)", "f32.gguf"),
    "llama-lmpress": ("llama.cpp", "lmpress AWQ + GPTQ W4 g32 sym -> GGUF Q4_0", "lmpress-q4_0.gguf"),
    "llama-own": ("llama.cpp", "llama.cpp's own Q4_0 (llama_model_quantize)", "llama-q4_0.gguf"),
    "ort-fp32": ("onnxruntime", "FP32 (ONNX written by lmpress)", "fp32-onnx"),
    "ort-lmpress": ("onnxruntime", "lmpress AWQ + GPTQ W4 g32 sym -> MatMulNBits", "lmpress-w4-onnx"),
    "ort-own": ("onnxruntime", "onnxruntime's own RTN int4 (MatMulNBitsQuantizer, block 32, sym)", "ort-rtn-onnx"),
}


def work_dir() -> Path:
    from lmpress.cache import cache_root

    path = cache_root() / "bench-export"
    path.mkdir(parents=True, exist_ok=True)
    return path


# Artifacts -------------------------------------------------------------------------------------


def build_lmpress_artifacts(work: Path) -> None:
    """FP32 GGUF/ONNX, then GPTQ W4 g32 sym and its GGUF/ONNX (one quantization serves both)."""
    import tempfile

    import torch

    from lmpress.data import calibration_samples, load_text, tokenize
    from lmpress.export.gguf import write_gguf
    from lmpress.export.onnx import write_onnx
    from lmpress.model import load_model
    from lmpress.registry import StageContext, stage_config, stage_handler_for

    torch.manual_seed(0)
    loaded = load_model(SMOLLM2)
    model, tokenizer = loaded.model, loaded.tokenizer
    if not (work / "f32.gguf").exists():
        write_gguf(model, tokenizer, work / "f32.gguf")
    if not (work / "fp32-onnx" / "model.onnx").exists():
        (work / "fp32-onnx").mkdir(exist_ok=True)
        write_onnx(model, work / "fp32-onnx" / "model.onnx")
    record = work / "quantize.json"
    built = record.exists() and json.loads(record.read_text())["stage"] == LMPRESS_STAGE
    if built and (work / "lmpress-q4_0.gguf").exists() and (work / "lmpress-w4-onnx" / "model.onnx").exists():
        return
    config = stage_config(LMPRESS_STAGE["method"])(**LMPRESS_STAGE)
    ids = tokenize(tokenizer, load_text(str(WIKITEXT / "wiki.valid.tokens")))
    calibration = calibration_samples(ids, **CALIBRATION)
    with tempfile.TemporaryDirectory() as state:
        ctx = StageContext(calibration=lambda: calibration, state_dir=Path(state), resume=False, fingerprint="export")
        began = time.perf_counter()
        stage_handler_for(config)(model, config, ctx)
        seconds = time.perf_counter() - began
    (work / "quantize.json").write_text(
        json.dumps({"stage": LMPRESS_STAGE, "seconds": seconds, "load": os.getloadavg()[0]})
    )
    write_gguf(model, tokenizer, work / "lmpress-q4_0.gguf")
    (work / "lmpress-w4-onnx").mkdir(exist_ok=True)
    write_onnx(model, work / "lmpress-w4-onnx" / "model.onnx")


def build_llama_cpp_q4_0(work: Path) -> None:
    """llama.cpp's own Q4_0 of the F32 GGUF: every linear Q4_0, token embedding (and output) kept F32."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    params.nthread = THREADS
    params.pure = True
    params.token_embedding_type = llama_cpp.GGML_TYPE_F32
    params.output_tensor_type = llama_cpp.GGML_TYPE_F32
    src, dst = str(work / "f32.gguf").encode(), str(work / "llama-q4_0.gguf.tmp").encode()
    status = llama_cpp.llama_model_quantize(src, dst, params)
    if status != 0:
        raise RuntimeError(f"llama_model_quantize returned {status}")
    os.replace(work / "llama-q4_0.gguf.tmp", work / "llama-q4_0.gguf")


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


def build_all(work: Path) -> None:
    record = work / "quantize.json"
    current = record.exists() and json.loads(record.read_text())["stage"] == LMPRESS_STAGE
    if not current or not all(
        (work / f).exists() for f in ("f32.gguf", "lmpress-q4_0.gguf", "lmpress-w4-onnx/model.onnx")
    ):
        run_child(["--build", "lmpress"])  # the model and its quantization in their own process
    if not (work / "llama-q4_0.gguf").exists():
        run_child(["--build", "llama"])
    if not (work / "ort-rtn-onnx" / "model.onnx").exists():
        run_child(["--build", "ort"])


# Measuring ---------------------------------------------------------------------------------------


def eval_windows():
    from transformers import AutoTokenizer

    from lmpress.data import load_text, token_windows, tokenize
    from lmpress.model import resolve_checkpoint

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

    from lmpress.evals.perplexity import token_nll

    runtime, label, artifact = ROWS[name]
    path = work_dir() / artifact
    windows, prompt = eval_windows()
    runner = LlamaCppRunner(path) if runtime == "llama.cpp" else OnnxRunner(path)
    files = [path] if path.is_file() else [p for p in path.iterdir() if p.is_file()]
    row = {"row": name, "runtime": runtime, "label": label, "cpu": cpu_description()}
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


def render(rows: dict[str, dict]) -> str:
    lines = [
        "| runtime | artifact | ppl | delta vs FP32 in that runtime | decode tok/s | size (MB) | goal | met |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for runtime, prefix in (("llama.cpp", "llama"), ("onnxruntime", "ort")):
        fp32, ours, own = (rows.get(f"{prefix}-{k}") for k in ("fp32", "lmpress", "own"))
        for key in ("fp32", "lmpress", "own"):
            r = rows.get(f"{prefix}-{key}")
            label = ROWS[f"{prefix}-{key}"][1]
            if r is None:
                lines.append(f"| {runtime} | {label} | not measured | | | | | |")
                continue
            delta = "" if key == "fp32" or fp32 is None else f"{r['ppl'] - fp32['ppl']:+.2f}"
            goal = met = ""
            if key == "lmpress" and fp32 and own and "ppl" in fp32 and "ppl" in own:
                limit = own["ppl"] - (own["ppl"] - fp32["ppl"]) / 2
                goal = f"ppl <= {limit:.2f} (half of the runtime quantizer's {own['ppl'] - fp32['ppl']:+.2f})"
                met = "yes" if r["ppl"] <= limit else "NO"
            if "ppl" not in r:
                lines.append(f"| {runtime} | {label} | not measured | | | | | |")
                continue
            speed = f"{r['decode_tok_s']:.1f}" if "decode_tok_s" in r else "not measured"
            lines.append(
                f"| {runtime} | {label} | {r['ppl']:.2f} | {delta} | {speed} | {r['size_mb']:.0f} | {goal} | {met} |"
            )
    notes = [
        "",
        f"SmolLM2-135M-Instruct; perplexity on the first {EVAL['windows']} windows of {EVAL['seq_len']} tokens of "
        "wiki.test.raw (bench/quant_table.py's protocol), decode: "
        f"{PROMPT_TOKENS}-token prompt, {NEW_TOKENS} greedy tokens, median of {REPEATS}, {THREADS} threads.",
        f"lmpress rows: {json.dumps(LMPRESS_STAGE)}, calibration {CALIBRATION['n_samples']} x "
        f"{CALIBRATION['seq_len']} tokens of wiki.valid.tokens (seed {CALIBRATION['seed']}).",
    ]
    quantize = work_dir() / "quantize.json"
    if quantize.exists():
        info = json.loads(quantize.read_text())
        notes.append(
            f"Quantizing took {info['seconds']:.0f} s (1-minute load average {info['load']:.1f} when it ended)."
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
    parser.add_argument("--build", choices=["lmpress", "llama", "ort"], help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS / "export_table.md")
    args = parser.parse_args()
    if args.build:
        {"lmpress": build_lmpress_artifacts, "llama": build_llama_cpp_q4_0, "ort": build_ort_rtn}[args.build](
            work_dir()
        )
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
    build_all(work_dir())
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
