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


def tiny_family(family: str):
    """A tiny random DeepSeek-V3 (latent attention, a dense first layer, shared + routed experts) or gpt-oss
    (biased experts with a clamped interleaved SwiGLU, attention sinks, sliding and full layers)."""
    from transformers import AutoModelForCausalLM

    from tests.families import randomize_norms, tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, 96, {})).eval()
    randomize_norms(model, 0)
    return model


# per model: linears the GPTQ pass quantizes. DeepSeek-V3: q_a, q_b, kv_a, kv_b, o in both layers, a dense MLP
# in layer 0, 4 experts and the shared expert in layer 1. gpt-oss: q, k, v, o and 4 experts in both layers.
QUANTIZED = {"deepseek_v3": 5 + 3 + 5 + 3 * N_EXPERTS + 3, "gpt_oss": 2 * (4 + 3 * N_EXPERTS)}


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_deepseek_and_gpt_oss_experts_unfuse_to_the_same_function(family):
    model = tiny_family(family)
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
        assert unfuse_experts(model) == (1 if family == "deepseek_v3" else 2)
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_deepseek_and_gpt_oss_every_linear_and_expert_is_calibrated(family, tmp_path):
    model = tiny_family(family)
    experts = {i: layer.mlp.experts for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")}
    originals = {(i, n): p.detach().clone() for i, e in experts.items() for n, p in e.named_parameters()}
    calibration = torch.randint(0, 96, (8, 32), generator=torch.Generator().manual_seed(1))
    ctx = StageContext(calibration=lambda: calibration, state_dir=tmp_path, resume=False, fingerprint=family)
    summary = run_gptq(model, GPTQConfig(bits=4, group_size=32, batch_size=4), ctx)
    assert summary["quantized_linears"] == QUANTIZED[family]
    for i in experts:
        unfused = model.model.layers[i].mlp.experts
        for e, expert in enumerate(unfused):
            gate_up, down = originals[(i, "gate_up_proj")][e], originals[(i, "down_proj")][e]
            if family == "gpt_oss":  # (H, 2I) with gate and up columns interleaved, (I, H); biases stay float
                want = {"gate_proj": gate_up[:, 0::2].T, "up_proj": gate_up[:, 1::2].T, "down_proj": down.T}
                bias = originals[(i, "gate_up_proj_bias")][e]
                assert torch.equal(expert.gate_proj.bias, bias[0::2]) and torch.equal(expert.up_proj.bias, bias[1::2])
                assert torch.equal(expert.down_proj.bias, originals[(i, "down_proj_bias")][e])
            else:
                half = gate_up.shape[0] // 2
                want = {"gate_proj": gate_up[:half], "up_proj": gate_up[half:], "down_proj": down}
            for proj, original in want.items():
                linear = getattr(expert, proj)
                assert isinstance(linear, QuantizedLinear), (i, e, proj)
                relative = (linear.dequantized_weight(torch.float32) - original).norm() / original.norm()
                assert relative < 0.3, (i, e, proj, relative.item())


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize("fmt", ["hf", "compressed-tensors"])
def test_deepseek_and_gpt_oss_exports_reload_with_the_quantized_logits(family, fmt, tmp_path):
    """The export read back (hf: by transformers itself, which re-fuses DeepSeek's per-expert tensors and reads
    gpt-oss's fused layout; compressed-tensors: by lmpress's reader) gives the in-memory quantized model's logits."""
    from transformers import AutoModelForCausalLM

    from lmpress.loader import load_model
    from lmpress.quantize.rtn import RTNConfig, run_rtn
    from lmpress.registry import exporter
    from tests.conftest import _train_tokenizer

    model = tiny_family(family)
    ctx = StageContext(calibration=lambda: None, state_dir=tmp_path / "state", resume=False, fingerprint=family)
    run_rtn(model, RTNConfig(bits=4, group_size=32), ctx)
    out = tmp_path / fmt
    out.mkdir()
    exporter(fmt)(model, _train_tokenizer(), out)
    if fmt == "hf":
        reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    else:
        reloaded = load_model(str(out), fingerprint=False).model
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
