"""Quantized KV caches on SmolLM2-135M: perplexity over full-context windows and bytes per token (issue 50).

    python bench/kv_cache.py                      # 2 windows of 8192 tokens: float and every scheme below
    python bench/kv_cache.py --windows 4 --seq-len 4096
    python bench/kv_cache.py --rows float fp8-tensor-rotated   # re-measure rows; the table keeps the others
    python bench/kv_cache.py --rows float int4 --passkey 8192   # also passkey retrieval at 8,192 tokens
    python bench/kv_cache.py --rows float int8 int4 --passkey 8192 --depths 0 0.25 0.5 0.75 1 --trials 2

Protocol: WikiText-2 test (builtin:wikitext2:test), the first ``--windows`` windows of ``--seq-len`` tokens (8192:
SmolLM2's whole context), no BOS; the FP32 model, its attention reading each cache as lmpress's runtime holds it
(``lmpress.quantize.kv_attention.kv_quantized``). FP8's static scales are calibrated on 128 x 512 tokens of
wiki.valid.tokens (seed 0), the recipe default, and each scheme's Δ is against the float cache of the same model.
Writes bench/results/kv_cache.md, .json and .png (Δppl per scheme; passkey accuracy by depth per scheme), and the
table into docs/results.md ("Quantized KV cache"); another protocol (``--windows``, ``--seq-len``) gets tables of its
own (``kv_cache_8x8192.md``...) and keeps its rows beside the others in the json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's lmpress, before an installed one
from quant_table import CALIBRATION, SMOLLM2, cpu_description  # noqa: E402
from readme_block import write_readme_block  # noqa: E402

from lmpress.data import calibration_samples, load_text, tokenize  # noqa: E402
from lmpress.evals.longctx import PasskeyConfig, passkey  # noqa: E402
from lmpress.evals.perplexity import PerplexityConfig, perplexity  # noqa: E402
from lmpress.loader import load_model  # noqa: E402
from lmpress.progress import Bars  # noqa: E402
from lmpress.quantize.kv_attention import calibrate_kv_scales, kv_cache_report, kv_quantized  # noqa: E402
from lmpress.weights.kv_quant import KVScheme  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SCHEMES = {  # row -> (scheme, rotate)
    "float": (None, False),
    "int8": (KVScheme("int8", "token"), False),
    "fp8-tensor": (KVScheme("fp8", "tensor"), False),
    "fp8-head": (KVScheme("fp8", "head"), False),
    "int8-rotated": (KVScheme("int8", "token"), True),
    "fp8-tensor-rotated": (KVScheme("fp8", "tensor"), True),
    "fp8-head-rotated": (KVScheme("fp8", "head"), True),
    "int4-token": (KVScheme("int4", "token"), False),
    "int4-token-rotated": (KVScheme("int4", "token"), True),
    "int4": (KVScheme("int4", "channel"), False),  # KIVI: keys per channel in groups of 32 tokens
    "int4-rotated": (KVScheme("int4", "channel"), True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", nargs="*", default=list(SCHEMES), choices=list(SCHEMES))
    parser.add_argument("--passkey", type=int, nargs="*", default=[], metavar="LENGTH", help="passkey lengths")
    parser.add_argument("--depths", type=float, nargs="*", default=[0.0, 0.5, 1.0])
    parser.add_argument("--trials", type=int, default=1, help="passkey prompts (keys) per length and depth")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(SMOLLM2, "float32", fingerprint=False)
    model, tokenizer = loaded.model, loaded.tokenizer
    config = PerplexityConfig(seq_len=args.seq_len, windows=args.windows, batch_size=1)
    windows = config.windows_for(tokenize(tokenizer, load_text("builtin:wikitext2:test")), tokenizer)
    calibration = calibration_samples(
        tokenize(tokenizer, load_text("builtin:wikitext2:valid")),
        CALIBRATION["n_samples"],
        CALIBRATION["seq_len"],
        CALIBRATION["seed"],
    )
    saved = RESULTS / "kv_cache.json"
    protocol = {"windows": args.windows, "seq_len": args.seq_len}
    kept = json.loads(saved.read_text()) if saved.is_file() else []
    others = [r for r in kept if r.get("protocol") != protocol]  # kept in the json, out of this table
    rows = [r for r in kept if r.get("protocol") == protocol and r["row"] not in args.rows]
    with Bars() as bars, torch.inference_mode():
        for name in args.rows:
            scheme, rotate = SCHEMES[name]
            began = time.perf_counter()
            kv = None if scheme is None else calibrate_kv_scales(model, calibration, scheme, bars, rotate=rotate)
            calibrated = time.perf_counter() - began
            with kv_quantized(model, kv):
                result = perplexity(model, windows, config, bars)
                if args.passkey:  # decoded by lmpress's runtime on the same quantized cache
                    keys = PasskeyConfig(lengths=args.passkey, depths=args.depths, trials=args.trials)
                    found, details = passkey(model, tokenizer, keys, bars)
            row = {
                "row": name,
                "protocol": protocol,
                "scheme": "float32 cache" if kv is None else kv.describe(),
                "ppl": result["ppl"],
                "calibration_s": calibrated,
                "eval_s": time.perf_counter() - began - calibrated,
                "cpu": cpu_description(),
            }
            if args.passkey:
                row |= {name: value for name, value in found.items() if name.startswith("passkey_accuracy_")}
                row |= {"passkey_depths": args.depths, "passkey_trials": args.trials}
                row["passkey_grid"] = details["passkey_grid"]
            if kv is not None:
                row |= kv_cache_report(kv, model)
            rows.append(row)
            bars.log(f"{name}: ppl {row['ppl']:.4f}")
    rows.sort(key=lambda r: list(SCHEMES).index(r["row"]))
    base = next((r["ppl"] for r in rows if r["row"] == "float"), None)
    keys = sorted({k for r in rows for k in r if k.startswith("passkey_accuracy_")}, key=len)
    depths = next((r["passkey_depths"] for r in rows if "passkey_depths" in r), [])
    trials = next((r.get("passkey_trials", 1) for r in rows if "passkey_depths" in r), 1)
    prompts = "one prompt" if trials == 1 else f"{trials} prompts"
    measured_on = {r.get("cpu", "AMD EPYC (avx2)") for r in rows}  # rows before the field: the EPYC's
    cpus = " and ".join(sorted(measured_on)) + (" (rows from both)" if len(measured_on) > 1 else "")
    default = protocol == {"windows": 2, "seq_len": 8192}
    command_protocol = "" if default else f" --windows {args.windows} --seq-len {args.seq_len}"
    lines = [
        f"SmolLM2-135M-Instruct (FP32), WikiText-2 test, {args.windows} x {args.seq_len} tokens, "
        f"{cpus}, {args.threads} threads, torch {torch.__version__}; `python bench/kv_cache.py{command_protocol}`"
        + (f"; passkey at depths {depths}, {prompts} each, decoded by lmpress's runtime." if keys else "."),
        "",
        "| KV cache | ppl | Δ vs float cache | bytes / token | x bf16 |"
        + "".join(f" passkey {k.rsplit('_', 1)[1]} |" for k in keys),
        "| --- | --- | --- | --- | --- |" + " --- |" * len(keys),
    ]
    floats = next((r["float_bytes_per_token"] for r in rows if "float_bytes_per_token" in r), None)
    for r in rows:
        delta = "" if base is None or r["row"] == "float" else f"{100 * (r['ppl'] / base - 1):+.3f}%"
        size = f"{r['bytes_per_token']:,.0f}" if "bytes_per_token" in r else f"{floats or 0:,} (float32)"
        ratio = f"{r['ratio_to_bf16']:.3f}" if "ratio_to_bf16" in r else "2.000"
        passkeys = "".join(f" {r[k]:.2f} |" if k in r else "  |" for k in keys)
        lines.append(f"| {r['scheme']} | {r['ppl']:.4f} | {delta} | {size} | {ratio} |" + passkeys)
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "kv_cache" if default else f"kv_cache_{args.windows}x{args.seq_len}"  # one table per protocol
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    heading = "Quantized KV cache" + ("" if default else f" ({args.windows} x {args.seq_len} tokens)")
    write_readme_block(name.replace("_", "-"), heading, "\n".join(lines[2:] + ["", lines[0]]))
    saved.write_text(json.dumps(others + rows, indent=1) + "\n")
    plot(rows, base, RESULTS / f"{name}.png")
    print("\n".join(lines))


def plot(rows: list[dict], base: float | None, path: Path) -> None:
    """Δppl per scheme beside passkey accuracy by depth per scheme (at the longest length measured)."""
    from lmpress.evals.plots import plt, save_figure

    graded = [r for r in rows if "passkey_grid" in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), width_ratios=(3, 2))
    names = [r["row"] for r in rows if r["row"] != "float"]
    if base is not None and names:
        deltas = [100 * (r["ppl"] / base - 1) for r in rows if r["row"] != "float"]
        left.barh(names, deltas, color="tab:blue")
        left.set_xlabel("perplexity vs the float cache (%)")
        left.invert_yaxis()
    for r in graded:
        grid = r["passkey_grid"]
        longest = len(grid["lengths"]) - 1
        right.plot(grid["depths"], [row[longest] for row in grid["accuracy"]], marker="o", label=r["row"])
    if graded:
        right.set_xlabel(f"depth of the key (passkey at {graded[0]['passkey_grid']['lengths'][-1]:,} tokens)")
        right.set_ylabel("accuracy")
        right.set_ylim(-0.05, 1.05)
        right.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


if __name__ == "__main__":
    main()
