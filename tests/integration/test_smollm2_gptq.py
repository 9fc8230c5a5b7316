"""GPTQ on the real SmolLM2-135M, small calibration: it must beat RTN on held-out text.

The full protocol (128 x 512 calibration, 20 windows) is bench/quant_table.py.
"""

import pytest

from lmpress.data import calibration_samples, load_text, token_windows, tokenize
from lmpress.evals.perplexity import PerplexityConfig, perplexity
from lmpress.loader import load_model
from lmpress.quantize.gptq import GPTQConfig, run_gptq
from lmpress.quantize.rtn import RTNConfig, run_rtn
from lmpress.registry import StageContext

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_gptq_w4_beats_rtn_on_smollm2(smollm2_dir, tmp_path):
    tokenizer = load_model(str(smollm2_dir)).tokenizer
    calibration = calibration_samples(tokenize(tokenizer, load_text("builtin:wikitext2:valid")), 16, 512, seed=0)
    windows = token_windows(tokenize(tokenizer, load_text("builtin:wikitext2:test")), 2048, 2)
    config = PerplexityConfig(seq_len=2048, windows=2, batch_size=1)
    ppl = {}
    for name, run, stage in [
        ("rtn", run_rtn, RTNConfig(bits=4, group_size=64)),
        ("gptq", run_gptq, GPTQConfig(bits=4, group_size=64, act_order=True, mse=True)),
    ]:
        model = load_model(str(smollm2_dir)).model
        ctx = StageContext(calibration=lambda: calibration, state_dir=tmp_path / name, resume=False, fingerprint=name)
        summary = run(model, stage, ctx)
        ppl[name] = perplexity(model, windows, config)["ppl"]
        if name == "gptq":
            assert summary["quantized_linears"] == 30 * 7
            assert summary["warnings"] == []
    assert ppl["gptq"] < ppl["rtn"] - 1.0, ppl
