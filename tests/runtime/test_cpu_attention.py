"""lmpress's CPU attention over a cache's filled slots (kernels/cpu_attention.py) against a float64 softmax, and the
runtime's use of it in the compiled step."""

from __future__ import annotations

import pytest
import torch

from lmpress.runtime.attention import pointwise_attention
from lmpress.runtime.kernels import cpu_attention
from lmpress.runtime.kv_cache import static_slots_mask

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="needs the C++ library and AVX-512")


def reference(q, keys, values, mask, scale):  # noqa: ANN001, ANN201
    """Float64 attention, each query head on its KV head's keys and values (GQA by repetition)."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, 1)
    v = values.double().repeat_interleave(group, 1)
    scores = (q.double() @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


def case(batch: int, heads: int, kv_heads: int, n: int, slots: int, dim: int, value_dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, n, dim, generator=g) * 3  # peaked softmaxes as well as flat ones
    keys = torch.randn(batch, kv_heads, slots, dim, generator=g)
    values = torch.randn(batch, kv_heads, slots, value_dim, generator=g)
    return q, keys, values


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("window", [None, 5])
def test_matches_a_float64_softmax_over_the_visible_slots(n, window):
    """Two rows (the second left padded by 7), 9 query heads on 3 KV heads, queries ending at slot 33 of 61 (the
    cache's later slots hold garbage that must not count), a sliding window or none; value dim apart from key dim."""
    q, keys, values = case(2, 9, 3, n, 61, 32, 48)
    keys[:, :, 34:] = 1e4  # unwritten slots: any weight on them would show
    pos = torch.arange(34 - n, 34)
    mask = static_slots_mask(torch.tensor([0, 7]), pos, 61, window)
    out = cpu_attention.slots_attention(q, keys, values, mask, 32**-0.5)
    expected = reference(q, keys, values, mask, 32**-0.5)
    assert out.dtype == torch.float32 and out.shape == (2, 9, n, 48)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_agrees_with_the_pointwise_attention_it_replaces():
    """The compiled step's other path on the same inputs (float32 both): a decode query over a half-filled cache."""
    q, keys, values = case(1, 9, 3, 1, 384, 64, 64, seed=3)
    mask = static_slots_mask(torch.tensor([0]), torch.tensor([191]), 384, None)
    torch.testing.assert_close(
        cpu_attention.slots_attention(q, keys, values, mask, 0.125),
        pointwise_attention(q, keys, values, mask, 0.125),
        rtol=1e-5,
        atol=1e-6,
    )


def test_extreme_scores_neither_overflow_nor_vanish():
    """Scores hundreds apart: the softmax subtracts the row's maximum, the exponential clamps far below it."""
    q, keys, values = case(1, 2, 1, 1, 40, 16, 16, seed=5)
    q *= 200
    mask = torch.ones(1, 1, 1, 40, dtype=torch.bool)
    out = cpu_attention.slots_attention(q, keys, values, mask, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference(q, keys, values, mask, 1.0), rtol=1e-5, atol=1e-5)


def test_refuses_what_it_cannot_compute():
    q, keys, values = case(1, 2, 1, 1, 8, 24, 24)  # head dim not a multiple of 16
    with pytest.raises(RuntimeError, match="shapes"):
        cpu_attention.slots_attention(q, keys, values, torch.ones(1, 1, 1, 8, dtype=torch.bool), 1.0)
    assert not cpu_attention.fits(24, 24, torch.float32) and not cpu_attention.fits(64, 64, torch.bfloat16)
    assert cpu_attention.fits(64, 64, torch.float32)


def test_the_compiled_step_attends_through_it_and_matches_eager(monkeypatch):
    """A float32 CPU model's attention layers that cpu_kv_attention (faster where it fits) cannot take, here all of
    them, take the op; the static step (uncompiled here, the op is what a compiled one calls) gives the growing
    cache's logits, and calls the op once per layer."""
    from lmpress.runtime.generate import static_decode
    from lmpress.runtime.kernels import cpu_kv_attention
    from lmpress.runtime.model import Transformer
    from tests.runtime.conftest import tiny_hf_model

    monkeypatch.setattr(cpu_kv_attention, "fits", lambda *args: False)
    model = Transformer.from_hf(tiny_hf_model("llama", seed=4))
    assert all(layer.attention.slots_kernel for layer in model.layers)
    calls = []
    real = cpu_attention.slots_attention
    monkeypatch.setattr(cpu_attention, "slots_attention", lambda *a: calls.append(1) or real(*a))
    prompts = [[5, 6, 7, 8, 9], [3, 4]]
    from lmpress.runtime.generate import generate

    expected = generate(model, prompts, max_new_tokens=6)
    assert generate(model, prompts, max_new_tokens=6, decode=static_decode()) == expected
    assert len(calls) == 5 * len(model.layers)


def test_only_a_cpu_model_compiles_its_step_with_the_cpp_wrapper(monkeypatch):
    """A CPU model's compiled step gets Inductor's C++ wrapper; a CUDA model's (CUDA graphs) keeps Python's."""
    from lmpress.runtime import generate as gen
    from lmpress.runtime.direct_graph import RecordingBackend
    from lmpress.runtime.model import Transformer
    from tests.runtime.conftest import tiny_hf_model

    seen = []

    def fake_compile(fn, fullgraph, options, backend="inductor"):  # noqa: ANN001, ANN202 - as the step calls it
        seen.append(backend.options if isinstance(backend, RecordingBackend) else options)
        return lambda model, tokens, *rest: torch.zeros(tokens.shape[0], tokens.shape[1], 256)

    monkeypatch.setattr(gen.torch, "compile", fake_compile)
    model = Transformer.from_hf(tiny_hf_model("llama", seed=4))
    gen.compiled_forward()(model, torch.tensor([[5]]), model.new_cache(1, 8))
    assert len(seen) == 2 and all(o["cpp_wrapper"] and o["cpp_wrapper_build_separate"] for o in seen)
    assert gen.wrapper_options(torch.device("cuda")) == {}
