"""R4 in the rotate stage (``rotate_down_proj``): the same function, calibration on the rotated input of down_proj,
scaling pairs that no longer fold skipped, the compressed-tensors export read back by lmpress's loader, its
runtime and the hf export, and the formats that cannot hold it refused."""

import json

import pytest
import torch

from lmpress.anatomy import decoder_layers
from lmpress.data import calibration_samples, load_text, tokenize
from lmpress.errors import LmpressInputError
from lmpress.export.formats import check_recipe_exports, load_quantized_model
from lmpress.export.inspect import inspect_artifact
from lmpress.export.verify import check_export, window_ppl
from lmpress.loader import load_model
from lmpress.quantize.awq import AWQConfig, run_awq
from lmpress.quantize.gptq import GPTQConfig, run_gptq
from lmpress.quantize.rotate import RotateConfig, run_rotate
from lmpress.registry import StageContext, exporter
from lmpress.weights.float8 import FP8_MAX
from lmpress.weights.fp4 import E2M1_MAX
from lmpress.weights.online_rotation import blockwise_hadamard, input_rotation_of
from tests.quantize.test_rotate import exact_norms, logits, tiny_model

IDS = torch.tensor([[1, 7, 42, 99, 3, 250, 17, 5, 64, 8]])


def context(tmp_path, calibration=None) -> StageContext:
    return StageContext(calibration=lambda: calibration, state_dir=tmp_path / "state", resume=False, fingerprint="r4")


@pytest.mark.parametrize("case", ["LlamaConfig", "Qwen3Config"])
@pytest.mark.parametrize("block", [None, 32])
def test_r4_rotated_model_computes_the_same_logits(case, block, tmp_path, monkeypatch):
    model = tiny_model(case, torch.float64, tie_word_embeddings=False)
    exact_norms(model, monkeypatch)
    before = logits(model)
    info = run_rotate(model, RotateConfig(rotate_down_proj=True, down_proj_block=block), context(tmp_path))
    assert ((logits(model) - before).abs().max() / before.abs().max()).item() < 1e-12
    want = block or 64  # the MLP width 192 = 3 x 64
    assert info["down_proj_hadamard_block"] == want
    assert all(input_rotation_of(layer.mlp.down_proj).block == want for layer in model.model.layers)
    assert input_rotation_of(model.model.layers[0].mlp.up_proj) is None


def test_r4_alone_turns_only_down_proj_and_computes_the_same_logits(tmp_path, monkeypatch):
    """R4 without R1 or R2 (bench/fp4_table.py's r4-only rows): only down_proj's input is turned; the residual
    stream, the embeddings and v/o keep their weights."""
    model = tiny_model("LlamaConfig", torch.float64, tie_word_embeddings=False)
    exact_norms(model, monkeypatch)
    before = logits(model)
    untouched = {n: p.clone() for n, p in model.named_parameters() if "down_proj" not in n}
    config = RotateConfig(residual=False, rotate_heads=False, rotate_down_proj=True)
    info = run_rotate(model, config, context(tmp_path))
    assert ((logits(model) - before).abs().max() / before.abs().max()).item() < 1e-12
    assert info["hidden_hadamard"] is None and info["down_proj_hadamard_block"] == 64
    assert all(torch.equal(p, untouched[n]) for n, p in model.named_parameters() if n in untouched)
    assert all(input_rotation_of(layer.mlp.down_proj).block == 64 for layer in model.model.layers)


def test_an_r4_block_that_does_not_fit_the_mlp_is_refused_before_any_weight_changes(tmp_path):
    model = tiny_model("LlamaConfig")
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(LmpressInputError, match="down_proj_block: blocks of 128 do not divide 192 .* 64"):
        run_rotate(model, RotateConfig(rotate_down_proj=True, down_proj_block=128), context(tmp_path))
    assert all(torch.equal(p, before[n]) for n, p in model.state_dict().items())


def tiny_calibrated(tiny_llama_dir, tmp_path, **gptq):
    """The tiny Llama (MLP width 256: one block of 256), rotated with R4, then GPTQ with ``gptq``."""
    loaded = load_model(str(tiny_llama_dir))
    calibration = calibration_samples(tokenize(loaded.tokenizer, load_text("builtin:python-docs")), 8, 32, seed=0)
    run_rotate(loaded.model, RotateConfig(rotate_down_proj=True), context(tmp_path))
    run_gptq(loaded.model, GPTQConfig(**gptq), context(tmp_path, calibration))
    return loaded, calibration


def test_gptq_calibrates_down_proj_on_its_rotated_input(tiny_llama_dir, tmp_path):
    """NVFP4 W4A4's input_global_scale is 448 * 6 / max|x| of the inputs calibration recorded: the rotated ones."""
    only_down = r"(?!model\.layers\.0\.mlp\.down_proj$).*"  # every other linear stays float
    only_down = {"fp4": "nvfp4", "activations": "fp4", "ignore": ["lm_head", only_down]}
    loaded, calibration = tiny_calibrated(tiny_llama_dir, tmp_path, **only_down)
    down = decoder_layers(loaded.model)[0].mlp.down_proj
    assert input_rotation_of(down).block == 256 and down.input_global_scale is not None
    seen = []
    handle = down.register_forward_pre_hook(lambda m, args: seen.append(args[0].abs().max()))  # after the rotation
    with torch.no_grad():
        loaded.model(calibration)
    handle.remove()
    rotated = max(seen).item()
    torch.testing.assert_close(down.input_global_scale.item(), FP8_MAX * E2M1_MAX / rotated, rtol=1e-2, atol=0)
    # the test tells the two apart: the same inputs turned back differ in range
    turned_back = []
    handle = down.register_forward_pre_hook(lambda m, args: turned_back.append(blockwise_hadamard(args[0], 256)))
    with torch.no_grad():
        loaded.model(calibration)
    handle.remove()
    assert abs(max(t.abs().max().item() for t in turned_back) / rotated - 1) > 0.05


def test_awq_leaves_the_pair_into_a_rotated_down_proj(tiny_llama_dir, tmp_path):
    loaded = load_model(str(tiny_llama_dir))
    calibration = calibration_samples(tokenize(loaded.tokenizer, load_text("builtin:python-docs")), 4, 32, seed=0)
    run_rotate(loaded.model, RotateConfig(rotate_down_proj=True), context(tmp_path))
    with torch.no_grad():
        before = loaded.model(IDS).logits
    summary = run_awq(loaded.model, AWQConfig(bits=8, group_size=32), context(tmp_path, calibration))
    assert "mlp.up_proj -> mlp.down_proj" in summary["skipped_scaling_pairs"]
    with torch.no_grad():
        after = loaded.model(IDS).logits
    assert (after - before).pow(2).mean() < 1e-3 * before.var()


@pytest.mark.parametrize("activations", [None, "fp4"])
def test_r4_compressed_tensors_export_runs_the_same_in_the_loader_and_the_runtime(
    tiny_llama_dir, tmp_path, activations
):
    # imported here, not at collection: compressed-tensors' transforms import triton, which must first see the
    # TRITON_INTERPRET that tests/runtime/test_triton_kernels.py sets as it is collected
    from compressed_tensors.transform import TransformConfig
    from transformers import AutoModelForCausalLM

    from lmpress.runtime.checkpoint import load_checkpoint
    from lmpress.runtime.throughput import layer_kernels

    loaded, _ = tiny_calibrated(tiny_llama_dir, tmp_path, fp4="nvfp4", activations=activations)
    model, tokenizer = loaded.model, loaded.tokenizer
    with torch.no_grad():
        want = model(IDS).logits
    out = tmp_path / "ct"
    out.mkdir()
    exporter("compressed-tensors")(model, tokenizer, out)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    transforms = TransformConfig.model_validate(qc["transform_config"])  # compressed-tensors reads it
    assert transforms.config_groups["R4"].head_dim == 256
    info = inspect_artifact(out)  # what lmpress inspect shows, and who serves it
    assert info["online_rotations"] == "R4: hadamard blocks of 256 on the input of 2 layer(s) (down_proj)"
    assert "hadacore_transform" in info["vllm"] and info["vllm"].startswith("refuses")
    reread = load_quantized_model(out)
    assert input_rotation_of(reread.model.layers[1].mlp.down_proj).block == 256
    with torch.no_grad():
        torch.testing.assert_close(reread(IDS).logits, want, rtol=0, atol=1e-5)
    runtime = load_checkpoint(out, cpu_activations="bf16")  # dense float execution of A16 layers: comparable
    with torch.no_grad():
        got = runtime(IDS, runtime.new_cache(1, IDS.shape[1]))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert "layers.0.feed_forward.w2" in layer_kernels(runtime)
    if activations is None:  # hf: dense weights with the rotation folded back, for any transformers install
        hf = tmp_path / "hf"
        hf.mkdir()
        exporter("hf")(model, tokenizer, hf)
        plain = AutoModelForCausalLM.from_pretrained(hf).eval()
        with torch.no_grad():
            torch.testing.assert_close(plain(IDS).logits, want, rtol=1e-4, atol=1e-4)
        check = check_export("hf", model, plain, IDS, window_ppl(model, IDS))  # what a run reports for hf
        assert check.weights_match, check.weights


@pytest.mark.parametrize("fmt", ["gguf", "gptq", "awq", "onnx"])
def test_formats_that_cannot_hold_r4_are_refused(fmt, tiny_llama_dir, tmp_path):
    with pytest.raises(LmpressInputError, match=f"export.formats\\[0\\] {fmt}: stages\\[0\\] rotate: rotate_down_proj"):
        check_recipe_exports([RotateConfig(rotate_down_proj=True)], [fmt])
    loaded = load_model(str(tiny_llama_dir))
    run_rotate(loaded.model, RotateConfig(rotate_down_proj=True), context(tmp_path))
    out = tmp_path / fmt
    out.mkdir()
    with pytest.raises(LmpressInputError, match=f"export {fmt}: model.layers.0.mlp.down_proj rotates its input"):
        exporter(fmt)(loaded.model, loaded.tokenizer, out)
    assert not any(out.iterdir())


def test_structured_mlp_pruning_after_r4_is_refused_in_the_recipe():
    from lmpress.recipe import parse_recipe

    stages = [{"method": "rotate", "rotate_down_proj": True}, {"method": "structured", "mlp_channels": 0.25}]
    with pytest.raises(LmpressInputError, match=r"stages\[1\]: structured removes MLP channels after stages\[0\]"):
        parse_recipe({"model": "x", "stages": stages})
    parse_recipe(
        {"model": "x", "stages": [{"method": "rotate", "rotate_down_proj": True}, {"method": "structured", "heads": 1}]}
    )


def test_distillation_keeps_r4_on_the_student_and_on_the_layers_it_gives_back(tiny_llama_dir, tmp_path):
    from lmpress.distill.student import freeze_student, prepare_student
    from lmpress.quantize.rtn import RTNConfig, run_rtn

    loaded = load_model(str(tiny_llama_dir))
    model = loaded.model
    run_rotate(model, RotateConfig(rotate_down_proj=True), context(tmp_path))
    run_rtn(model, RTNConfig(bits=4, group_size=32), context(tmp_path))
    with torch.no_grad():
        before = model(IDS).logits
    prepare_student(model)
    assert input_rotation_of(model.model.layers[0].mlp.down_proj).block == 256
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, before, rtol=1e-4, atol=1e-4)
    freeze_student(model)
    assert input_rotation_of(model.model.layers[1].mlp.down_proj).block == 256
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, before, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("residual", [True, False])
def test_every_linear_turned_online_in_fp4_blocks_is_the_same_function(residual, tmp_path, monkeypatch):
    """input_block: each decoder linear's input turned by blocks of 16 (NVFP4's), with or without R1."""
    model = tiny_model("LlamaConfig", torch.float64, tie_word_embeddings=False)
    exact_norms(model, monkeypatch)
    before = logits(model)
    embedding = model.model.embed_tokens.weight.clone()
    config = RotateConfig(residual=residual, input_block=16)
    info = run_rotate(model, config, context(tmp_path))
    assert ((logits(model) - before).abs().max() / before.abs().max()).item() < 1e-12
    assert info["input_hadamard_block"] == 16 and (info["hidden_hadamard"] is None) == (not residual)
    assert torch.equal(model.model.embed_tokens.weight, embedding) == (not residual)
    layer = model.model.layers[1]
    assert all(input_rotation_of(m).block == 16 for n, m in layer.named_modules() if n.endswith("_proj"))


def test_input_block_refusals(tmp_path):
    model = tiny_model("LlamaConfig")
    with pytest.raises(LmpressInputError, match="input_block turns down_proj's input too"):
        RotateConfig(input_block=16, rotate_down_proj=True).check(model)
    with pytest.raises(LmpressInputError, match="input_block: self_attn.q_proj: blocks of 64 do not divide 96"):
        RotateConfig(input_block=64).check(model)


def test_every_linear_turned_online_runs_fused_in_the_runtime(tiny_llama_dir, tmp_path):
    """q/k/v and gate/up share a turned input: the runtime turns it once before their fused matmul."""
    from lmpress.quantize.rtn import RTNConfig, run_rtn
    from lmpress.runtime.checkpoint import load_checkpoint
    from lmpress.runtime.linears import RotatedInputLinear

    loaded = load_model(str(tiny_llama_dir))
    run_rotate(loaded.model, RotateConfig(residual=False, input_block=16), context(tmp_path))
    run_rtn(loaded.model, RTNConfig(bits=4, group_size=32), context(tmp_path))
    with torch.no_grad():
        want = loaded.model(IDS).logits
    out = tmp_path / "ct"
    out.mkdir()
    exporter("compressed-tensors")(loaded.model, loaded.tokenizer, out)
    runtime = load_checkpoint(out, cpu_activations="bf16")
    attention = runtime.layers[0].attention.wqkv
    assert len(attention.parts) == 1 and isinstance(attention.parts[0], RotatedInputLinear)
    with torch.no_grad():
        got = runtime(IDS, runtime.new_cache(1, IDS.shape[1]))
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
