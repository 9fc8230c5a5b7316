"""FP4 (NVFP4, MXFP4) and rotation quality table on SmolLM2-135M, lmpress beside llm-compressor (issue 49, "Numbers").

    python bench/fp4_table.py --llmc-python PEER/bin/python     # every row, then bench/results/fp4_table.md
    python bench/fp4_table.py --rows gptq-nvfp4a16              # re-measure one row; the table keeps the others
    python bench/fp4_table.py --reuse --llmc-python ...         # measure only rows not measured with these stages

Protocol: bench/quant_table.py's (calibration 128 x 512 tokens of wiki.valid.tokens, seed 0; perplexity on the
first 20 windows of 2048 tokens of wiki.test.raw, CRLF->LF, no BOS). Each lmpress row runs in its own process:
its stages run on the FP32 model, the result is exported (compressed-tensors), read back from disk by lmpress and
that artifact is scored. llm-compressor's rows run in its own virtual environment (installed from the package
index: `python -m venv PEER && PEER/bin/pip install TORCH_CPU_WHEEL llmcompressor==0.14.0.1`) through
bench/llmc_fp4.py on the same tokens (written once into runs/bench-fp4/); their recipes are its own examples.
lm_head (tied to the embeddings) stays float in every row.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from table_rows import copy_fp32_row, kept_rows, measure_in_child, publish, wanted_rows  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's lmpress, before an installed one
from quant_table import CALIBRATION, EVAL, REPO, SMOLLM2, WIKITEXT, cpu_description  # noqa: E402

RESULTS = REPO / "bench" / "results"
ROW_DIR = RESULTS / "fp4_rows"
QUANT_TABLE_FP32 = RESULTS / "rows" / "fp32.json"
PEER_DATA = REPO / "runs" / "bench-fp4"
THREADS = 2

ROTATE = {"method": "rotate"}  # R1 (residual stream) and R2 (v/o per head), fused into the weights
ROTATE_R4 = {"method": "rotate", "rotate_down_proj": True}  # and R4: down_proj's input turned online
# R1 and R2 learned from the Hadamard start for NVFP4 activations (SpinQuant; KL to the float model), R4 as above
LEARNED_R4_NVFP4 = {**ROTATE_R4, "learn": {"activations": "nvfp4", "steps": 64}}
# R4 alone (no R1 or R2): only down_proj's input, where the MLP's activation outliers are, turned online
ROTATE_R4_ONLY = {"method": "rotate", "residual": False, "rotate_heads": False, "rotate_down_proj": True}
# no R1 or R2: every decoder linear's input turned online in blocks of the FP4 block (MR-GPTQ's rotations)
BLOCKS16 = {"method": "rotate", "residual": False, "rotate_heads": False, "input_block": 16}
BLOCKS32 = {**BLOCKS16, "input_block": 32}
# R1 and R2 fused, and every decoder linear's input turned online in blocks of 64 (the input side of
# llm-compressor's QuIP example, whose blocks are 64)
ROTATE_BLOCKS64 = {"method": "rotate", "input_block": 64}
NVFP4A16 = {"fp4": "nvfp4"}
MXFP4A16 = {"fp4": "mxfp4"}
NVFP4 = {"fp4": "nvfp4", "activations": "fp4"}
MXFP4 = {"fp4": "mxfp4", "activations": "fp4"}


def gptq(scheme: dict) -> dict:
    return {"method": "gptq", **scheme, "mse": True}


def rtn(scheme: dict, mse: bool = False) -> dict:
    return {"method": "rtn", **scheme, "mse": mse}


# the block scales and norms distilled end to end against the FP32 model on the calibration samples, as
# recipes/nvfp4-w4a16.yaml's last stage does (its settings read from the recipe, so the row is the recipe's); the
# linear layers' codes stay as the stage before chose them
DISTILL = next(
    stage
    for stage in yaml.safe_load((REPO / "recipes" / "nvfp4-w4a16.yaml").read_text())["stages"]
    if stage["method"] == "distill"
)


def learned(scheme: dict) -> dict:
    """Learned rounding on the CPU budget recipes/learned-w4.yaml took until 2026-12-08 (now 90 steps): 110
    sign-gradient steps of 4 samples from round-to-nearest."""
    return {"method": "learned", **scheme, "iterations": 110, "batch_size": 4, "init": "rtn"}


W4_G64 = {"fp4": None, "bits": 4, "group_size": 64}  # integer W4 g64 (SmolLM2's 576 = 9 x 64)
W4A8_G64 = {**W4_G64, "activations": "int8"}  # and int8 activations per token


# name -> (label, lmpress stages or None for the baseline / a peer row)
ROWS: dict[str, tuple[str, list[dict] | None]] = {
    "fp32": ("FP32 (baseline)", None),
    "llmc-fp32": ("llm-compressor: FP32 through its evaluation (protocol check)", None),
    # weight-only NVFP4
    "llmc-nvfp4a16": ("llm-compressor NVFP4A16 (its preset, min/max observer)", None),
    "llmc-nvfp4a16-gptq": ("llm-compressor NVFP4A16, GPTQ + MSE observer (its MR-GPTQ example)", None),
    "llmc-quip-nvfp4a16-gptq": ("llm-compressor QuIP (Hadamard v, u) + GPTQ NVFP4A16 (its example)", None),
    "rtn-nvfp4a16": ("lmpress RTN NVFP4A16 (min/max scales)", [rtn(NVFP4A16)]),
    "rtn-nvfp4a16-mse": ("lmpress RTN NVFP4A16, MSE scale search", [rtn(NVFP4A16, mse=True)]),
    "gptq-nvfp4a16": ("lmpress GPTQ NVFP4A16, MSE scale search", [gptq(NVFP4A16)]),
    "rotate-gptq-nvfp4a16": ("lmpress rotate + GPTQ NVFP4A16, MSE scale search", [ROTATE, gptq(NVFP4A16)]),
    "rotate-r4-gptq-nvfp4a16": (
        "lmpress rotate (R1 R2 R4) + GPTQ NVFP4A16, MSE scale search",
        [ROTATE_R4, gptq(NVFP4A16)],
    ),
    "rotate-r4-actorder-gptq-nvfp4a16": (
        "lmpress rotate (R1 R2 R4) + GPTQ NVFP4A16 with static act-order, MSE scale search",
        [ROTATE_R4, {**gptq(NVFP4A16), "act_order": True, "static_groups": True}],
    ),
    "rotate-r4-learned-nvfp4a16": (
        "lmpress rotate (R1 R2 R4) + learned rounding NVFP4A16 (110 steps of 4, from round-to-nearest)",
        [ROTATE_R4, learned(NVFP4A16)],
    ),
    "rotate-r4-gptq-distill-nvfp4a16": (
        "lmpress rotate (R1 R2 R4) + GPTQ NVFP4A16, MSE scale search, then block scales and norms distilled",
        [ROTATE_R4, gptq(NVFP4A16), DISTILL],
    ),
    "rotate-blocks64-gptq-nvfp4a16": (
        "lmpress rotate (R1 R2, every linear's input turned online in blocks of 64) + GPTQ NVFP4A16, MSE scale search",
        [ROTATE_BLOCKS64, gptq(NVFP4A16)],
    ),
    # weight-only MXFP4
    "llmc-mxfp4a16": ("llm-compressor MXFP4A16 (its preset)", None),
    "rtn-mxfp4a16": ("lmpress RTN MXFP4A16 (min/max scales)", [rtn(MXFP4A16)]),
    "rtn-mxfp4a16-mse": ("lmpress RTN MXFP4A16, scale search", [rtn(MXFP4A16, mse=True)]),
    "gptq-mxfp4a16": ("lmpress GPTQ MXFP4A16, scale search", [gptq(MXFP4A16)]),
    "rotate-gptq-mxfp4a16": ("lmpress rotate + GPTQ MXFP4A16, scale search", [ROTATE, gptq(MXFP4A16)]),
    "rotate-r4-gptq-mxfp4a16": (
        "lmpress rotate (R1 R2 R4) + GPTQ MXFP4A16, scale search",
        [ROTATE_R4, gptq(MXFP4A16)],
    ),
    "blocks-gptq-mxfp4a16": (
        "lmpress every linear's input turned online in blocks of 32 (no R1) + GPTQ MXFP4A16, scale search",
        [BLOCKS32, gptq(MXFP4A16)],
    ),
    # W4A4
    "llmc-nvfp4": ("llm-compressor NVFP4 W4A4 (its preset, calibrated)", None),
    "llmc-quip-nvfp4": ("llm-compressor QuIP (random Hadamard v, u) + NVFP4 W4A4", None),
    "llmc-spinquant-nvfp4": ("llm-compressor SpinQuant R1 R2 R4 (Hadamard) + NVFP4 W4A4", None),
    "gptq-nvfp4": ("lmpress GPTQ NVFP4 W4A4, MSE scale search", [gptq(NVFP4)]),
    "rotate-gptq-nvfp4": ("lmpress rotate (R1 R2) + GPTQ NVFP4 W4A4, MSE scale search", [ROTATE, gptq(NVFP4)]),
    "rotate-r4-gptq-nvfp4": (
        "lmpress rotate (R1 R2 R4) + GPTQ NVFP4 W4A4, MSE scale search",
        [ROTATE_R4, gptq(NVFP4)],
    ),
    "learned-r4-gptq-nvfp4": (
        "lmpress rotate (R1 R2 learned, 64 steps; R4) + GPTQ NVFP4 W4A4, MSE scale search",
        [LEARNED_R4_NVFP4, gptq(NVFP4)],
    ),
    "r4-only-gptq-nvfp4": (
        "lmpress rotate (R4 only: down_proj's input; no R1 R2) + GPTQ NVFP4 W4A4, MSE scale search",
        [ROTATE_R4_ONLY, gptq(NVFP4)],
    ),
    # W4A8: integer weights, int8 activations
    "gptq-w4a16-g64": ("lmpress GPTQ W4A16 g64, MSE scales", [gptq(W4_G64)]),
    "gptq-w4a8-g64": ("lmpress GPTQ W4A8 g64 (int8 activations per token), MSE scales", [gptq(W4A8_G64)]),
    "rotate-r4-gptq-w4a8-g64": (
        "lmpress rotate (R1 R2 R4) + GPTQ W4A8 g64, MSE scales",
        [ROTATE_R4, gptq(W4A8_G64)],
    ),
    "blocks-gptq-nvfp4": (
        "lmpress every linear's input turned online in blocks of 16 (no R1) + GPTQ NVFP4 W4A4, MSE scale search",
        [BLOCKS16, gptq(NVFP4)],
    ),
    "rtn-mxfp4": ("lmpress RTN MXFP4 W4A4, scale search", [rtn(MXFP4, mse=True)]),
    "rotate-rtn-mxfp4": ("lmpress rotate (R1 R2) + RTN MXFP4 W4A4, scale search", [ROTATE, rtn(MXFP4, mse=True)]),
    "rotate-r4-rtn-mxfp4": (
        "lmpress rotate (R1 R2 R4) + RTN MXFP4 W4A4, scale search",
        [ROTATE_R4, rtn(MXFP4, mse=True)],
    ),
    "blocks-rtn-mxfp4": (
        "lmpress every linear's input turned online in blocks of 32 (no R1) + RTN MXFP4 W4A4, scale search",
        [BLOCKS32, rtn(MXFP4, mse=True)],
    ),
}
PEER_ROWS = [name for name in ROWS if name.startswith("llmc-")]

ROTATED_NVFP4 = [
    "rotate-gptq-nvfp4", "rotate-r4-gptq-nvfp4", "learned-r4-gptq-nvfp4", "r4-only-gptq-nvfp4", "blocks-gptq-nvfp4",
]  # fmt: skip
PEER_W4A4 = ["llmc-nvfp4", "llmc-quip-nvfp4", "llmc-spinquant-nvfp4"]
PEER_NVFP4A16 = ["llmc-nvfp4a16", "llmc-nvfp4a16-gptq", "llmc-quip-nvfp4a16-gptq"]

# (lmpress rows the goal takes the best measured of, goal text, how it is measured: a function of the kept rows'
# deltas and that row -> (bound, met) or None)
GOALS: list[tuple[list[str], str, Any]] = [
    (
        [
            "gptq-nvfp4a16",
            "rotate-gptq-nvfp4a16",
            "rotate-r4-gptq-nvfp4a16",
            "rotate-r4-actorder-gptq-nvfp4a16",
            "rotate-r4-learned-nvfp4a16",
            "rotate-r4-gptq-distill-nvfp4a16",
            "rotate-blocks64-gptq-nvfp4a16",
        ],
        "delta <= 0.7x llm-compressor NVFP4A16's (its best row measured)",
        lambda d, r: _ratio(d, r, min(PEER_NVFP4A16, key=lambda p: d.get(p, float("inf")))),
    ),
    (
        ["gptq-mxfp4a16", "rotate-gptq-mxfp4a16", "rotate-r4-gptq-mxfp4a16", "blocks-gptq-mxfp4a16"],
        "delta <= 0.7x RTN MXFP4's",
        lambda d, r: _ratio(d, r, "rtn-mxfp4a16"),
    ),
    (
        ["rotate-r4-gptq-w4a8-g64"],
        "delta <= 1.2x W4A16's at the same group size",
        lambda d, r: _ratio(d, r, "gptq-w4a16-g64", 1.2),
    ),
    (ROTATED_NVFP4, "delta <= 0.5x without rotation", lambda d, r: _ratio(d, r, "gptq-nvfp4", 0.5)),
    (ROTATED_NVFP4, "delta <= llm-compressor's best W4A4", lambda d, r: _at_most_best(d, r, PEER_W4A4)),
]


def _ratio(deltas: dict[str, float], row: str, against: str, factor: float = 0.7) -> tuple[str, bool] | None:
    if row not in deltas or against not in deltas:
        return None
    ratio = deltas[row] / deltas[against]
    return f"{ratio:.2f}x", ratio <= factor


def _at_most_best(deltas: dict[str, float], row: str, peers: list[str]) -> tuple[str, bool] | None:
    measured = [deltas[p] for p in peers if p in deltas]
    if row not in deltas or not measured:
        return None
    return f"{deltas[row]:+.2f} vs {min(measured):+.2f}", deltas[row] <= min(measured)


def measure_row(name: str) -> dict:
    """Load SmolLM2, run row ``name``'s stages, export compressed-tensors, read it back and score it."""
    import torch

    from lmpress.data import calibration_samples, load_text, token_windows, tokenize
    from lmpress.evals.perplexity import PerplexityConfig, perplexity
    from lmpress.loader import load_model
    from lmpress.registry import StageContext, exporter, stage_config, stage_handler_for

    torch.manual_seed(0)
    torch.set_num_threads(THREADS)
    label, stages = ROWS[name]
    loaded = load_model(SMOLLM2)
    model, tokenizer = loaded.model, loaded.tokenizer
    windows = token_windows(tokenize(tokenizer, load_text(str(WIKITEXT / "wiki.test.raw"))), **_window_args())
    calibration = calibration_samples(
        tokenize(tokenizer, load_text(str(WIKITEXT / "wiki.valid.tokens"))), **CALIBRATION
    )
    summaries, seconds = [], 0.0
    with tempfile.TemporaryDirectory() as work:
        for i, stage in enumerate(stages):
            config = stage_config(stage["method"])(**stage)
            ctx = StageContext(
                calibration=lambda: calibration,
                state_dir=Path(work) / f"state{i}",
                resume=False,
                fingerprint=name,
                tokenizer=tokenizer,
                text_source=str(WIKITEXT / "wiki.valid.tokens"),
                teacher=lambda source: load_model(source or SMOLLM2).model,
            )
            began = time.perf_counter()
            summaries.append(stage_handler_for(config)(model, config, ctx))
            seconds += time.perf_counter() - began
        out = Path(work) / "artifact"
        out.mkdir()
        exporter("compressed-tensors")(model, tokenizer, out)
        size = sum(p.stat().st_size for p in out.rglob("*.safetensors"))
        del model, loaded
        model = load_model(str(out), fingerprint=False).model
        load_average = os.getloadavg()[0]
        result = perplexity(model, windows, PerplexityConfig(**EVAL, batch_size=1))
    return {
        "row": name,
        "label": label,
        "stages": stages,
        "ppl": result["ppl"],
        "seconds": seconds,
        "safetensors_bytes": size,
        "summary": summaries,
        "load_average": load_average,
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu_description(),
    }


def row_from_run(name: str, run: Path) -> dict:
    """Row ``name`` from a ``lmpress run`` of the same stages on this table's protocol (``run``: its output folder):
    the score is that run's candidate, its compressed-tensors export read back from disk, as ``measure_row`` scores
    one (recipes/nvfp4-w4a16.yaml reproduced row rotate-r4-gptq-distill-nvfp4a16 to the last digit, 21.664826445122124,
    on 2026-12-06). Refused unless the run's stages, calibration and perplexity protocol are this table's."""
    import json as json_

    from lmpress.registry import stage_config

    report = json_.loads((run / "report.json").read_text())
    recipe = report["recipe"]
    wanted = [json_.loads(stage_config(s["method"])(**s).model_dump_json()) for s in ROWS[name][1]]
    data, ppl = recipe["data"], recipe["eval"].get("perplexity") or {}
    same = (
        recipe["stages"] == wanted
        and (data["source"], data["samples"], data["seq_len"], data["seed"])
        == ("builtin:wikitext2:valid", CALIBRATION["n_samples"], CALIBRATION["seq_len"], CALIBRATION["seed"])
        and (recipe["eval"]["text"], ppl.get("seq_len"), ppl.get("windows"), ppl.get("stride"), ppl.get("bos"))
        == ("builtin:wikitext2:test", EVAL["seq_len"], EVAL["windows"], None, False)
        and recipe["export"]["formats"][0] == "compressed-tensors"
    )
    if not same:
        raise SystemExit(f"{run}: its stages, calibration, eval or first export are not row {name}'s protocol")
    return {
        "row": name,
        "label": ROWS[name][0],
        "stages": ROWS[name][1],
        "ppl": report["candidate"]["metrics"]["ppl"],
        "seconds": sum(stage["seconds"] for stage in report["stages"]),
        "safetensors_bytes": sum(p.stat().st_size for p in (run / "compressed-tensors").rglob("*.safetensors")),
        "summary": [stage["summary"] for stage in report["stages"]],
        "torch_threads": THREADS,
        "cpu": cpu_description(),
        "from_run": f"lmpress run, {run / 'report.json'}",
    }


def _window_args() -> dict:
    return {"seq_len": EVAL["seq_len"], "n_windows": EVAL["windows"]}


def write_peer_data() -> tuple[Path, Path]:
    """SmolLM2 as a float32 HF checkpoint and the calibration samples + eval windows, for llm-compressor's rows."""
    import torch

    from lmpress.data import calibration_samples, load_text, token_windows, tokenize
    from lmpress.loader import gguf_to_checkpoint, package_file

    model_dir = gguf_to_checkpoint(package_file(SMOLLM2))
    data = PEER_DATA / "tokens.pt"
    if not data.exists():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        windows = token_windows(tokenize(tokenizer, load_text(str(WIKITEXT / "wiki.test.raw"))), **_window_args())
        calib = calibration_samples(tokenize(tokenizer, load_text(str(WIKITEXT / "wiki.valid.tokens"))), **CALIBRATION)
        PEER_DATA.mkdir(parents=True, exist_ok=True)
        torch.save({"calibration": calib.cpu(), "windows": windows.cpu()}, data)
    return model_dir, data


def measure_peer_row(name: str, python: str) -> dict:
    model_dir, data = write_peer_data()
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS)}
    began = time.perf_counter()
    done = subprocess.run(
        [python, str(REPO / "bench" / "llmc_fp4.py"), name, str(model_dir), str(data)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        print(done.stderr[-4000:], file=sys.stderr)
        raise SystemExit(done.returncode)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        **result,
        "label": ROWS[name][0],
        "stages": None,
        "wall_seconds": time.perf_counter() - began,
        "load_average": os.getloadavg()[0],
        "cpu": cpu_description(),
    }


def render(rows: list[dict]) -> str:
    measured = {r["row"]: r for r in rows}
    base = measured.get("fp32", {}).get("ppl")
    deltas = {name: r["ppl"] - base for name, r in measured.items() if base is not None}
    lines = ["| row | ppl | delta vs FP32 | seconds | weights on disk (MB) |", "| --- | --- | --- | --- | --- |"]
    for name, (label, _) in ROWS.items():
        r = measured.get(name)
        if r is None:
            lines.append(f"| {label} | not measured | | | |")
            continue
        delta = "" if name == "fp32" or base is None else f"{deltas[name]:+.2f}"
        secs = "" if r.get("seconds") is None else f"{r['seconds']:.0f}"
        size = "" if not r.get("safetensors_bytes") else f"{r['safetensors_bytes'] / 1e6:.0f}"
        lines.append(f"| {label} | {r['ppl']:.2f} | {delta} | {secs} | {size} |")
    lines += ["", "| goal | row | measured | met |", "| --- | --- | --- | --- |"]
    for candidates, text, check in GOALS:
        row = min((r for r in candidates if r in deltas), key=deltas.get, default=candidates[0])
        outcome = check(deltas, row)
        measured_text, met = ("not measured", "") if outcome is None else (outcome[0], "yes" if outcome[1] else "NO")
        lines.append(f"| {text} | {ROWS[row][0]} | {measured_text} | {met} |")
    versions = sorted({json.dumps(r["versions"], sort_keys=True) for r in rows if r.get("versions")})
    notes = [
        "",
        f"SmolLM2-135M-Instruct (FP32), calibration {CALIBRATION['n_samples']} x {CALIBRATION['seq_len']} tokens of "
        f"wiki.valid.tokens (seed {CALIBRATION['seed']}), perplexity on the first {EVAL['windows']} windows of "
        f"{EVAL['seq_len']} tokens of wiki.test.raw (`python bench/fp4_table.py`). lmpress rows: the "
        "compressed-tensors export read back from disk; llm-compressor rows: its model as it leaves it in memory "
        "(fake-quantized forward), scored on the same tokens by bench/llmc_fp4.py. Seconds: the stages' wall time "
        f"({THREADS} threads; llm-compressor: its oneshot call).",
    ]
    if versions:
        notes.append(f"Peer versions: {'; '.join(versions)}.")
    cpus = sorted({r["cpu"] for r in rows if r.get("cpu")})
    if cpus:
        notes.append(f"CPU: {'; '.join(cpus)}, {os.cpu_count()} cores.")
    hosts = {cpu: f"host {i + 1}" for i, cpu in enumerate(cpus)} if len(cpus) > 1 else {}
    if hosts:
        notes[-1] = f"CPUs: {'; '.join(f'{tag}: {cpu}' for cpu, tag in hosts.items())}; {os.cpu_count()} cores."
    loads = [
        f"{r['row']}: {r['load_average']:.1f}" + (f" ({hosts[r['cpu']]})" if r.get("cpu") in hosts else "")
        for r in rows
        if r.get("load_average") is not None
    ]
    if loads:
        notes.append(f"1-minute load average before each eval ({'; '.join(loads)}).")
    return "\n".join(lines + notes) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {', '.join(ROWS)}")
    parser.add_argument("--reuse", action="store_true", help="keep rows measured before with the same stages")
    parser.add_argument("--llmc-python", help="python of llm-compressor's virtual environment (its rows need it)")
    parser.add_argument("--from-run", type=Path, help="take the one row of --rows from this lmpress run's folder")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure_row(args.one)))
        return 0
    if args.from_run:
        (name,) = wanted_rows(parser, args.rows, ROWS)
        (ROW_DIR / f"{name}.json").write_text(json.dumps(row_from_run(name, args.from_run), indent=2) + "\n")
    to_measure = [] if args.from_run else copy_fp32_row(wanted_rows(parser, args.rows, ROWS), ROW_DIR, QUANT_TABLE_FP32)
    for name in to_measure:
        path = ROW_DIR / f"{name}.json"
        if args.reuse and path.exists() and json.loads(path.read_text()).get("stages") == ROWS[name][1]:
            continue
        peer = name in PEER_ROWS
        if peer and not args.llmc_python:
            print(f"skipping {name}: give --llmc-python", file=sys.stderr)
            continue
        print(f"measuring {name} ...", file=sys.stderr, flush=True)
        result = measure_peer_row(name, args.llmc_python) if peer else measure_in_child(__file__, "--one", name)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"  {name}: ppl {result['ppl']:.3f}  seconds {result['seconds']:.0f}", file=sys.stderr, flush=True)
    table = render(list(kept_rows(ROW_DIR, ROWS).values()))
    publish(table, RESULTS / "fp4_table.md", ("fp4-table", "FP4 and rotations"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
