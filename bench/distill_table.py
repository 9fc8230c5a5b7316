"""Distillation table on SmolLM2-135M (issue 16, "Numbers"), written into the README.

    python bench/distill_table.py                        # every row, then bench/results/distill_table.md and README
    python bench/distill_table.py --rows recover-w3      # one row; the table keeps the others
    python bench/distill_table.py --reuse                # reuse runs whose report holds the same recipe

Rows, each the recipe of the same name run by ``lmpress run`` in its own process (2 CPU threads):

- ``recover-24``, ``recover-w3``: the recipe's candidate (its export read back from disk) against
  the model before training: the same recipe without its distill stage, or, when its
  compression stages are the very stages of a row of bench/quant_table.py or
  bench/prune_table.py (same settings, same calibration and perplexity protocol), that row.
  Gap closed = (before − after) / (before − FP32), FP32 being the run's own baseline.
- ``draft-student``: the recipe's export (half the layers, distilled, W4 with a W8 head) as the
  draft of the FP32 model in lmpress's runtime: greedy speculative decoding of the grounded
  prompt of bench/runtime.py against plain decoding, acceptance rate and speedup, output
  checked token for token; both with torch.compile'd steps (the runtime's fastest plain
  decoding on a CPU, the one the goal is judged against) and eager. Decode rates exclude the
  prefill (both models read the prompt before the first token); plain and speculative runs are
  timed in turn (``interleaved_generation_times``), and the whole run's ratio is given beside. The draft scores the
  ``DRAFT_VOCAB`` tokens most frequent in its training text (``restrict_vocabulary``; the
  target verifies over the whole vocabulary); compiled with the whole vocabulary is given beside.
  Each speculative measurement runs in a fresh process; the goal's (compiled) in ``PROCESSES`` of them,
  judged by the median speedup. A reused run made with another eval section or gates than the
  recipe's is scored again with ``lmpress eval`` (into ``runs/bench-distill/draft-student-eval``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_table import cpu_description  # noqa: E402
from recipe_run import lmpress_run, normalized  # noqa: E402
from table_rows import publish, row_parser, wanted_rows  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
ROW_DIR = RESULTS / "distill_rows"
RUNS = REPO / "runs" / "bench-distill"
ROWS = {
    "recover-24": ("SparseGPT 2:4, then distilled (2:4 masks fixed)", "recipes/recover-24.yaml"),
    "recover-w3": ("GPTQ W3 g64, then distilled (fake-quantized, re-exported packed)", "recipes/recover-w3.yaml"),
    "draft-student": ("half the layers, distilled, W4 g64 (head W8): speculative draft", "recipes/draft-student.yaml"),
}
# earlier tables that measured a compressed model with the same protocol: (row file, its stages)
EARLIER_ROWS = [RESULTS / "prune_rows" / "sparsegpt-24.json", RESULTS / "rows" / "gptq-w3-g64.json"]
EARLIER_CPU = "AMD EPYC without AVX-512 (a row measured before rows named their CPU)"
GAP_GOAL = 0.40
SPEEDUP_GOAL = 1.3
DRAFT_VOCAB = 16384
PROCESSES = 3  # fresh processes that measure the draft row's compiled speedup (the median judges the goal)
THREADS = 2


def ppl_before(recipe: dict, name: str, reuse: bool) -> tuple[float, str]:
    """Perplexity of the model the recipe's compression stages make, and where it was measured."""
    stages = [s for s in recipe["stages"] if s["method"] != "distill"]
    for path in EARLIER_ROWS:
        if path.exists():
            row = json.loads(path.read_text())
            if normalized(row.get("stages") or [row["stage"]]) == normalized(stages):
                return row["ppl"], str(path.relative_to(REPO))
    report = lmpress_run({**recipe, "stages": stages, "gates": []}, RUNS / f"{name}-before", reuse, THREADS)
    return report["candidate"]["metrics"]["ppl"], f"{RUNS.name}/{name}-before"


def measure_recovery(name: str, recipe: dict, reuse: bool) -> dict:
    report = lmpress_run(recipe, RUNS / name, reuse, THREADS)
    before, source = ppl_before(recipe, name, reuse)
    fp32 = report["baseline"]["metrics"]["ppl"]
    after = report["candidate"]["metrics"]["ppl"]
    train = next(s for s in report["stages"] if s["method"] == "distill")
    summary = train["summary"]
    return {
        "row": name,
        "fp32": fp32,
        "before": before,
        "before_from": source,
        "after": after,
        "gap_closed": (before - after) / (before - fp32),
        "train_seconds": summary["train_seconds"],
        "steps": summary["steps"],
        "tokens": summary["tokens"],
        "tokens_per_s": summary["tokens_per_s"],
        "device": train["device"],
        "cpu": cpu_description(),
        "export_checks_passed": all(c["passed"] for c in report["export_checks"]),
        "run": str((RUNS / name).relative_to(REPO)),
    }


def speculative_in_process(export: Path, compile: bool, vocab: tuple[int, str] | None) -> dict:
    """bench/runtime.py's speculative row for the draft ``export``, measured in a fresh process."""
    spec = {"draft": str(export), "compile": compile, "vocab": vocab}
    child = [sys.executable, __file__, "--speculative", json.dumps(spec)]
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS)}
    done = subprocess.run(child, capture_output=True, text=True, cwd=REPO, env=env, check=False)
    if done.returncode != 0:
        sys.exit(f"speculative measurement of {export} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_speculative(spec: dict) -> dict:
    sys.path.insert(0, str(REPO / "bench"))
    import torch
    from runtime import row_speculative

    torch.set_num_threads(THREADS)
    args = argparse.Namespace(new_tokens=256, repeats=5, prompt_tokens=128)
    return row_speculative(args, spec["draft"], spec["compile"], *(spec["vocab"] or ()))


def evaluated(report: dict, recipe: dict, export: Path, out: Path) -> dict:
    """``report``, or where it was made with another eval section or gates than ``recipe``'s (a reused run),
    ``lmpress eval`` of ``export`` against the recipe's model with the recipe's eval and gates."""
    wanted = {"eval": recipe.get("eval"), "gates": recipe.get("gates", [])}
    if normalized_eval(report["recipe"]) == normalized_eval(wanted):
        return report
    if (out / "report.json").exists():  # scored before: reused while its eval and gates are still the recipe's
        earlier = json.loads((out / "report.json").read_text())
        if normalized_eval(earlier["recipe"]) == normalized_eval(wanted):
            return earlier
    out.mkdir(parents=True, exist_ok=True)
    suite = out.parent / f"{out.name}.yaml"
    suite.write_text(yaml.safe_dump(wanted, sort_keys=False))
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS)}
    command = [sys.executable, "-m", "lmpress.cli", "eval", str(export), "--suite", str(suite)]
    command += ["--baseline", recipe["model"]["source"], "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, env=env, check=False)
    if done.returncode not in (0, 1):  # 1: a gate failed, which the table reports
        sys.exit(f"{suite}: lmpress eval exited {done.returncode}")
    return json.loads((out / "report.json").read_text())


def normalized_eval(recipe: dict) -> tuple[dict, list[str]]:
    """A recipe's eval section and gates with every default filled in, as a run's report.json holds them."""
    from lmpress.recipe import parse_recipe

    raw = {"model": {"source": "unused"}, "eval": recipe.get("eval") or {}, "gates": recipe.get("gates") or []}
    as_run = parse_recipe(raw).as_dict()
    return as_run["eval"], as_run["gates"]


def measure_draft(name: str, recipe: dict, reuse: bool) -> dict:
    report = lmpress_run(recipe, RUNS / name, reuse, THREADS)
    export = RUNS / name / recipe["export"]["formats"][0]
    scores = evaluated(report, recipe, export, RUNS / f"{name}-eval")
    # Against the runtime's fastest plain decoding (torch.compile'd steps, the draft's and the verifications'
    # compiled too); the eager pair is reported beside it. A process's plain rate moves by up to ~15% from
    # one process to the next on this machine (55-64 tok/s compiled) while the speculative one moves less,
    # so the goal's row is measured in PROCESSES fresh processes and judged by the median speedup.
    train = next(s for s in report["stages"] if s["method"] == "distill")
    distill = next(s for s in recipe["stages"] if s["method"] == "distill")
    vocab = (DRAFT_VOCAB, distill.get("text") or recipe["data"]["source"])
    runs = sorted((speculative_in_process(export, True, vocab) for _ in range(PROCESSES)), key=speedup_of)
    spec = runs[len(runs) // 2]
    eager = speculative_in_process(export, False, vocab)
    whole = speculative_in_process(export, True, None)
    return {
        "row": name,
        "fp32": scores["baseline"]["metrics"]["ppl"],
        "after": scores["candidate"]["metrics"]["ppl"],
        "eval_text": scores["recipe"]["eval"]["text"],
        "top1_agreement": scores["candidate"]["metrics"].get("top1_agreement"),
        "gates_passed": scores["passed"],
        "train_seconds": train["summary"]["train_seconds"],
        "steps": train["summary"]["steps"],
        "tokens": train["summary"]["tokens"],
        "tokens_per_s": train["summary"]["tokens_per_s"],
        "device": train["device"],
        "cpu": cpu_description(),
        "plain_tok_s": spec["spec_plain_decode_tok_s"],
        "speculative_tok_s": spec["spec_decode_tok_s"],
        "speedup": spec["spec_speedup"],
        "whole_run_speedup": spec["spec_whole_run_speedup"],
        "acceptance_rate": spec["spec_acceptance_rate"],
        "identical": all(r["spec_identical_to_plain"] for r in runs),
        "processes": [
            {
                "plain_tok_s": r["spec_plain_decode_tok_s"],
                "speculative_tok_s": r["spec_decode_tok_s"],
                "speedup": speedup_of(r),
                "whole_run_speedup": r["spec_whole_run_speedup"],
            }
            for r in runs
        ],
        "draft_vocab": {"tokens": vocab[0], "text": vocab[1]},
        "whole_vocab": {
            "plain_tok_s": whole["spec_plain_decode_tok_s"],
            "speculative_tok_s": whole["spec_decode_tok_s"],
            "speedup": whole["spec_speedup"],
            "acceptance_rate": whole["spec_acceptance_rate"],
            "identical": whole["spec_identical_to_plain"],
        },
        "eager": {
            "plain_tok_s": eager["spec_plain_decode_tok_s"],
            "speculative_tok_s": eager["spec_decode_tok_s"],
            "speedup": eager["spec_speedup"],
            "acceptance_rate": eager["spec_acceptance_rate"],
            "identical": eager["spec_identical_to_plain"],
        },
        "run": str((RUNS / name).relative_to(REPO)),
    }


def speedup_of(row: dict) -> float:
    return row["spec_speedup"]


def render(rows: dict[str, dict]) -> str:
    lines = [
        "| student | FP32 ppl | before | after | gap closed | training | goal | met |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, (label, _) in ROWS.items():
        r = rows.get(name)
        if r is None:
            lines.append(f"| {label} | not measured | | | | | | |")
            continue
        training = f"{r['steps']} steps, {r['tokens']:,} tokens, {r['train_seconds'] / 60:.1f} min ({r['device']})"
        if name == "draft-student":
            goal = f"speedup >= {SPEEDUP_GOAL}x, identical output"
            met = r["speedup"] >= SPEEDUP_GOAL and r["identical"]
            result = (
                ""
                if r.get("top1_agreement") is None
                else (
                    f"on {r['eval_text']}: ppl {r['after']:.2f} vs FP32 {r['fp32']:.2f}, top-1 agreement with FP32 "
                    f"{r['top1_agreement']:.2f} (recipe gates passed: {r['gates_passed']}); "
                )
            )
            processes = r.get("processes", [])
            result += (
                f"compiled{f', the median of {len(processes)} processes' if processes else ''}: speculative "
                f"{r['speculative_tok_s']:.1f} vs plain {r['plain_tok_s']:.1f} tok/s = **{r['speedup']:.2f}x**, "
                f"acceptance {r['acceptance_rate']:.2f}, identical: {r['identical']}"
            )
            if processes:
                result += (
                    " (each process: "
                    + ", ".join(
                        f"{p['speculative_tok_s']:.1f} vs {p['plain_tok_s']:.1f} = {p['speedup']:.2f}x"
                        for p in processes
                    )
                    + ")"
                )
            if "whole_run_speedup" in r:
                result += f"; the whole run, both models' prefills included: {r['whole_run_speedup']:.2f}x"
            if "draft_vocab" in r:
                v = r["draft_vocab"]
                result += f"; the draft scoring the {v['tokens']:,} tokens most frequent in {v['text']}"
            for mode in ("eager", "whole_vocab"):
                if mode in r:
                    e = r[mode]
                    result += (
                        f"; {'eager' if mode == 'eager' else 'compiled, whole vocabulary'}: "
                        f"{e['speculative_tok_s']:.1f} vs {e['plain_tok_s']:.1f} tok/s = {e['speedup']:.2f}x, "
                        f"identical: {e['identical']}"
                    )
            ppl = "| |" if r.get("top1_agreement") is not None else f"| {r['fp32']:.2f} | | {r['after']:.2f} |"
            lines.append(f"| {label} {ppl} {result} | {training} | {goal} | {'yes' if met else 'NO'} |")
            continue
        met = r["gap_closed"] >= GAP_GOAL and r["export_checks_passed"]
        lines.append(
            f"| {label} | {r['fp32']:.2f} | {r['before']:.2f} | {r['after']:.2f} | **{r['gap_closed']:.0%}** | "
            f"{training} | >= {GAP_GOAL:.0%} of the gap | {'yes' if met else 'NO'} |"
        )
    befores = sorted({r["before_from"] for r in rows.values() if "before_from" in r})
    notes = [
        "",
        "SmolLM2-135M-Instruct, training text: each recipe's (wiki.valid.tokens; the draft: builtin:python-source "
        "and the teacher's answers to chat prompts quoting it; "
        "never the eval text), perplexity on the first 20 "
        "windows of 2048 tokens of wiki.test.raw (the draft: its recipe's eval, named in its row); after = the "
        "recipe's export read back from disk "
        "(`python bench/distill_table.py`). Before: " + ", ".join(befores or ["-"]) + ".",
        f"{THREADS} threads; CPU of each row: "
        + "; ".join(f"{name}: {r.get('cpu', EARLIER_CPU)}" for name, r in rows.items())
        + ".",
    ]
    return "\n".join(lines + notes) + "\n"


def main() -> int:
    parser = row_parser(__doc__.splitlines()[0], ROWS, "reuse runs whose report holds the same recipe", child=False)
    parser.add_argument("--speculative", help=argparse.SUPPRESS)  # a child: one speculative measurement
    args = parser.parse_args()
    if args.speculative:
        print(json.dumps(measure_speculative(json.loads(args.speculative))))
        return 0
    ROW_DIR.mkdir(parents=True, exist_ok=True)
    for name in wanted_rows(parser, args.rows, ROWS):
        recipe = yaml.safe_load((REPO / ROWS[name][1]).read_text())
        measure = measure_draft if name == "draft-student" else measure_recovery
        row: dict[str, Any] = measure(name, recipe, args.reuse)
        (ROW_DIR / f"{name}.json").write_text(json.dumps(row, indent=1) + "\n")
    rows = {p.stem: json.loads(p.read_text()) for p in sorted(ROW_DIR.glob("*.json"))}
    publish(render(rows), RESULTS / "distill_table.md", ("distill-table", "Distillation results"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
