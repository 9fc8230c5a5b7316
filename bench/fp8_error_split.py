"""Where FP8 W8A8's perplexity loss on SmolLM2-135M comes from: E4M3 weights alone, E4M3 activations alone.

Same protocol as bench/int8_table.py (the first 20 windows of 2048 tokens of
wiki.test.raw). Each part is simulated in float on the model loaded fresh:
``weights`` rounds every linear's weight (lm_head aside) to E4M3 with one scale
per output row and keeps activations float; ``activations`` keeps weights float
and rounds each token's inputs to E4M3 per token, as ``Fp8Linear`` does;
``both`` is what the table's FP8 row runs; ``activations:down_proj`` (comma-separated suffixes)
rounds only the inputs of the linears whose names end so. Adds its parts to
bench/results/fp8_error_split.json.

    python bench/fp8_error_split.py [--parts weights activations both]
    python bench/fp8_error_split.py --parts activations:q_proj,k_proj,v_proj activations:o_proj \
        activations:gate_proj,up_proj activations:down_proj
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_table import EVAL, SMOLLM2, WIKITEXT, cpu_description  # noqa: E402

from lmpress.data import load_text, token_windows, tokenize  # noqa: E402
from lmpress.evals.perplexity import PerplexityConfig, perplexity
from lmpress.loader import load_model
from lmpress.weights.float8 import quantize_fp8, quantize_fp8_per_token

OUT = Path(__file__).resolve().parent / "results" / "fp8_error_split.json"


def round_inputs_to_e4m3(module: torch.nn.Module, args: tuple) -> tuple:
    codes, scale = quantize_fp8_per_token(args[0])
    return ((codes.float() * scale).to(args[0].dtype),)


def perplexity_with(part: str) -> float:
    loaded = load_model(SMOLLM2, fingerprint=False)
    model = loaded.model
    windows = token_windows(
        tokenize(loaded.tokenizer, load_text(str(WIKITEXT / "wiki.test.raw"))), EVAL["seq_len"], EVAL["windows"]
    )
    kind, _, suffixes = part.partition(":")
    only = tuple(suffixes.split(",")) if suffixes else ("",)
    for name, linear in model.named_modules():
        if not isinstance(linear, torch.nn.Linear) or name == "lm_head" or not name.endswith(only):
            continue
        if kind in ("weights", "both"):
            codes, scale = quantize_fp8(linear.weight.data, "channel")
            linear.weight.data = codes.float() * scale
        if kind in ("activations", "both"):
            linear.register_forward_pre_hook(round_inputs_to_e4m3)
    return perplexity(model, windows, PerplexityConfig(**EVAL, batch_size=1))["ppl"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["weights", "activations", "both"])
    args = parser.parse_args()
    torch.set_num_threads(2)
    results = {part: perplexity_with(part) for part in args.parts}
    for part, ppl in results.items():
        print(f"E4M3 {part}: ppl {ppl:.3f}")
    before = json.loads(OUT.read_text())["ppl"] if OUT.exists() else {}
    OUT.write_text(json.dumps({"ppl": before | results, "cpu": cpu_description()}, indent=2) + "\n")


if __name__ == "__main__":
    main()
