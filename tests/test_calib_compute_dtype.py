"""A 16-bit model's layers compute in float32 while calibrated on a CPU without 16-bit matrix instructions
(lmpress.calib.compute_dtype), and go back to their dtype after."""

from __future__ import annotations

import pytest
import torch

from lmpress.calib import compute_dtype
from lmpress.calib.compute_dtype import (
    calibration_compute_dtype,
    restore_layer_dtype,
    upcast_layer,
    widens_to_float32,
)
from lmpress.loader import load_model
from lmpress.quantize.gptq import GPTQConfig, run_gptq
from tests.test_calib_engine import calibration_for, context


@pytest.mark.parametrize("native", [True, False])
def test_only_a_16bit_model_on_a_cpu_without_its_matrix_unit_computes_in_float32(monkeypatch, native):
    monkeypatch.setattr(compute_dtype, "has_16bit_matmul", lambda dtype: native)
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    expected = torch.bfloat16 if native else torch.float32
    assert calibration_compute_dtype(torch.bfloat16, cpu) == expected
    assert calibration_compute_dtype(torch.float16, cpu) == (torch.float16 if native else torch.float32)
    assert calibration_compute_dtype(torch.float32, cpu) == torch.float32
    assert calibration_compute_dtype(torch.bfloat16, gpu) == torch.bfloat16  # a GPU has its own units
    assert widens_to_float32(torch.bfloat16, cpu) is not native
    assert not widens_to_float32(torch.float32, cpu) and not widens_to_float32(torch.bfloat16, gpu)


def test_a_cpu_without_avx512_has_no_16bit_matrix_path():
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "DEFAULT"):
        pytest.skip(f"this CPU's level is {torch.backends.cpu.get_cpu_capability()}: oneDNN may have one")
    assert not compute_dtype.has_16bit_matmul(torch.bfloat16) and not compute_dtype.has_16bit_matmul(torch.float16)


def test_a_layer_goes_back_to_its_dtype_keeping_what_it_did_not_change():
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4)).bfloat16()
    before = {name: t.data for name, t in layer.named_parameters()}
    originals = upcast_layer(layer, torch.bfloat16)
    assert originals.keys() == before.keys() and all(p.dtype == torch.float32 for p in layer.parameters())
    layer[1].weight.data.mul_(1.001)  # a method rescaled the norm
    biases = {"2": layer[2].bias.data.clone()}  # the session keeps a quantized linear's bias
    layer[2] = torch.nn.Identity()  # the linear was replaced (by its quantized module)
    restore_layer_dtype(layer, originals, biases)
    assert layer[0].weight.data.data_ptr() == before["0.weight"].data_ptr()  # untouched: the same storage
    assert layer[1].weight.dtype == torch.bfloat16
    assert torch.equal(layer[1].weight, (before["1.weight"].float() * 1.001).bfloat16())
    assert biases["2"].dtype == torch.bfloat16 and torch.equal(biases["2"], before["2.bias"])


def test_gptq_on_a_bfloat16_model_computes_in_float32_there_and_leaves_bfloat16_weights(
    tiny_llama_dir, tmp_path, monkeypatch
):
    """Float32 compute of a bfloat16 model is the float32 model whose weights are the bfloat16 values (but for the
    rotary tables, which the model computes in its own dtype)."""
    monkeypatch.setattr(compute_dtype, "has_16bit_matmul", lambda dtype: False)
    loaded = load_model(str(tiny_llama_dir), "bfloat16")
    calibration = calibration_for(loaded.tokenizer)
    config = GPTQConfig(bits=4, group_size=32)
    summary = run_gptq(loaded.model, config, context(tmp_path / "a", calibration))
    assert summary["compute_dtype"] == "float32"
    floats = [p for p in loaded.model.parameters() if p.is_floating_point()]
    assert floats and all(p.dtype == torch.bfloat16 for p in floats)

    monkeypatch.setattr(compute_dtype, "has_16bit_matmul", lambda dtype: True)
    native = load_model(str(tiny_llama_dir), "bfloat16")
    assert "compute_dtype" not in run_gptq(native.model, config, context(tmp_path / "b", calibration))
    upcast = load_model(str(tiny_llama_dir), "float32")
    upcast.model.load_state_dict(
        {k: v.float() for k, v in load_model(str(tiny_llama_dir), "bfloat16").model.state_dict().items()}
    )
    run_gptq(upcast.model, config, context(tmp_path / "c", calibration))
    # layer 0's q, k and v read the normed embeddings, which no rotary table touches: there float32 compute of the
    # bfloat16 model is exactly the float32 model's, and bfloat16 compute is not
    codes, reference, bf16 = (dict(m.model.named_buffers()) for m in (loaded, upcast, native))
    for linear in ("q_proj", "k_proj", "v_proj"):
        name = f"model.layers.0.self_attn.{linear}.qweight"
        assert torch.equal(codes[name], reference[name]) and not torch.equal(codes[name], bf16[name]), name


def float32_reference(model: torch.nn.Module) -> torch.nn.Module:
    """The bfloat16 model's weights in a float32 model: what layers_in_float32 computes."""
    import copy

    return copy.deepcopy(model).float()


def test_evals_widen_each_decoder_layer_and_the_head(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(compute_dtype, "has_16bit_matmul", lambda dtype: False)
    model = load_model(str(tiny_llama_dir), "bfloat16").model
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    storage = {name: p.data_ptr() for name, p in model.named_parameters()}
    with torch.no_grad():
        plain = model(ids).logits
        with compute_dtype.layers_in_float32(model) as widened:
            logits = model(ids).logits
        expected = float32_reference(model)(ids).logits
    assert widened and logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    assert not torch.equal(plain.float(), expected)  # bfloat16 compute rounds between operations: widening is seen
    # afterwards: the same bfloat16 storage everywhere, no hook left
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == storage
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_evals_change_nothing_where_the_cpu_multiplies_16bit_matrices(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(compute_dtype, "has_16bit_matmul", lambda dtype: True)
    model = load_model(str(tiny_llama_dir), "bfloat16").model
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(ids).logits
        with compute_dtype.layers_in_float32(model) as widened:
            assert not widened and not any(m._forward_hooks for m in model.modules())
            assert torch.equal(model(ids).logits, plain)


def test_the_perplexity_eval_of_a_bfloat16_model_is_the_widened_model_s(tiny_llama_dir, monkeypatch):
    """run_suite scores the model as layers_in_float32 computes it (as a candidate: nothing cached), and the
    baseline's cache key says so (a baseline cached from bfloat16 arithmetic is not reused). On this tiny model
    bfloat16 arithmetic moves the perplexity by ~7e-5 relative."""
    from lmpress.evals.suite import baseline_identity, run_suite
    from lmpress.progress import QUIET
    from lmpress.recipe import parse_recipe

    evals = parse_recipe(
        {"model": str(tiny_llama_dir), "eval": {"text": "builtin:python-docs", "perplexity": {"seq_len": 64}}}, "s"
    ).eval
    loaded = load_model(str(tiny_llama_dir), "bfloat16")
    reference = float32_reference(loaded.model)
    monkeypatch.setattr(compute_dtype, "has_16bit_matmul", lambda dtype: False)
    assert baseline_identity("m", loaded.model)["compute"] == "torch.float32"
    widened = run_suite(evals.evals, evals.text, loaded.model, loaded.tokenizer, "a", "candidate", QUIET)
    expected = run_suite(evals.evals, evals.text, reference, loaded.tokenizer, "b", "candidate", QUIET)
    assert widened["perplexity"].metrics["ppl"] == pytest.approx(expected["perplexity"].metrics["ppl"], rel=1e-6)
    monkeypatch.setattr(compute_dtype, "has_16bit_matmul", lambda dtype: True)
    assert "compute" not in baseline_identity("m", loaded.model)


def test_exact_kld_recomputes_the_widened_head_s_logits(tiny_llama_dir, tmp_path, monkeypatch):
    """Exact KLD recomputes the baseline's logits from its head's inputs and weight: as the widened forward computed
    them (float32), so a bfloat16 model against itself scores 0 exactly."""
    from lmpress.evals.suite import baseline_identity, run_suite
    from lmpress.progress import QUIET
    from lmpress.recipe import parse_recipe

    monkeypatch.setattr(compute_dtype, "has_16bit_matmul", lambda dtype: False)
    perplexity = {"seq_len": 64, "windows": 2, "kld": {}}
    evals = parse_recipe({"model": str(tiny_llama_dir), "eval": {"perplexity": perplexity}}, "s").eval
    loaded = load_model(str(tiny_llama_dir), "bfloat16")
    identity = baseline_identity(str(tmp_path), loaded.model)
    run_suite(evals.evals, evals.text, loaded.model, loaded.tokenizer, identity, "baseline", QUIET)
    same = run_suite(evals.evals, evals.text, loaded.model, loaded.tokenizer, identity, "candidate", QUIET)
    assert same["perplexity"].metrics["kld_max"] == 0 and same["perplexity"].metrics["top1_agreement"] == 1
