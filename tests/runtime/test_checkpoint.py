"""The runtime reads a checkpoint directory itself (memory-mapped, no transformers model) with transformers' logits."""

from __future__ import annotations

import mmap

import pytest
import torch

import lmpress
from lmpress.checkpoint_files import MappedSafetensors
from lmpress.errors import LmpressInputError
from lmpress.runtime.checkpoint import load_checkpoint
from lmpress.runtime.model import Transformer
from tests.runtime.conftest import FAMILIES, tiny_hf_model


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_logits_equal_the_transformers_model(tmp_path, family):
    hf = tiny_hf_model(family, seed=3)
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(ids).logits
        actual = model(ids, model.new_cache(2, 17))
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
    # the same module tree as the runtime built from the transformers model, tensor for tensor
    built = Transformer.from_hf(hf)
    for (name, mine), (_, theirs) in zip(model.state_dict().items(), built.state_dict().items(), strict=True):
        assert torch.equal(mine, theirs), name


def test_embedding_table_is_a_view_of_the_file(tmp_path):
    tiny_hf_model("mistral", seed=1).save_pretrained(tmp_path)  # untied head
    model = load_checkpoint(tmp_path)
    embedding = model.tok_embeddings.weight
    assert embedding.untyped_storage().nbytes() == embedding.numel() * 4  # a view of the file, not a copy
    assert model.output.weight.data_ptr() != embedding.data_ptr()


@pytest.mark.parametrize("fmt", ["gptq", "awq", "compressed-tensors"])
def test_quantized_exports_read_directly_equal_the_in_memory_model(tiny_llama_dir, tmp_path, fmt):
    from tests.runtime.test_artifacts import _writer

    loaded = lmpress.load_model(str(tiny_llama_dir))
    lmpress.quantize_model(loaded.model, method="rtn", bits=4, group_size=32, symmetric=fmt != "awq")
    _writer(fmt)(loaded.model, loaded.tokenizer, tmp_path / fmt)
    via_transformers = Transformer.from_hf(lmpress.load_model(str(tmp_path / fmt)).model)
    direct = load_checkpoint(tmp_path / fmt)
    for (name, mine), (_, theirs) in zip(
        direct.state_dict().items(), via_transformers.state_dict().items(), strict=True
    ):
        assert torch.equal(mine, theirs), name


def test_release_drops_the_pages_read(tmp_path):
    from safetensors.torch import save_file

    save_file(
        {"a.w": torch.ones(4 * mmap.PAGESIZE), "b.w": torch.full((4 * mmap.PAGESIZE,), 2.0)}, tmp_path / "m.safetensors"
    )
    files = MappedSafetensors([tmp_path / "m.safetensors"])
    a, b = files.tensor("a.w"), files.tensor("b.w")
    assert float(a.sum()) == 4 * mmap.PAGESIZE and float(b.sum()) == 8 * mmap.PAGESIZE
    a.add_(1)  # a private mapping: written pages are the process's own, the file is untouched
    files.release("a.")
    assert float(b.sum()) == 8 * mmap.PAGESIZE  # b's pages kept
    # a's whole pages were dropped and read again from the file (the write is gone), its partial edge pages kept
    assert float(a.sum()) < 2 * 4 * mmap.PAGESIZE


def test_damaged_checkpoints_are_one_line_errors(tmp_path):
    tiny_hf_model("llama").save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(LmpressInputError, match="past the end of the file"):
        load_checkpoint(tmp_path)
    weights.write_bytes(b"\x10\x00")
    with pytest.raises(LmpressInputError, match="not a readable safetensors file"):
        load_checkpoint(tmp_path)
    other = tmp_path / "other"
    tiny_hf_model("llama").save_pretrained(other)
    from safetensors.torch import load_file, save_file

    tensors = load_file(other / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, other / "model.safetensors")
    with pytest.raises(LmpressInputError, match="lacks tensor 'model.layers.1.mlp.down_proj.weight'"):
        load_checkpoint(other)


@pytest.mark.parametrize(
    ("fmt", "quantize"),
    [
        ("gguf", {"bits": 4, "group_size": 32}),  # Q4_0 / Q4_K
        ("gguf", {"bits": 8, "group_size": 32}),  # Q8_0
        ("gguf", {"fp4": "mxfp4"}),  # MXFP4
        ("onnx", {"bits": 4, "group_size": 32}),  # MatMulNBits
        ("onnx", {"bits": 4, "group_size": 32, "symmetric": False}),  # with zero points
    ],
)
def test_a_single_file_export_loads_into_the_runtime_without_a_transformers_model(
    tiny_llama_dir, tmp_path, fmt, quantize, monkeypatch
):
    """The runtime builds a GGUF or ONNX export's model from the tensors its reader decodes (5.4 and 4.7 s of
    SmolLM2's loads went to gguf-py's reader, onnx's session and a transformers model): the same weights, to the
    bit, as through the transformers model lmpress's evals load."""
    import transformers

    from lmpress.registry import export_format
    from lmpress.runtime.text import load_runtime

    loaded = lmpress.load_model(str(tiny_llama_dir))
    lmpress.quantize_model(loaded.model, method="rtn", **quantize)
    export_format(fmt).write(loaded.model, loaded.tokenizer, tmp_path / fmt)
    via_transformers = Transformer.from_hf(export_format(fmt).load_artifact(tmp_path / fmt, torch.float32))
    monkeypatch.setattr(
        transformers.AutoModelForCausalLM, "from_config", lambda *_, **__: pytest.fail("a transformers model was built")
    )
    direct, tokenizer = load_runtime(str(tmp_path / fmt))
    assert tokenizer.get_vocab() == loaded.tokenizer.get_vocab()
    for (name, mine), (_, theirs) in zip(
        direct.state_dict().items(), via_transformers.state_dict().items(), strict=True
    ):
        assert torch.equal(mine, theirs), name


@pytest.mark.parametrize(("group", "kernel"), [(32, "int8-simulated"), (64, "cpu-w4a8")])
def test_a_w4a8_export_runs_as_its_per_token_simulation_scores_it(tiny_llama_dir, tmp_path, group, kernel):
    """A W4A8 layer runs lmpress's int4 x int8 kernel with its activations quantized per token where the kernel
    holds its groups (multiples of 64 columns), else its weight dequantized once (``int8-simulated``) and its
    activations fake-quantized per token at each call; either way as ``QuantizedLinear`` scores it (dequantizing at
    each call: 4 tok/s on SmolLM2): the same logits, to float rounding."""
    from lmpress.runtime.kernels import cpu_int

    if kernel == "cpu-w4a8" and not cpu_int.available():
        pytest.skip("the C++ kernels do not build on this host")
    from lmpress.export.compressed_tensors import export_compressed_tensors
    from lmpress.runtime.kernels import kernel_of
    from tests.runtime.test_model import sqnr_db

    loaded = lmpress.load_model(str(tiny_llama_dir))
    lmpress.quantize_model(loaded.model, method="rtn", bits=4, group_size=group, activations="int8")
    export_compressed_tensors(loaded.model, loaded.tokenizer, tmp_path / "ct")
    runtime = load_checkpoint(tmp_path / "ct")
    assert {kernel_of(m) for m in runtime.layers.modules() if hasattr(m, "KERNEL")} == {kernel}
    reference = Transformer.from_hf(loaded.model, kernels="reference")
    ids = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids, reference.new_cache(1, 24))
        actual = runtime(ids, runtime.new_cache(1, 24))
    assert sqnr_db(expected, actual) > 80
