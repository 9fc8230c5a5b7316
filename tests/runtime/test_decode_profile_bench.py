"""bench/decode_profile.py's per-part timing of an eager decode step, on a tiny model: every part found, linears
taken out of the attention and feed-forward that hold them, the parts adding up to the step."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import decode_profile  # noqa: E402

from lmpress.runtime.model import Transformer  # noqa: E402
from tests.runtime.conftest import tiny_hf_model  # noqa: E402


def test_parts_of_an_eager_step_add_up_to_it():
    model = Transformer.from_hf(tiny_hf_model("llama"))
    prompt = torch.randint(0, model.args.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        parts = decode_profile.eager_parts(model, prompt, steps=5)
    linears = [p for p in parts if p.startswith("linears in ")]
    assert {p.split(":")[0] for p in linears} == {"linears in attention", "linears in feed-forward"}
    assert any(p.startswith("head (") for p in parts)
    for part in ("attention without its linears", "feed-forward without its linears", "norms", "embedding"):
        assert parts[part] >= 0, part
    assert all(ms >= 0 for part, ms in parts.items() if part != "rest")
    medians_of_parts = sum(ms for part, ms in parts.items() if part != "step")
    assert abs(medians_of_parts - parts["step"]) < 0.5 * parts["step"]  # medians of parts: near, not equal, the sum
    page = decode_profile.render(
        {
            "host": {
                "meta": dict.fromkeys(("artifact", "threads", "prompt_tokens", "steps", "when", "load"), "x"),
                "eager": parts,
                "compiled": {"op": 1.0, "step (profiled, all ops)": 2.0, "step (not profiled)": 2.5},
            }
        }
    )
    assert "attention without its linears" in page and "| op | 1.000 | 50% |" in page


def test_a_read_of_several_tokens_is_profiled_on_the_same_cache_at_every_step():
    """``--read 4`` (a verifying read): each step reads 4 tokens after the same cache, its slots written again the
    next step; a one-token step grows the cache as decoding does."""
    from lmpress.runtime.generate import prefill, static_forward

    model = Transformer.from_hf(tiny_hf_model("llama"))
    prompt = torch.randint(0, model.args.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    forward = static_forward()
    with torch.inference_mode():
        cache = model.new_cache(1, 20)
        prefill(model, prompt, cache)
        read = decode_profile.next_tokens(model, forward, torch.tensor([[5, 6, 7, 8]]), cache)
        again = decode_profile.next_tokens(model, forward, torch.tensor([[5, 6, 7, 8]]), cache)
        assert cache.length == 12 and read.shape == (1, 4) and torch.equal(read, again)
        decode_profile.next_tokens(model, forward, read[:, :1], cache)
        assert cache.length == 13
        parts = decode_profile.eager_parts(model, prompt, steps=3, read=4)
    assert parts["step"] > 0 and any(p.startswith("head (") for p in parts)
