"""The ``k_quant_scales`` recipe key: which schemes, methods and layers take it, and the errors that say what works."""

from __future__ import annotations

import pytest

from lmpress.errors import LmpressInputError
from lmpress.loader import load_model
from lmpress.quantize.gptq import GPTQConfig
from lmpress.quantize.rtn import RTNConfig, run_rtn
from lmpress.registry import StageContext
from lmpress.weights.kquant import kquant_grid
from lmpress.weights.qlinear import QuantizedLinear
from lmpress.weights.scheme import QuantScheme
from tests.test_recipe import error_of


def recipe_error(stage: dict) -> str:
    return error_of({"model": "m", "stages": [stage], "eval": {"perplexity": {"windows": 1}}})


def test_kquant_scales_reach_the_scheme_of_every_layer_but_overridden_ones():
    config = RTNConfig(bits=4, group_size=32, k_quant_scales=True, overrides={".*q_proj": {"k_quant_scales": False}})
    assert config.scheme_for("model.layers.0.mlp.up_proj") == QuantScheme(4, 32, True, k_quant_scales=True)
    assert config.scheme_for("model.layers.0.self_attn.q_proj") == QuantScheme(4, 32, True)
    assert [s.k_quant_scales for _, s in config.planned_schemes()] == [True, False]


@pytest.mark.parametrize(
    ("stage", "fragment"),
    [
        (
            {"method": "rtn", "bits": 8, "group_size": 32, "k_quant_scales": True},
            "stages[0]: k_quant_scales (Q4_K's 6-bit group scales per 256 columns) need bits: 4, group_size: 32, "
            "symmetric: true; got bits: 8, group_size: 32, symmetric: true",
        ),
        ({"method": "gptq", "group_size": 128, "k_quant_scales": True}, "need bits: 4, group_size: 32"),
        ({"method": "awq", "group_size": 32, "symmetric": False, "k_quant_scales": True}, "symmetric: true; got"),
        (
            {"method": "rtn", "group_size": 32, "k_quant_scales": True, "overrides": {".*down_proj": {"bits": 8}}},
            "stages[0]: overrides['.*down_proj']: k_quant_scales (Q4_K's 6-bit group scales per 256 columns) "
            "need bits: 4",
        ),
        (
            {"method": "gptq", "group_size": 32, "k_quant_scales": True, "act_order": True},
            "stages[0]: k_quant_scales with act_order: true needs static_groups: true",
        ),
        (
            {"method": "awq", "group_size": 32, "rounding": "gptq", "act_order": True, "k_quant_scales": True},
            "needs static_groups: true",
        ),
        ({"method": "learned", "group_size": 32, "k_quant_scales": True}, "use method rtn, gptq or awq"),
        ({"method": "smoothquant", "k_quant_scales": True}, "need bits: 4, group_size: 32"),
    ],
)
def test_kquant_scales_with_a_scheme_that_cannot_take_them_is_a_recipe_error(stage, fragment):
    assert fragment in recipe_error(stage)


def test_kquant_scales_with_act_order_and_static_groups_is_accepted():
    GPTQConfig(group_size=32, k_quant_scales=True, act_order=True, static_groups=True)
    GPTQConfig(group_size=32, act_order=True, overrides={".*down_proj": {"k_quant_scales": False}})


def test_layers_narrower_than_a_super_block_are_refused_with_an_override_that_works(tiny_llama_dir, tmp_path):
    """The tiny Llama: hidden size 128 (q/k/v/o/gate/up read 128 columns), down_proj reads 256."""
    model = load_model(str(tiny_llama_dir)).model
    ctx = StageContext(calibration=lambda: None, state_dir=tmp_path, resume=False, fingerprint="x")
    with pytest.raises(LmpressInputError) as info:
        run_rtn(model, RTNConfig(bits=4, group_size=32, k_quant_scales=True), ctx)
    message = str(info.value)
    assert message.startswith(
        "stage rtn: k_quant_scales needs in_features divisible by 256 (Q4_K's super-blocks); 12 layer(s) are not, "
        "e.g. model.layers.0.self_attn.q_proj (128): set k_quant_scales: false for them in an override, e.g. "
        "overrides: {'.*(gate_proj|k_proj|o_proj|q_proj|up_proj|v_proj)': {k_quant_scales: false}}"
    )
    pattern = message.split("overrides: {'")[1].split("'")[0]
    run_rtn(
        model,
        RTNConfig(bits=4, group_size=32, k_quant_scales=True, overrides={pattern: {"k_quant_scales": False}}),
        ctx,
    )
    down = model.get_submodule("model.layers.1.mlp.down_proj")
    assert isinstance(down, QuantizedLinear) and down.scheme.k_quant_scales
    assert kquant_grid(down.scales.half()) is not None
    assert not model.get_submodule("model.layers.1.mlp.up_proj").scheme.k_quant_scales
