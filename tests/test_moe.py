"""Mixture-of-experts models: fused experts are split, and every expert is calibrated and quantized."""

from __future__ import annotations

import types

import pytest
import torch

from lmpress.calib.moe import UnfusedExperts, unfuse_experts
from lmpress.quantize.gptq import GPTQConfig, run_gptq
from lmpress.registry import StageContext
from lmpress.weights.qlinear import QuantizedLinear

N_EXPERTS = 4
STARVED = 3  # the router never picks this expert


def tiny_moe(family: str):
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig

    common = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    if family == "mixtral":
        config = MixtralConfig(**common, num_local_experts=N_EXPERTS, num_experts_per_tok=2)
    else:
        config = Qwen2MoeConfig(
            **common,
            num_experts=N_EXPERTS,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=128,
        )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def starve_expert(model) -> None:
    """Make every router skip expert ``STARVED`` (it then sees no token in normal routing)."""
    for layer in model.model.layers:
        gate = layer.mlp.gate
        top_k = gate.top_k

        def route(self, hidden_states, top_k=top_k):
            logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.weight.shape[1]), self.weight)
            logits[:, STARVED] = float("-inf")
            probs = torch.softmax(logits.float(), dim=-1)
            weights, index = torch.topk(probs, top_k, dim=-1)
            return logits, weights / weights.sum(-1, keepdim=True), index

        gate.forward = types.MethodType(route, gate)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_unfused_experts_compute_the_fused_function(family):
    model = tiny_moe(family)
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
        assert unfuse_experts(model) == 2
        assert isinstance(model.model.layers[0].mlp.experts, UnfusedExperts)
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_every_expert_is_quantized_even_when_routed_no_tokens(family, tmp_path):
    model = tiny_moe(family)
    starve_expert(model)
    originals = {
        (i, name): p.detach().clone()
        for i, layer in enumerate(model.model.layers)
        for name, p in layer.mlp.experts.named_parameters()
    }
    calibration = torch.randint(0, 96, (8, 32), generator=torch.Generator().manual_seed(1))
    ctx = StageContext(calibration=lambda: calibration, state_dir=tmp_path, resume=False, fingerprint="moe")
    summary = run_gptq(model, GPTQConfig(bits=4, group_size=32, act_order=True, batch_size=4), ctx)

    assert summary["moe_blocks_unfused"] == 2
    shared = 4 if family == "qwen2_moe" else 0  # shared_expert gate/up/down + shared_expert_gate
    assert summary["quantized_linears"] == 2 * (4 + 3 * N_EXPERTS + shared)
    for i, layer in enumerate(model.model.layers):
        for e, expert in enumerate(layer.mlp.experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                linear = getattr(expert, proj)
                assert isinstance(linear, QuantizedLinear), (i, e, proj)
                assert torch.isfinite(linear.scales).all() and (linear.scales > 0).all()
                weight = linear.dequantized_weight(torch.float32)
                fused_gate_up = originals[(i, "gate_up_proj")][e]
                original = {
                    "gate_proj": fused_gate_up[: weight.shape[0]],
                    "up_proj": fused_gate_up[weight.shape[0] :],
                    "down_proj": originals[(i, "down_proj")][e],
                }[proj]
                # With no statistics GPTQ would zero every (dead) column of the starved expert.
                relative = (weight - original).norm() / original.norm()
                assert relative < 0.3, (i, e, proj, relative.item())
