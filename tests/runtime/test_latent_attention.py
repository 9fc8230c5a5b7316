"""DeepSeek-V2 / V3 in the runtime: multi-head latent attention (low-rank queries or not, the compressed latent and
the shared rotary key, values narrower than keys, interleaved or half rope, YaRN's mscale in the softmax scale) and
the routers (V3: sigmoid, correction bias, grouped top-k, renormalized, scaled; V2: softmax, greedy or group-limited),
shared experts and dense first layers, against transformers' own model."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from lmpress.runtime.feed_forward import deepseek_v2_route, deepseek_v3_route
from lmpress.runtime.generate import generate, static_decode
from lmpress.runtime.model import Transformer
from tests.runtime.conftest import tiny_family_model

VARIANTS = {
    # tests/families.py's: low-rank queries, interleaved rope, one group, the first layer dense
    "v3": {},
    # full-rank queries, rope on halves, values narrower than keys, YaRN (mscale in the softmax scale), grouped
    # routing over 8 experts without renormalizing, two shared experts, every layer MoE
    "v3-variants": {
        "q_lora_rank": None,
        "rope_interleave": False,
        "v_head_dim": 8,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
        "n_routed_experts": 8,
        "num_experts_per_tok": 3,
        "n_group": 4,
        "topk_group": 2,
        "norm_topk_prob": False,
        "n_shared_experts": 2,
        "first_k_dense_replace": 0,
    },
}


def deepseek_v2_model(seed: int):
    """A tiny DeepSeek-V2: complex (interleaved) rope, softmax routing limited to the best group of two."""
    from transformers import AutoModelForCausalLM, DeepseekV2Config

    config = DeepseekV2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256, kv_lora_rank=32, q_lora_rank=24,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=2, topk_group=1,
        routed_scaling_factor=1.5, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.3 * torch.randn_like(param))
            elif param.dim() >= 2:
                param.normal_(0, 0.08)
    return model


def hf_model(variant: str, seed: int = 2):
    if variant == "v2":
        return deepseek_v2_model(seed)
    return tiny_family_model("deepseek_v3", seed=seed, **VARIANTS[variant])


def relative_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).pow(2).mean() / want.float().pow(2).mean()).sqrt().item()


@pytest.mark.parametrize("kernels", ["cpu", "reference"])
@pytest.mark.parametrize("variant", ["v3", "v3-variants", "v2"])
def test_logits_prefill_and_decode_match_transformers(variant, kernels):
    hf = hf_model(variant)
    model = Transformer.from_hf(hf, kernels=kernels)
    ids = torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        whole = model(ids, model.new_cache(2, 64))
        cache = model.new_cache(2, 64)
        steps = torch.cat([model(ids[:, :30], cache)] + [model(ids[:, i : i + 1], cache) for i in range(30, 40)], 1)
    assert relative_rms(whole, want) < 1e-5
    assert relative_rms(steps, want) < 1e-5


def test_the_cache_holds_each_heads_full_key_and_its_narrower_value():
    hf = hf_model("v3-variants")
    model = Transformer.from_hf(hf)
    cache = model.new_cache(1, 16)
    assert cache.k[0].shape == (1, 4, 16, 16 + 8) and cache.v[0].shape == (1, 4, 16, 8)


@pytest.mark.parametrize("variant", ["v3", "v3-variants", "v2"])
def test_greedy_generate_equals_transformers_generate(variant):
    hf = hf_model(variant, seed=4)
    ids = torch.randint(3, 256, (14,), generator=torch.Generator().manual_seed(5)).tolist()
    want = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None)[0, 14:].tolist()
    model = Transformer.from_hf(hf)
    assert len(set(want)) > 3  # not one token over and over
    assert generate(model, ids, max_new_tokens=12) == [want]
    assert generate(model, ids, max_new_tokens=12, decode=static_decode()) == [want]  # the fixed-shape step


def _sorted(weights: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = chosen.argsort(dim=-1)
    return weights.gather(1, order), chosen.gather(1, order)


def test_v3_routing_is_transformers_router():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(
        hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5
    )
    router = DeepseekV3TopkRouter(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(0, 0.5, generator=gen)
        router.e_score_correction_bias.normal_(0, 0.5, generator=gen)
    x = torch.randn(64, 32, generator=gen)
    for normalize in (True, False):
        router.norm_topk_prob = normalize
        _, want_weights, want_chosen = router(x)
        weights, chosen = deepseek_v3_route(
            F.linear(x, router.weight), 4, router.e_score_correction_bias, 4, 2, normalize, 2.5
        )
        torch.testing.assert_close(_sorted(weights, chosen), _sorted(want_weights, want_chosen))
    # the correction bias chooses (some picks differ without it) but never weights
    _, without = deepseek_v3_route(F.linear(x, router.weight), 4, torch.zeros(16), 4, 2, False, 2.5)
    assert not torch.equal(without.sort(-1).values, chosen.sort(-1).values)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_v2_routing_is_transformers_router(method):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    config = DeepseekV2Config(
        hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, topk_method=method,
        routed_scaling_factor=1.5,
    )  # fmt: skip
    router = DeepseekV2TopkRouter(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(0, 0.5, generator=gen)
    x = torch.randn(64, 32, generator=gen)
    _, want_weights, want_chosen = router(x)
    weights, chosen = deepseek_v2_route(F.linear(x, router.weight), 4, method, 4, 2, 1.5)
    torch.testing.assert_close(_sorted(weights, chosen), _sorted(want_weights, want_chosen))
