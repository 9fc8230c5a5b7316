"""GGUF writer: blocks checked against the gguf package's own dequantize, read-back, refusals."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from lmpress.errors import LmpressInputError
from lmpress.export.formats import check_recipe_exports, load_quantized_model, quantized_layers
from lmpress.export.ggml_blocks import pack_q4_k
from lmpress.export.gguf import (
    FILE_NAME,
    gguf_scheme_refusal,
    gguf_tensor_name,
    q4_k_weight,
    rope_row_order,
    write_gguf,
)
from lmpress.export.verify import compare_weights
from lmpress.loader import load_model
from lmpress.quantize.gptq import GPTQConfig
from lmpress.weights.kquant import kquant_grid
from lmpress.weights.qlinear import QuantizedLinear
from lmpress.weights.scheme import QuantScheme
from tests.export.test_ggml_blocks import random_q4_k


def gguf_tensors(path) -> dict[str, tuple[np.ndarray, str]]:
    """Each tensor dequantized by the gguf package (rows in GGUF order) and its type name."""
    reader = gguf.GGUFReader(str(path))
    out = {}
    for t in reader.tensors:
        values = dequantize(np.asarray(t.data), t.tensor_type)
        out[t.name] = (values.reshape([int(s) for s in reversed(t.shape)]), t.tensor_type.name)
    return out


def expected_rows(model, name: str, weight: torch.Tensor) -> torch.Tensor:
    """``weight`` with its rows in the order llama.cpp's converter writes q/k projections."""
    config = model.config
    if name.endswith("q_proj"):
        return weight[rope_row_order(weight.shape[0], config.num_attention_heads)]
    if name.endswith("k_proj"):
        return weight[rope_row_order(weight.shape[0], config.num_key_value_heads)]
    return weight


@pytest.mark.parametrize(("bits", "kind"), [(4, "Q4_0"), (8, "Q8_0")])
def test_quantized_layers_dequantize_bit_for_bit_with_gguf(quantized_tiny, export, bits, kind):
    model, tokenizer = quantized_tiny(bits=bits, group_size=32, symmetric=True)
    out = export("gguf", model, tokenizer)
    stored = gguf_tensors(out / FILE_NAME)
    layers = quantized_layers(model)
    assert layers
    for name, module in layers.items():
        qw = module.unpack()
        qw.scales = qw.scales.half().float()  # GGUF stores d as float16: the candidate's scales rounded once
        want = expected_rows(model, name, qw.dequantize(torch.float32)).numpy()
        values, stored_kind = stored[f"{gguf_tensor_name(name)}.weight"]
        assert stored_kind == kind
        assert values.dtype == np.float32 and np.array_equal(values, want), name
    values, stored_kind = stored["token_embd.weight"]
    assert stored_kind == "F32" and np.array_equal(values, model.model.embed_tokens.weight.detach().numpy())
    assert "output.weight" not in stored  # tied: llama.cpp reads token_embd
    norm, _ = stored["blk.1.ffn_norm.weight"]
    assert np.array_equal(norm, model.model.layers[1].post_attention_layernorm.weight.detach().numpy())


def test_gguf_metadata_and_vocabulary(quantized_tiny, export):
    model, tokenizer = quantized_tiny(bits=4, group_size=32, symmetric=True)
    out = export("gguf", model, tokenizer)
    reader = gguf.GGUFReader(str(out / FILE_NAME))
    field = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    config = model.config
    assert field["general.architecture"] == "llama"
    assert field["llama.block_count"] == config.num_hidden_layers
    assert field["llama.attention.head_count_kv"] == config.num_key_value_heads
    assert field["llama.rope.dimension_count"] == config.head_dim
    assert field["tokenizer.ggml.model"] == "gpt2" and field["tokenizer.ggml.pre"] == "gpt-2"
    vocab = tokenizer.get_vocab()
    assert [field["tokenizer.ggml.tokens"][i] for i in sorted(vocab.values())] == sorted(vocab, key=vocab.get)
    assert field["tokenizer.ggml.bos_token_id"] == tokenizer.bos_token_id
    assert field["tokenizer.ggml.token_type"][tokenizer.eos_token_id] == 3  # control
    assert len(field["tokenizer.ggml.merges"]) > 0 and " " in field["tokenizer.ggml.merges"][0]
    assert field["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_Q4_0)


@pytest.mark.parametrize("group", [32, 64, -1])
@pytest.mark.parametrize("bits", [4, 8])
def test_gguf_reads_back_as_the_candidate(quantized_tiny, export, bits, group):
    """Groups of 64 or a whole row land on 32-column blocks, their scale written to each."""
    model, tokenizer = quantized_tiny(bits=bits, group_size=group, symmetric=True)
    out = export("gguf", model, tokenizer)
    artifact = load_model(str(out), fingerprint=False)
    mismatch, change, how = compare_weights(model, artifact.model)
    assert mismatch is None, mismatch
    assert how == "quantized, scales as float16"
    ids = tokenizer("def f(x): return x", return_tensors="pt").input_ids
    with torch.no_grad():
        a = artifact.model(ids).logits
        b = model(ids).logits
    assert torch.allclose(a, b, atol=1e-3, rtol=0)  # float16 scales are the only difference


def test_dense_model_writes_f16(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    path = tmp_path / "m.gguf"
    write_gguf(model, tokenizer, path, float_dtype=torch.float16)
    stored = gguf_tensors(path)
    values, kind = stored["blk.0.ffn_up.weight"]
    assert kind == "F16"
    assert np.array_equal(values, model.model.layers[0].mlp.up_proj.weight.detach().half().numpy())
    q, _ = stored["blk.0.attn_q.weight"]
    want = expected_rows(model, "q_proj", model.model.layers[0].self_attn.q_proj.weight.detach().half())
    assert np.array_equal(q, want.numpy())
    assert stored["blk.0.attn_norm.weight"][1] == "F32"


@pytest.mark.parametrize(
    ("scheme", "act_order", "fragment"),
    [
        (QuantScheme(4, 16, True), False, "group_size 16 does not land on GGUF's 32-column blocks: use group_size: 32"),
        (QuantScheme(4, 48, True), False, "use group_size: 32 or a multiple of it"),
        (QuantScheme(4, 32, False), False, "use symmetric: true"),
        (QuantScheme(3, 32, True), False, "3-bit weights have no exact GGUF block type"),
        (QuantScheme(4, 32, True), True, "set static_groups: true"),
    ],
)
def test_schemes_gguf_cannot_hold_are_refused(scheme, act_order, fragment):
    assert fragment in gguf_scheme_refusal(scheme, act_order)


def test_gguf_holds_w4_and_w8_g32_sym():
    assert gguf_scheme_refusal(QuantScheme(4, 32, True), False) is None
    assert gguf_scheme_refusal(QuantScheme(4, 32, True, k_quant_scales=True), False) is None
    assert gguf_scheme_refusal(QuantScheme(8, 32, True), False) is None
    for group in (64, 128, -1):  # each group's scale repeated over its 32-column blocks
        assert gguf_scheme_refusal(QuantScheme(4, group, True), False) is None
        assert gguf_scheme_refusal(QuantScheme(8, group, True), False) is None
    assert "W4 sym, groups of a multiple of 32 -> Q4_0, or Q4_K with k_quant_scales: true" in gguf_scheme_refusal(
        QuantScheme(4, 16, True), False
    )


def test_recipe_with_act_order_is_refused_before_loading():
    stage = GPTQConfig(method="gptq", bits=4, group_size=32, act_order=True)
    with pytest.raises(LmpressInputError, match=r"export.formats\[0\] gguf: stages\[0\].*static_groups: true"):
        check_recipe_exports([stage], ["gguf"])
    check_recipe_exports(
        [GPTQConfig(method="gptq", bits=4, group_size=32, act_order=True, static_groups=True)], ["gguf"]
    )


def test_unsupported_architecture_is_refused(tiny_opt_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_opt_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_opt_dir)
    with pytest.raises(LmpressInputError, match="architecture 'opt' is not written by lmpress's GGUF writer"):
        write_gguf(model, tokenizer, tmp_path / "m.gguf")


# Q4_K --------------------------------------------------------------------------------------------


def test_kquant_layers_are_q4_k_and_dequantize_bit_for_bit_with_gguf(quantized_wide, export):
    model, tokenizer = quantized_wide(bits=4, group_size=32, symmetric=True, k_quant_scales=True)
    out = export("gguf", model, tokenizer)
    reader = gguf.GGUFReader(str(out / FILE_NAME))
    assert reader.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_Q4_K_S)
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    stored = gguf_tensors(out / FILE_NAME)
    layers = quantized_layers(model)
    assert len(layers) == 14
    for name, module in layers.items():
        qw = module.unpack()
        assert torch.equal(qw.scales.half().float(), qw.scales)  # k-quant scales are float16 already: no rounding
        want = expected_rows(model, name, qw.dequantize(torch.float32)).numpy()
        target = f"{gguf_tensor_name(name)}.weight"
        values, kind = stored[target]
        assert kind == "Q4_K", name
        assert np.array_equal(values, want), name
        assert sizes[target] == module.out_features * module.in_features // 256 * 144


def test_q4_k_only_where_the_scales_are_on_the_grid(quantized_tiny, quantized_wide, export):
    """The tiny Llama's 128-column layers take Q4_0, down_proj (256 columns) Q4_K; without the key, all Q4_0."""
    narrow = ".*(gate_proj|k_proj|o_proj|q_proj|up_proj|v_proj)"
    model, tokenizer = quantized_tiny(
        bits=4, group_size=32, k_quant_scales=True, overrides={narrow: {"k_quant_scales": False}}
    )
    out = export("gguf", model, tokenizer)
    stored = gguf_tensors(out / FILE_NAME)
    for name, module in quantized_layers(model).items():
        values, kind = stored[f"{gguf_tensor_name(name)}.weight"]
        assert kind == ("Q4_K" if name.endswith("down_proj") else "Q4_0"), name
        qw = module.unpack()
        qw.scales = qw.scales.half().float()
        assert np.array_equal(values, expected_rows(model, name, qw.dequantize()).numpy()), name
    reader = gguf.GGUFReader(str(out / FILE_NAME))
    assert reader.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_Q4_0)

    model, tokenizer = quantized_wide(bits=4, group_size=32)
    kinds = {kind for _, kind in gguf_tensors(export("gguf", model, tokenizer) / FILE_NAME).values()}
    assert kinds == {"Q4_0", "F32"}


def test_q4_k_reads_back_as_the_candidate(quantized_wide, export):
    model, tokenizer = quantized_wide(bits=4, group_size=32, k_quant_scales=True)
    out = export("gguf", model, tokenizer)
    artifact = load_model(str(out), fingerprint=False)
    mismatch, change, how = compare_weights(model, artifact.model)
    assert mismatch is None, mismatch
    assert change == 0 and how == "quantized, scales as float16"
    layer = artifact.model.get_submodule("model.layers.0.mlp.down_proj")
    assert isinstance(layer, QuantizedLinear) and layer.scheme == QuantScheme(4, 32, True, k_quant_scales=True)
    ids = tokenizer("def f(x): return x", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(artifact.model(ids).logits, model(ids).logits)


def test_gptq_checkpoint_with_kquant_scales_becomes_q4_k(quantized_wide, export):
    """A GPTQ checkpoint carries no k-quant flag: the GGUF writer finds the grid in its float16 scales."""
    model, tokenizer = quantized_wide(bits=4, group_size=32, k_quant_scales=True)
    loaded = load_quantized_model(export("gptq", model, tokenizer))
    layer = loaded.get_submodule("model.layers.1.self_attn.o_proj")
    assert not layer.scheme.k_quant_scales
    stored = gguf_tensors(export("gguf", loaded, tokenizer) / FILE_NAME)
    values, kind = stored["blk.1.attn_output.weight"]
    assert kind == "Q4_K"
    assert np.array_equal(values, layer.unpack().dequantize().numpy())


def test_kquant_scales_moved_off_the_grid_are_refused(quantized_wide, export):
    model, tokenizer = quantized_wide(bits=4, group_size=32, k_quant_scales=True)
    layer = model.get_submodule("model.layers.0.mlp.up_proj")
    half = layer.scales[0, 0].half()
    layer.scales[0, 0] = (half.view(torch.int16) + 1).view(torch.float16).float()  # one float16 step up
    assert kquant_grid(layer.scales.half()) is None
    with pytest.raises(
        LmpressInputError,
        match=r"export gguf: model.layers.0.mlp.up_proj was quantized with k_quant_scales but its float16 scales "
        r"are not d \* \(integer 0..63\) per 256 columns .*quantize with k_quant_scales: true",
    ):
        export("gguf", model, tokenizer)


def test_q4_k_reader_takes_mins_of_eight_scales_only():
    codes, d, _, sc, _ = random_q4_k(3, 512, seed=1)
    sc = sc // 2  # m = 2 sc must fit 6 bits
    symmetric = q4_k_weight(pack_q4_k(codes, d, d * 4, sc, sc * 2), 512, "t")  # dmin m = 4d 2sc = 8 d sc
    assert torch.equal(symmetric.scales.float(), (d.float()[..., None] * sc.float()).reshape(3, 16))
    assert torch.all(symmetric.zeros == 8) and torch.equal(symmetric.qweight, codes)
    with pytest.raises(LmpressInputError, match="t is Q4_K with minimums that are not 8 x its scales"):
        q4_k_weight(pack_q4_k(codes, d, d * 4, sc, sc), 512, "t")
