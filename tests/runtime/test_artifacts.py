"""The runtime loads every export lmpress writes into packed kernels, with the same logits as the in-memory model."""

from __future__ import annotations

import pytest
import torch

import lmpress
from lmpress.runtime.kernels.cpu import kernel_name
from lmpress.runtime.model import Transformer
from lmpress.runtime.text import load_runtime
from tests.runtime.test_model import sqnr_db


def _writer(fmt: str):
    from lmpress.export.awq import export_awq
    from lmpress.export.compressed_tensors import export_compressed_tensors
    from lmpress.export.gptq import export_gptq
    from lmpress.export.hf import export_hf

    return {"gptq": export_gptq, "awq": export_awq, "compressed-tensors": export_compressed_tensors, "hf": export_hf}[
        fmt
    ]


@pytest.mark.parametrize(
    ("fmt", "symmetric", "kernel"),
    [("gptq", True, "int4"), ("awq", False, "int4"), ("compressed-tensors", False, "int4"), ("hf", True, "dense")],
)
def test_every_export_loads_into_the_runtimes_kernels(tiny_llama_dir, tmp_path, fmt, symmetric, kernel):
    loaded = lmpress.load_model(str(tiny_llama_dir))
    lmpress.quantize_model(loaded.model, method="rtn", bits=4, group_size=32, symmetric=symmetric)
    expected_model = Transformer.from_hf(loaded.model)
    _writer(fmt)(loaded.model, loaded.tokenizer, tmp_path / fmt)
    model, tokenizer = load_runtime(str(tmp_path / fmt))
    assert kernel_name(model.layers[0].feed_forward.w2.parts[0]) == kernel
    assert tokenizer.get_vocab() == loaded.tokenizer.get_vocab()
    ids = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = expected_model(ids, expected_model.new_cache(1, 24))
        actual = model(ids, model.new_cache(1, 24))
    # The formats store scales in float16 (u = 2**-11, SQNR ~69 dB per weight); the packed kernels also
    # round activations to bf16 (u = 2**-8, ~50 dB), the same in both models: the logits agree far above that.
    assert sqnr_db(expected, actual) > 45
