"""Does what ships score what the gate scored? GPTQ W4 g64 on SmolLM2, in memory and read back from each export.

    python bench/export_readback.py                       # both variants, then bench/results/export_readback.md
    python bench/export_readback.py --variants act-order  # one

Quantizes SmolLM2-135M once per variant (calibration 128 x 512 tokens of
wiki.valid.tokens, seed 0), scores the in-memory candidate on the reference
protocol (first 20 windows of 2048 tokens of wiki.test.raw, no BOS), writes every
export format that can hold the variant, reads each back with lmpress's loader
(what ``lmpress eval`` and ``lmpress run``'s verdict use) and scores it on the same
windows. Act-order writes a ``g_idx`` only GPTQ (and the dense export) can hold;
the static-groups variant goes into every format.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from quant_table import CALIBRATION, EVAL, RESULTS, ROWS, SMOLLM2, WIKITEXT  # the same protocol as the quant table

GPTQ = ROWS["gptq-w4-g64"][1]
VARIANTS = {
    "act-order": (GPTQ, ["gptq", "hf"]),
    "static-groups": ({**GPTQ, "static_groups": True}, ["gptq", "awq", "compressed-tensors", "hf"]),
}


def measure(variant: str) -> list[dict]:
    import torch

    from lmpress.data import calibration_samples, load_text, token_windows, tokenize
    from lmpress.evals.perplexity import PerplexityConfig, perplexity
    from lmpress.export.verify import compare_weights
    from lmpress.loader import load_model
    from lmpress.registry import StageContext, exporter, stage_config, stage_handler_for

    stage, formats = VARIANTS[variant]
    loaded = load_model(SMOLLM2)
    model, tokenizer = loaded.model, loaded.tokenizer
    config = stage_config(stage["method"])(**stage)
    calibration = calibration_samples(
        tokenize(tokenizer, load_text(str(WIKITEXT / "wiki.valid.tokens"))), **CALIBRATION
    )
    with tempfile.TemporaryDirectory() as scratch:
        ctx = StageContext(lambda: calibration, Path(scratch), resume=False, fingerprint=variant)
        began = time.perf_counter()
        stage_handler_for(config)(model, config, ctx)
        print(f"{variant}: quantized in {time.perf_counter() - began:.0f} s", flush=True)
    windows = token_windows(
        tokenize(tokenizer, load_text(str(WIKITEXT / "wiki.test.raw"))), EVAL["seq_len"], EVAL["windows"]
    )
    scoring = PerplexityConfig(**EVAL, batch_size=1)
    rows = [{"variant": variant, "scored": "in-memory candidate", "ppl": perplexity(model, windows, scoring)["ppl"]}]
    print(f"  in memory: {rows[0]['ppl']:.4f}", flush=True)
    with tempfile.TemporaryDirectory() as out:
        for fmt in formats:
            exporter(fmt)(model, tokenizer, Path(out) / fmt)
            artifact = load_model(str(Path(out) / fmt))
            mismatch, change, how = compare_weights(model, artifact.model)
            with torch.inference_mode():
                ppl = perplexity(artifact.model, windows, scoring)["ppl"]
            rows.append(
                {
                    "variant": variant,
                    "scored": f"{fmt}/ read back",
                    "ppl": ppl,
                    "weights": mismatch or how,
                    "max_weight_change": change,
                }
            )
            print(f"  {fmt}: {ppl:.4f} ({mismatch or how}, max |dW| {change:.3g})", flush=True)
            del artifact
    return rows


def write_table(rows: list[dict]) -> str:
    lines = [
        "# Export read-back (SmolLM2-135M, GPTQ W4 g64 sym, MSE scales)",
        "",
        "`python bench/export_readback.py`. Calibration 128 x 512 tokens of wiki.valid.tokens (seed 0); perplexity on",
        "the reference protocol (first 20 windows of 2048 tokens of wiki.test.raw, CRLF->LF, no BOS; token-level).",
        "Each export is read back by lmpress's loader, the one `lmpress eval` and a run's verdict use.",
        "",
        "| variant | scored | ppl | change vs in-memory | weights read back | max weight change |",
        "|---|---|---|---|---|---|",
    ]
    base = {}
    for row in rows:
        base.setdefault(row["variant"], row["ppl"])
        change = row["ppl"] / base[row["variant"]] - 1
        delta = "" if row["scored"] == "in-memory candidate" else f"{change:+.2e}"
        weights = row.get("weights", "")
        dw = "" if "max_weight_change" not in row else f"{row['max_weight_change']:.2e}"
        lines.append(f"| {row['variant']} | {row['scored']} | {row['ppl']:.4f} | {delta} | {weights} | {dw} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = parser.parse_args()
    rows = [row for variant in args.variants for row in measure(variant)]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "export_readback.json").write_text(json.dumps(rows, indent=2) + "\n")
    table = write_table(rows)
    (RESULTS / "export_readback.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
