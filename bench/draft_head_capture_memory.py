"""Memory of the draft-head stage's capture on SmolLM2-135M (issue 54: the forecast's "draft head" part).

    python bench/draft_head_capture_memory.py [--prompts 16] [--new-tokens 192]

Quantizes SmolLM2 as bench/draft_head.py does (RTN W4 g64, head W8), builds lmpress's runtime over it and captures
one generation batch of ``--prompts`` random 64-token prompts continued by ``--new-tokens``; prints the process's
resident memory (MiB) after quantizing, after building the runtime, and the peak during the capture.
"""

from __future__ import annotations

import argparse
import resource
import sys
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's lmpress, before an installed one
from draft_head import W4_HEAD8  # noqa: E402
from quant_table import SMOLLM2  # noqa: E402

import lmpress  # noqa: E402
from lmpress.distill.draft_head import capture_draft_data  # noqa: E402
from lmpress.loader import load_model  # noqa: E402
from lmpress.runtime.eagle3 import Eagle3Config  # noqa: E402
from lmpress.runtime.model import Transformer  # noqa: E402


def mib_now() -> float:
    return psutil.Process().memory_info().rss / 2**20


def mib_peak() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=192)
    args = parser.parse_args()
    model = load_model(SMOLLM2, "float32", fingerprint=False).model
    lmpress.quantize_model(model, **W4_HEAD8)
    quantized = mib_now()
    target = Transformer.from_hf(model)
    runtime, before = mib_now(), mib_peak()
    layers = Eagle3Config.for_target(target, model.config, 8192).feature_layers
    prompts = torch.randint(3, model.config.vocab_size, (args.prompts, 64), generator=torch.Generator().manual_seed(0))
    capture_draft_data(target, prompts, args.new_tokens, layers, batch_size=args.prompts)
    print(f"after quantizing {quantized:.0f} MiB; after the runtime {runtime:.0f} MiB (+{runtime - quantized:.0f})")
    print(f"capture peak {mib_peak():.0f} MiB: +{mib_peak() - runtime:.0f} over the runtime (peak before {before:.0f})")


if __name__ == "__main__":
    main()
