"""bitsandbytes stages: LLM.int8 and NF4/FP4 on bitsandbytes itself, saved so transformers reloads them."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lmpress.errors import LmpressInputError
from lmpress.loader import load_model
from lmpress.quantize.bnb import BnB4bitConfig, LLMInt8Config, bnb_layers, run_bnb
from lmpress.quantize.rtn import RTNConfig, run_rtn
from lmpress.registry import StageContext, exporter
from lmpress.weights.int8_linear import sqnr_db


@pytest.fixture(autouse=True)
def _needs_bitsandbytes() -> None:
    # imported per test, not at collection: bitsandbytes imports triton, which must see the TRITON_INTERPRET
    # that tests/runtime/test_triton_kernels.py sets when it is collected
    pytest.importorskip("bitsandbytes")


IDS = torch.tensor([[1, 7, 42, 99, 3, 250, 17, 5]])


def ctx(tmp_path) -> StageContext:
    return StageContext(calibration=lambda: None, state_dir=tmp_path, resume=False, fingerprint="x")


@pytest.mark.parametrize(
    ("config", "kind", "min_sqnr"),
    [
        (LLMInt8Config(threshold=6.0), "Linear8bitLt", 25),
        (BnB4bitConfig(quant_type="nf4", double_quant=True), "Linear4bit", 8),
        (BnB4bitConfig(quant_type="fp4", double_quant=False), "Linear4bit", 6),
    ],
)
def test_stage_saves_what_transformers_reloads(tiny_llama_dir, tmp_path, config, kind, min_sqnr):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    with torch.no_grad():
        reference = model(IDS).logits
    summary = run_bnb(model, config, ctx(tmp_path / "s"))
    layers = bnb_layers(model)
    assert summary["quantized_layers"] == 14 and len(layers) == 14
    assert {type(m).__name__ for m in layers.values()} == {kind}
    weight = model.model.layers[0].mlp.down_proj.weight
    assert weight.dtype == (torch.int8 if kind == "Linear8bitLt" else torch.uint8)  # really quantized
    with torch.no_grad():
        logits = model(IDS).logits
    assert min_sqnr < sqnr_db(reference, logits) < 60
    out = tmp_path / "out"
    out.mkdir()
    exporter("bitsandbytes")(model, tokenizer, out)  # after a forward: what the pipeline does
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "bitsandbytes"
    if kind == "Linear4bit":
        assert qc["bnb_4bit_quant_type"] == config.quant_type
        assert qc["bnb_4bit_use_double_quant"] is config.double_quant
    else:
        assert qc["load_in_8bit"] and qc["llm_int8_threshold"] == 6.0
    state = {k: v for k, v in model.state_dict().items() if ".layers." in k}
    reloaded = AutoModelForCausalLM.from_pretrained(out, device_map="cpu")  # transformers' bitsandbytes integration
    via_lmpress = load_model(str(out)).model  # what `lmpress eval` loads
    for back in (reloaded, via_lmpress):
        assert {type(m).__name__ for m in bnb_layers(back).values()} == {kind}
        assert set(bnb_layers(back)) == set(layers)
        back_state = back.state_dict()
        for key, value in state.items():
            assert torch.equal(back_state[key], value), key
    with torch.no_grad():
        assert torch.equal(via_lmpress(IDS).logits, logits)


def test_layers_bitsandbytes_cannot_wrap_are_refused(tiny_llama_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    run_rtn(model, RTNConfig(bits=4, group_size=32), ctx(tmp_path / "a"))
    with pytest.raises(LmpressInputError, match="bitsandbytes cannot wrap 14 layer"):
        run_bnb(model, BnB4bitConfig(), ctx(tmp_path / "b"))


def test_export_without_bitsandbytes_layers_is_refused(tiny_llama_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    with pytest.raises(LmpressInputError, match="no bitsandbytes layers"):
        exporter("bitsandbytes")(model, None, tmp_path)
