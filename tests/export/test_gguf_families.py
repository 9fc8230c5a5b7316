"""GGUF files of the families beyond Llama (Qwen2's q/k/v biases, Qwen3's q/k norms, Phi-3's fused qkv_proj and
gate_up_proj), loaded and run by llama.cpp itself (llama-cpp-python), and read back by lmpress."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from lmpress.errors import LmpressInputError
from lmpress.export.gguf import read_gguf, write_gguf
from lmpress.quantize.rtn import RTNConfig, run_rtn
from lmpress.registry import StageContext
from tests.conftest import _train_tokenizer
from tests.export.test_gguf_llama_cpp import TEXTS, dequantized_copy, llama_cpp_logits, llama_cpp_tokens, relative_rms
from tests.families import save_family_model

needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama.cpp is not installed (llama-cpp-python; build it as .ci/run does)",
)
FAMILIES = ["qwen2", "qwen3", "phi3"]


@pytest.fixture(scope="module")
def tokenizer():
    return _train_tokenizer()


def family_model(family: str, tokenizer, tmp_path, **overrides):
    from transformers import AutoModelForCausalLM

    path = save_family_model(tmp_path / family, family, tokenizer)
    return AutoModelForCausalLM.from_pretrained(path, **overrides).eval()


def logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def rtn(model, tmp_path) -> None:
    ctx = StageContext(calibration=lambda: None, state_dir=tmp_path / "state", resume=False, fingerprint="x")
    run_rtn(model, RTNConfig(bits=4, group_size=32, symmetric=True), ctx)


@needs_llama_cpp
@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_runs_the_dequantized_model_as_transformers_does(family, tokenizer, tmp_path):
    """The W4 model's weights, dequantized (float16 scales, as the file holds them) and written as F32: llama.cpp's
    logits are transformers' within float32 summation order (measured 2-3e-7). A bias, q/k norm or fused half
    in the wrong place moves them ~100%."""
    model = family_model(family, tokenizer, tmp_path)
    rtn(model, tmp_path)
    biases = {n: m.bias for n, m in model.named_modules() if getattr(m, "bias", None) is not None}
    dense = dequantized_copy(model)
    for name, bias in biases.items():  # dequantized_copy drops biases; Qwen2's q/k/v keep theirs
        dense.get_submodule(name).bias = bias
    assert len(biases) == (6 if family == "qwen2" else 0)
    write_gguf(dense, tokenizer, tmp_path / "f32.gguf")
    ids = tokenizer(TEXTS[0] + TEXTS[1]).input_ids
    assert relative_rms(llama_cpp_logits(tmp_path / "f32.gguf", ids), logits(dense, ids)) < 1e-5


@needs_llama_cpp
@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_runs_the_quantized_file_as_lmpress_does(family, tokenizer, tmp_path):
    import gguf

    model = family_model(family, tokenizer, tmp_path)
    rtn(model, tmp_path)
    write_gguf(model, tokenizer, tmp_path / "q.gguf")
    reader = gguf.GGUFReader(str(tmp_path / "q.gguf"))
    assert reader.fields["general.architecture"].contents() == family
    assert {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2} == {"Q4_0", "F32"}
    ids = tokenizer(TEXTS[0] + TEXTS[1]).input_ids
    got, want = llama_cpp_logits(tmp_path / "q.gguf", ids), logits(model, ids)
    # llama.cpp rounds activations to Q8_0 for its Q4_0 products: ~0.5-0.7% RMS here (measured)
    assert relative_rms(got, want) < 0.02
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.95
    assert llama_cpp_tokens(tmp_path / "q.gguf", TEXTS[0]) == tokenizer(TEXTS[0]).input_ids


@pytest.mark.parametrize("family", FAMILIES)
def test_the_file_reads_back_as_the_candidate(family, tokenizer, tmp_path):
    from lmpress.export.formats import quantized_layers

    model = family_model(family, tokenizer, tmp_path)
    rtn(model, tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    write_gguf(model, tokenizer, out / "model.gguf")
    back = read_gguf(out)
    assert back.config.model_type == family
    layers = quantized_layers(model)
    assert set(quantized_layers(back)) == set(layers)
    for name, module in layers.items():
        other = back.get_submodule(name)
        assert torch.equal(other.codes(), module.codes()), name
        assert torch.equal(other.scales.float(), module.scales.half().float()), name
        assert (other.bias is None) == (module.bias is None), name
        if module.bias is not None:
            assert torch.equal(other.bias, module.bias), name
    ids = tokenizer(TEXTS[0]).input_ids
    # float16 scales are the only difference
    assert relative_rms(logits(back, ids), logits(model, ids)) < 1e-3


@pytest.mark.parametrize(
    ("family", "overrides", "fragment"),
    [
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8}, "qwen2 with sliding-window layers"),
        ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
         "partial rotary embeddings (0.5)"),
        ("gemma2", {}, "architecture 'gemma2' is not written by lmpress's GGUF writer"),
    ],
)  # fmt: skip
def test_what_llama_cpp_would_compute_differently_is_refused(family, overrides, fragment, tokenizer, tmp_path):
    model = family_model(family, tokenizer, tmp_path, **overrides)
    with pytest.raises(LmpressInputError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        write_gguf(model, tokenizer, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()


def qwen2_tokenizer():
    """A byte-level BPE trained here with Qwen2's own pre-tokenizer (its regex split, then bytes)."""
    from pydoc_data.topics import topics

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from lmpress.export.gguf_metadata import QWEN2_REGEX

    tok = Tokenizer(models.BPE(unk_token=None))
    split = pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<|endoftext|>", "<s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([topics[k] for k in sorted(topics)][:40], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|endoftext|>")


@needs_llama_cpp
def test_qwen2_pre_tokenizer_splits_in_llama_cpp_as_in_transformers(tmp_path):
    """Qwen's split (one digit at a time, case-insensitive contractions, newline runs) is written as llama.cpp's
    "qwen2" pre-tokenizer: llama.cpp tokenizes as transformers does."""
    import gguf

    tokenizer = qwen2_tokenizer()
    model = family_model("qwen2", tokenizer, tmp_path)
    write_gguf(model, tokenizer, tmp_path / "m.gguf")
    assert gguf.GGUFReader(str(tmp_path / "m.gguf")).fields["tokenizer.ggml.pre"].contents() == "qwen2"
    texts = TEXTS + ["DON'T we've 3.14159 and 2024-11-27\r\n\r\n  x\n\n\ty = [1,2]  ", "ÄÖÜ straße — naïve café 東京"]
    for text in texts:
        assert llama_cpp_tokens(tmp_path / "m.gguf", text) == tokenizer(text).input_ids, text


@pytest.mark.parametrize("family", FAMILIES)
def test_the_runtime_reads_the_file_as_the_transformers_path_does(family, tokenizer, tmp_path):
    """The runtime builds its model from the tensors lmpress's reader decodes (no transformers model): Qwen2's
    biases, Qwen3's q/k norms and Phi-3's fused linears reach it as through the model the evals load."""
    from lmpress.export.gguf import export_gguf
    from lmpress.runtime.model import Transformer
    from lmpress.runtime.text import load_runtime

    model = family_model(family, tokenizer, tmp_path)
    rtn(model, tmp_path)
    export_gguf(model, tokenizer, tmp_path / "gguf")
    via_transformers = Transformer.from_hf(read_gguf(tmp_path / "gguf"))
    direct, _ = load_runtime(str(tmp_path / "gguf"))
    ids = torch.tensor([tokenizer(TEXTS[0]).input_ids])
    with torch.no_grad():
        want = via_transformers(ids, via_transformers.new_cache(1, ids.shape[1]))
        got = direct(ids, direct.new_cache(1, ids.shape[1]))
    assert torch.equal(got, want)
