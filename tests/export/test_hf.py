"""The dense "hf" export of a model with QuantizedLinear layers."""

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lmpress.export.formats import quantized_layers

IDS = torch.tensor([[1, 7, 42, 99, 3, 250]])


def test_quantized_layers_are_written_as_their_dense_weights(quantized_tiny, export):
    model, tokenizer = quantized_tiny(bits=4, group_size=32, symmetric=False)
    out = export("hf", model, tokenizer)
    tensors = load_file(out / "model.safetensors")
    assert not any(k.endswith((".qweight", ".scales", ".zeros")) for k in tensors)
    for name, module in quantized_layers(model).items():
        assert torch.equal(tensors[f"{name}.weight"], module.dequantized_weight()), name
    loaded = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, loaded(IDS).logits)


def test_a_quantized_lm_head_is_written_untied(quantized_tiny, export):
    model, tokenizer = quantized_tiny(bits=4, group_size=32, ignore=[])
    assert model.config.tie_word_embeddings
    out = export("hf", model, tokenizer)
    assert model.config.tie_word_embeddings  # the in-memory model is left as it was
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert not loaded.config.tie_word_embeddings
    assert torch.equal(loaded.lm_head.weight, model.lm_head.dequantized_weight())
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, loaded(IDS).logits)
