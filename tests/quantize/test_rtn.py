import pytest
import torch

from lmpress.errors import LmpressInputError
from lmpress.loader import load_model
from lmpress.quantize.rtn import RTNConfig, run_rtn
from lmpress.registry import StageContext
from lmpress.weights.scheme import QuantScheme, quantize_weight_rtn


def context(tmp_path) -> StageContext:
    return StageContext(calibration=lambda: None, state_dir=tmp_path, resume=False, fingerprint="x")


def test_rtn_stage_quantizes_every_target_except_ignored(tiny_llama_dir, tmp_path):
    model = load_model(str(tiny_llama_dir)).model
    originals = {n: m.weight.detach().clone() for n, m in model.named_modules() if hasattr(m, "in_features")}
    config = RTNConfig(bits=4, group_size=32, overrides={r".*down_proj": {"bits": 8}})
    summary = run_rtn(model, config, context(tmp_path))
    assert summary["quantized_layers"] == 14  # 2 layers x 7 linears; lm_head ignored
    for name, w in originals.items():
        now = model.get_submodule(name)
        weight = now.dequantized_weight() if hasattr(now, "dequantized_weight") else now.weight
        if name == "lm_head":
            assert weight.equal(w)
            continue
        bits = 8 if name.endswith("down_proj") else 4
        expected = quantize_weight_rtn(w, QuantScheme(bits, 32, True)).dequantize()
        assert weight.detach().float().equal(expected), name


def test_group_size_that_does_not_divide_names_layers_and_working_sizes(tmp_path):
    from tests.conftest import save_tiny_model

    path = save_tiny_model(
        tmp_path / "m", hidden_size=96, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2
    )
    model = load_model(str(path)).model
    with pytest.raises(
        LmpressInputError, match=r"group_size 64 does not divide .* group sizes that fit them: \[-1, 32\]"
    ):
        run_rtn(model, RTNConfig(bits=4, group_size=64), context(tmp_path))


def test_rtn_mse_searches_integer_ranges_like_gptq_does():
    """``mse: true`` on an integer grid: each group's range from the search GPTQ's ``mse`` runs; never worse."""
    from lmpress.quantize.mse_scales import search_qparams_mse
    from lmpress.quantize.rtn import quantize_weight

    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(0))
    w[:, ::29] *= 6  # outliers that min/max ranges spend their levels on
    scheme = QuantScheme(4, 32, True)
    searched, plain = quantize_weight(w, scheme, mse=True), quantize_weight(w, scheme, mse=False)
    scale, _ = search_qparams_mse(w.reshape(16, 4, 32), scheme)
    assert torch.equal(searched.scales, scale)
    assert torch.equal(plain.qweight, quantize_weight_rtn(w, scheme).qweight)
    assert (searched.dequantize() - w).pow(2).sum() < (plain.dequantize() - w).pow(2).sum()
