"""Wall time of the quant table's W4 GPTQ stage before and after the calibration-engine refactor (issue 12).

    python bench/engine_time.py                       # 317b6bd (before) and the working tree, interleaved
    python bench/engine_time.py --before REV --rounds 2 --out bench/results/engine_time.json

Both trees run the same stage (bench/quant_table.py's ``gptq-w4-g64`` row: act-order, MSE
scales, calibration 128 x 512 tokens of wiki.valid.tokens, seed 0) on SmolLM2-135M in a fresh
process each, alternating before/after so that load on a shared machine hits both alike; each
run records the stage's seconds, the sha256 of the packed tensors (identical results are part
of the claim) and the 1-minute load average when it ended.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from quant_table import CALIBRATION, ROWS, SMOLLM2, WIKITEXT, cpu_description  # noqa: E402

BEFORE = "317b6bd"  # main just before the merge that moved the engine into lmpress/calib
STAGE = ROWS["gptq-w4-g64"][1]

# Runs inside the tree under test (its lmpress first on sys.path); prints one JSON line.
CHILD = """
import hashlib, json, os, sys, tempfile, time
from pathlib import Path
import torch
from lmpress.data import calibration_samples, load_text, tokenize
from lmpress.loader import load_model
from lmpress.weights.qlinear import QuantizedLinear
try:
    from lmpress.registry import stage_config, stage_handler_for
    config_cls, handler_for = stage_config(STAGE["method"]), stage_handler_for
except ImportError:  # before the refactor lmpress.methods fills the tables
    import lmpress.methods  # noqa: F401
    from lmpress.registry import STAGE_CONFIGS, STAGE_HANDLERS
    config_cls, handler_for = STAGE_CONFIGS[STAGE["method"]], lambda c: STAGE_HANDLERS[type(c)]
from lmpress.registry import StageContext
torch.manual_seed(0)
loaded = load_model(SMOLLM2)
ids = tokenize(loaded.tokenizer, load_text(WIKITEXT + "/wiki.valid.tokens"))
calibration = calibration_samples(ids, **CALIBRATION)
config = config_cls(**STAGE)
with tempfile.TemporaryDirectory() as scratch:
    ctx = StageContext(calibration=lambda: calibration, state_dir=Path(scratch) / "s", resume=False, fingerprint="t")
    ctx.state_dir.mkdir()
    began = time.perf_counter()
    handler_for(config)(loaded.model, config, ctx)
    seconds = time.perf_counter() - began
digest = hashlib.sha256()
for name, module in loaded.model.named_modules():
    if isinstance(module, QuantizedLinear):
        for buffer in ("qweight", "scales", "zeros", "g_idx"):
            value = getattr(module, buffer, None)
            if value is not None:
                digest.update(value.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
print(json.dumps({"seconds": seconds, "packed_sha256": digest.hexdigest(), "load_average": os.getloadavg()[0]}))
"""


def run_tree(tree: Path) -> dict:
    prelude = f"STAGE = {STAGE!r}\nSMOLLM2 = {SMOLLM2!r}\nWIKITEXT = {str(WIKITEXT)!r}\nCALIBRATION = {CALIBRATION!r}\n"
    done = subprocess.run(
        [sys.executable, "-c", prelude + CHILD],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"run in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=BEFORE, help="the commit before the refactor")
    parser.add_argument("--rounds", type=int, default=1, help="before/after pairs")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "engine_time.json")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        old = Path(scratch) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(old), args.before], cwd=REPO, check=True)
        try:
            for round_ in range(args.rounds):
                for label, tree in (("before", old), ("after", REPO)):
                    result = {"tree": label, "round": round_, **run_tree(tree)}
                    print(json.dumps(result), file=sys.stderr, flush=True)
                    runs.append(result)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=REPO, check=False)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    summary = {
        "stage": STAGE,
        "before": args.before,
        "after": head.strip() + " (working tree)",
        "cpu": cpu_description(),
        "runs": runs,
        "identical_packed_tensors": len({r["packed_sha256"] for r in runs}) == 1,
    }
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    for label in ("before", "after"):
        seconds = [r["seconds"] for r in runs if r["tree"] == label]
        print(f"{label}: " + ", ".join(f"{s:.0f} s" for s in seconds))
    print(f"identical packed tensors: {summary['identical_packed_tensors']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
