"""What every quantized-checkpoint writer and reader shares: determinism and clear errors."""

import json

import pytest

from lmpress.errors import LmpressInputError
from lmpress.export.formats import load_quantized_checkpoint


@pytest.mark.parametrize("fmt", ["gptq", "awq", "compressed-tensors", "hf"])
def test_writing_twice_gives_identical_files(quantized_tiny, export, fmt):
    model, tokenizer = quantized_tiny(bits=4, group_size=32, symmetric=False)
    first, second = export(fmt, model, tokenizer), export(fmt, model, tokenizer)
    files = sorted(p.name for p in first.iterdir())
    assert files == sorted(p.name for p in second.iterdir())
    for name in files:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_reader_refuses_dense_and_unknown_checkpoints(quantized_tiny, export):
    model, tokenizer = quantized_tiny(bits=4, group_size=32)
    dense = export("hf", model, tokenizer)
    with pytest.raises(LmpressInputError, match="no quantization_config"):
        load_quantized_checkpoint(dense)
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes"}
    (dense / "config.json").write_text(json.dumps(config))
    with pytest.raises(LmpressInputError, match="'bitsandbytes' is not one lmpress reads"):
        load_quantized_checkpoint(dense)
    (dense / "config.json").write_text("{broken")
    with pytest.raises(LmpressInputError, match="not valid JSON"):
        load_quantized_checkpoint(dense)


def test_export_plans_are_checked_before_any_quantization(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    from lmpress.export.formats import check_export_plan, quantized_layers
    from lmpress.quantize.rtn import RTNConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    eight_bit = RTNConfig(bits=8, group_size=32).targets(model)
    with pytest.raises(LmpressInputError, match="AWQ GEMM holds 4-bit weights only"):
        check_export_plan("awq", model, eight_bit)
    mixed_groups = RTNConfig(bits=4, group_size=32, overrides={".*down_proj": {"group_size": 64}}).targets(model)
    with pytest.raises(LmpressInputError, match="one group size per model"):
        check_export_plan("awq", model, mixed_groups)
    for fmt in ("gptq", "compressed-tensors", "hf"):
        check_export_plan(fmt, model, eight_bit)
    check_export_plan("awq", model, RTNConfig(bits=4, group_size=64).targets(model))
    assert not quantized_layers(model)  # checking a plan changes nothing
