"""What the runtime's CPU activations move SmolLM2's perplexity by: the evaluator against the runtime (int8, bf16).

    python bench/cpu_int_perplexity.py [--windows 2] [--artifact w4g64-head8]

SmolLM2-135M quantized RTN as bench/runtime.py's artifact (``w4g64-head8``: W4 g64, head W8 per row; or ``w8-head8``),
perplexity on the first ``--windows`` windows of 1024 tokens of WikiText-2 test (CRLF -> LF, no BOS): lmpress's
evaluator (the export as ``load_model`` reads it: float32 activations) and the runtime (``load_runtime``, the whole
window in one forward) with each ``--activations`` setting. Prints one line per side and the relative change;
writes nothing. Issue 41's bound: within 0.5% of the evaluator's.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime import ARTIFACT_SETTINGS, artifact  # noqa: E402

TEXT = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "wikitext2" / "wiki.test.raw"
WINDOW = 1024


def mean_nll(logits: torch.Tensor, window: torch.Tensor) -> tuple[float, int]:
    logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
    return -float(logprobs.gather(-1, window[1:, None]).double().sum()), window.numel() - 1


@torch.inference_mode()
def evaluator_ppl(path: Path, windows: torch.Tensor) -> float:
    import lmpress

    model = lmpress.load_model(str(path), "float32").model
    total = [mean_nll(model(w[None], use_cache=False).logits[0], w) for w in windows]
    return math.exp(sum(t for t, _ in total) / sum(n for _, n in total))


@torch.inference_mode()
def runtime_ppl(path: Path, windows: torch.Tensor, activations: str) -> tuple[float, list[str]]:
    from lmpress.runtime.text import load_runtime
    from lmpress.runtime.throughput import layer_kernels

    model, _ = load_runtime(str(path), "cpu", "float32", activations)
    total = [mean_nll(model(w[None], model.new_cache(1, WINDOW))[0], w) for w in windows]
    return math.exp(sum(t for t, _ in total) / sum(n for _, n in total)), sorted(set(layer_kernels(model).values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--artifact", choices=[a for a in ARTIFACT_SETTINGS if a != "w4g64"], default="w4g64-head8")
    parser.add_argument("--text", default=str(TEXT), help="WikiText-2's wiki.test.raw")
    parser.add_argument("--activations", nargs="+", choices=["int8", "bf16"], default=["int8", "bf16"])
    args = parser.parse_args()
    from lmpress.data import load_text, token_windows
    from lmpress.runtime.tokenizer import RuntimeTokenizer

    path = artifact(args.artifact)
    text = load_text(args.text).text
    ids = torch.tensor(RuntimeTokenizer(path)(text, add_special_tokens=False)["input_ids"])
    windows = token_windows(ids, WINDOW, args.windows)
    reference = evaluator_ppl(path, windows)
    print(f"{args.artifact}, {args.windows} windows of {WINDOW} tokens: evaluator (float32) {reference:.4f}")
    for activations in args.activations:
        ppl, kernels = runtime_ppl(path, windows, activations)
        change = 100 * (ppl / reference - 1)
        print(f"runtime, --activations {activations} ({', '.join(kernels)}): {ppl:.4f} ({change:+.2f}%)", flush=True)


if __name__ == "__main__":
    main()
