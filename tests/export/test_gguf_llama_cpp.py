"""GGUF files lmpress writes, loaded and run by llama.cpp itself (llama-cpp-python)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from lmpress.export.gguf import write_gguf

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama.cpp is not installed (llama-cpp-python; build it as .ci/run does)",
)
TEXTS = [
    "def f(x):\n    return x + 1  # 12345 tabs\tand  spaces",
    "Hello world! It's 2024, isn't it? \u00fcn\u00efc\u00f6d\u00e9 \u2014 done.",
]
F32 = 0  # GGML_TYPE_F32: llama.cpp's KV cache in float32, so only the weights' types differ from lmpress


def llama_cpp_logits(path: Path, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits at every position of ``ids`` (float32 KV cache, 2 threads)."""
    import llama_cpp

    llm = llama_cpp.Llama(
        str(path), n_ctx=512, logits_all=True, verbose=False, n_threads=2, type_k=F32, type_v=F32, n_batch=512
    )
    try:
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float32)
    finally:
        llm.close()


def llama_cpp_tokens(path: Path, text: str) -> list[int]:
    import llama_cpp

    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    try:
        return llm.tokenize(text.encode(), add_bos=False, special=False)
    finally:
        llm.close()


def relative_rms(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sqrt(((got - want) ** 2).mean() / (want**2).mean()))


def lmpress_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def test_dense_gguf_logits_equal_transformers(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    write_gguf(model, tokenizer, tmp_path / "m.gguf")
    ids = tokenizer(TEXTS[0] + TEXTS[1]).input_ids
    # Same float32 weights, float32 everywhere: only the order of float sums differs (measured 4e-7).
    assert relative_rms(llama_cpp_logits(tmp_path / "m.gguf", ids), lmpress_logits(model, ids)) < 1e-5


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_gguf_logits_match_lmpress(quantized_tiny, tmp_path, bits):
    model, tokenizer = quantized_tiny(bits=bits, group_size=32, symmetric=True)
    write_gguf(model, tokenizer, tmp_path / "m.gguf")
    ids = tokenizer(TEXTS[0] + TEXTS[1]).input_ids
    got, want = llama_cpp_logits(tmp_path / "m.gguf", ids), lmpress_logits(model, ids)
    # llama.cpp multiplies Q4_0/Q8_0 weights with activations rounded to Q8_0 (8 bits per 32 values), which
    # moves these logits by ~0.75% RMS (measured); a wrong nibble order, scale or row order moves them ~100%.
    assert relative_rms(got, want) < 0.02
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.95


def test_mxfp4_gguf_logits_match_lmpress(quantized_tiny, tmp_path):
    """llama.cpp runs lmpress's MXFP4 layers (GGML type MXFP4: an E8M0 byte and 16 bytes of nibbles per 32)."""
    import gguf

    model, tokenizer = quantized_tiny(fp4="mxfp4")
    write_gguf(model, tokenizer, tmp_path / "m.gguf")
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors if len(t.shape) == 2}
    assert "MXFP4" in kinds
    ids = tokenizer(TEXTS[0] + TEXTS[1]).input_ids
    got, want = llama_cpp_logits(tmp_path / "m.gguf", ids), lmpress_logits(model, ids)
    # llama.cpp multiplies MXFP4 weights with activations rounded to Q8_0, as for Q4_0 (~1% RMS); a wrong nibble
    # order, exponent bias or E2M1 table moves the logits by tens of percent
    assert relative_rms(got, want) < 0.02
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.95


def test_q4_k_gguf_logits_match_lmpress(quantized_wide, tmp_path):
    import gguf

    model, tokenizer = quantized_wide(bits=4, group_size=32, k_quant_scales=True)
    write_gguf(model, tokenizer, tmp_path / "m.gguf")
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors if len(t.shape) == 2}
    assert kinds == {"Q4_K", "F32"}  # every linear Q4_K, the token embedding F32
    ids = tokenizer(TEXTS[0] + TEXTS[1]).input_ids
    got, want = llama_cpp_logits(tmp_path / "m.gguf", ids), lmpress_logits(model, ids)
    # llama.cpp multiplies Q4_K weights with activations rounded to Q8_K (8 bits per 256 values), which moves
    # these logits by ~1.3% RMS (measured; Q4_0 on this model: 0.9%); a wrong scale packing, nibble order or
    # dmin moves them ~100%.
    assert relative_rms(got, want) < 0.02
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.95


def test_llama_cpp_tokenizes_like_transformers(quantized_tiny, tmp_path):
    model, tokenizer = quantized_tiny(bits=4, group_size=32, symmetric=True)
    write_gguf(model, tokenizer, tmp_path / "m.gguf")
    for text in TEXTS:
        assert llama_cpp_tokens(tmp_path / "m.gguf", text) == tokenizer(text).input_ids


def dequantized_copy(model):
    """``model`` with each QuantizedLinear replaced by nn.Linear holding its weight with float16 scales
    (what the GGUF file holds), so llama.cpp can run the same weights in float32."""
    from torch import nn

    from lmpress.export.formats import quantized_layers

    for name, module in quantized_layers(model).items():
        qw = module.unpack()
        qw.scales = qw.scales.half().float()
        dense = nn.Linear(module.in_features, module.out_features, bias=False)
        dense.weight.data = qw.dequantize()
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, dense)
    return model


@pytest.mark.long
@pytest.mark.integration
def test_smollm2_q4_0_in_llama_cpp(smollm2_dir, tmp_path):
    from lmpress.loader import load_model
    from lmpress.quantize.rtn import RTNConfig, run_rtn
    from lmpress.registry import StageContext

    loaded = load_model(str(smollm2_dir), fingerprint=False)
    model, tokenizer = loaded.model, loaded.tokenizer
    ctx = StageContext(calibration=lambda: None, state_dir=tmp_path / "s", resume=False, fingerprint="x")
    run_rtn(model, RTNConfig(bits=4, group_size=32, symmetric=True), ctx)
    write_gguf(model, tokenizer, tmp_path / "q4_0.gguf")
    for text in TEXTS:
        assert llama_cpp_tokens(tmp_path / "q4_0.gguf", text) == tokenizer(text).input_ids
    ids = tokenizer("The capital of France is Paris. The capital of Germany is").input_ids
    q4_0 = llama_cpp_logits(tmp_path / "q4_0.gguf", ids)

    dense = dequantized_copy(model)
    write_gguf(dense, tokenizer, tmp_path / "f32.gguf")
    f32 = llama_cpp_logits(tmp_path / "f32.gguf", ids)
    # The Q4_0 file's weights, in float32: llama.cpp gives lmpress's logits (measured 1.5e-6 RMS).
    assert relative_rms(f32, lmpress_logits(dense, ids)) < 1e-5
    # The Q4_0 file itself: llama.cpp rounds activations to Q8_0 for its Q4_0 dot products, which over
    # 30 layers moves SmolLM2's logits by 4.2% RMS (measured); a wrong block layout moves them ~100%.
    assert relative_rms(q4_0, f32) < 0.1
    assert q4_0[-1].argmax() == f32[-1].argmax()
