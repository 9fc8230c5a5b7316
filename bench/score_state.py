"""Perplexity of the model that a one-shot stage's saved layer state describes, on the reference protocol.

A two-stage recipe (learned rounding, then ``distill``) reports only its final score; the first stage's
finished layers stay in the run's state directory (``<out>/.<name>.partial/state/0-learned`` while the run
goes on). This puts them back into SmolLM2 and scores it as bench/quant_table.py does (wiki.test.raw,
20 windows of 2048 tokens), so the first stage's own score can be read without running it again:

    python bench/score_state.py runs/bench-quant/.learned-w3-recipe.partial/state/0-learned --record learned-w3-rtn-fr

``--record NAME`` keeps the result under NAME in bench/results/score_state.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from quant_table import REPO, SMOLLM2, reference_perplexity

from lmpress.anatomy import decoder_layers
from lmpress.calib.state import LayerState
from lmpress.loader import load_model

RESULTS = REPO / "bench" / "results" / "score_state.json"


def score_state(state_dir: Path) -> dict:
    """SmolLM2 with every finished layer of ``state_dir`` put back, and its perplexity."""
    progress = json.loads((state_dir / "progress.json").read_text())
    state = LayerState(state_dir, progress["fingerprint"])
    loaded = load_model(SMOLLM2)
    model, tokenizer = loaded.model, loaded.tokenizer
    layers = decoder_layers(model)
    done = state.done_layers()
    if done != len(layers):
        raise SystemExit(f"{state_dir}: {done} of {len(layers)} layers finished; score a finished stage")
    quantized = sum(state.restore_layer(i, layer) for i, layer in enumerate(layers))
    with torch.no_grad():
        result = reference_perplexity(model, tokenizer)
    return {"state": str(state_dir), "quantized_linears": quantized, "ppl": result["ppl"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("state_dir", type=Path)
    parser.add_argument("--record", metavar="NAME", help="keep the result under NAME in " + str(RESULTS.name))
    args = parser.parse_args()
    result = score_state(args.state_dir)
    print(json.dumps(result))
    if args.record:
        recorded = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        recorded[args.record] = result
        RESULTS.write_text(json.dumps(recorded, indent=2) + "\n")


if __name__ == "__main__":
    main()
