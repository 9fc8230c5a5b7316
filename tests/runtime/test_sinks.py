"""gpt-oss in the runtime: attention sinks, q/k/v/o biases, alternating sliding / full layers, YaRN rope, the router
with a bias (top-k, then a softmax over those) and the clamped SwiGLU experts, against transformers' own model."""

from __future__ import annotations

import pytest
import torch

from lmpress.runtime.attention import few_query_attention, pointwise_attention
from lmpress.runtime.generate import generate, left_pad, static_decode
from lmpress.runtime.model import Transformer
from tests.runtime.conftest import tiny_family_model

# A SwiGLU limit the tiny model's activations cross (the default, 7, is never reached at this size), a sliding
# window of 8 shorter than the prompts, and YaRN scaling (tests/families.py's gpt_oss settings).
LIMIT = 0.6


def relative_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).pow(2).mean() / want.float().pow(2).mean()).sqrt().item()


@pytest.fixture(scope="module")
def hf_model():
    return tiny_family_model("gpt_oss", seed=3, swiglu_limit=LIMIT)


def reference_attention(q, keys, values, mask, scale, sinks):
    """Every query head against its KV head's keys, the sink one more logit in the softmax, dropped after."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = (q @ keys.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat((scores, sink), dim=-1).softmax(-1)[..., :-1]
    return probs @ values


@pytest.mark.parametrize("attention", [few_query_attention, pointwise_attention])
def test_sinks_take_their_share_of_the_softmax(attention):
    gen = torch.Generator().manual_seed(0)
    q, keys, values = (torch.randn(shape, generator=gen) for shape in [(2, 4, 3, 8), (2, 2, 7, 8), (2, 2, 7, 8)])
    mask = torch.rand((2, 1, 3, 7), generator=gen) > 0.3
    mask[..., 0] = True
    sinks = torch.randn(4, generator=gen) * 2
    want = reference_attention(q, keys, values, mask, 0.35, sinks)
    torch.testing.assert_close(attention(q, keys, values, mask, 0.35, None, sinks), want, rtol=1e-5, atol=1e-6)
    assert (attention(q, keys, values, mask, 0.35) - want).abs().max() > 1e-2  # without the sinks: different


def test_the_tiny_model_exercises_every_quirk(hf_model):
    """What the other tests rely on to fail where a quirk is dropped: activations past the SwiGLU limit on both
    sides, layers of both types with a window shorter than the prompts, a biased router and YaRN rope."""
    config = hf_model.config
    assert config.layer_types == ["sliding_attention", "full_attention"] and config.sliding_window == 8
    assert config.rope_parameters["rope_type"] == "yarn"
    experts = hf_model.model.layers[0].mlp.experts
    x = hf_model.model.layers[0].post_attention_layernorm(hf_model.model.embed_tokens.weight[:64])
    gate_up = x @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]
    assert (gate_up[:, ::2] > LIMIT).float().mean() > 0.1  # gates clamped above
    assert (gate_up[:, 1::2].abs() > LIMIT).float().mean() > 0.1  # ups clamped both ways
    assert hf_model.model.layers[0].mlp.router.bias.abs().min() > 0


@pytest.mark.parametrize("kernels", ["cpu", "reference"])
def test_logits_prefill_and_decode_match_transformers(hf_model, kernels):
    model = Transformer.from_hf(hf_model, kernels=kernels)
    ids = torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf_model(ids).logits
        whole = model(ids, model.new_cache(2, 64))
        cache = model.new_cache(2, 64)
        steps = torch.cat([model(ids[:, :30], cache)] + [model(ids[:, i : i + 1], cache) for i in range(30, 40)], 1)
    assert relative_rms(whole, want) < 1e-5
    assert relative_rms(steps, want) < 1e-5


def test_left_padded_rows_match_transformers_with_its_attention_mask(hf_model):
    model = Transformer.from_hf(hf_model)
    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (20, 13)]
    tokens, pad = left_pad(prompts)
    attention_mask = (torch.arange(tokens.shape[1])[None] >= pad[:, None]).long()
    with torch.no_grad():
        want = hf_model(tokens, attention_mask=attention_mask).logits
        got = model(tokens, model.new_cache(2, 24, pad))
    for row, n in enumerate(len(p) for p in prompts):  # the real tokens of each row
        assert relative_rms(got[row, -n:], want[row, -n:]) < 1e-5


def test_greedy_generate_equals_transformers_generate(hf_model):
    ids = torch.randint(3, 256, (14,), generator=torch.Generator().manual_seed(5)).tolist()
    want = hf_model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None)[0, 14:]
    model = Transformer.from_hf(hf_model)
    assert generate(model, ids, max_new_tokens=12) == [want.tolist()]
    # the fixed-shape step torch.compile captures (pointwise attention with sinks, writes at slots)
    assert generate(model, ids, max_new_tokens=12, decode=static_decode()) == [want.tolist()]
