"""Each family's quirks, checked one at a time against transformers (the matrix in test_architectures.py runs
the whole path; these name the quirk that breaks)."""

from __future__ import annotations

import pytest
import torch
import yaml

from lmpress.anatomy import get_anatomy
from lmpress.calib.engine import CalibrationMethod, run_calibration
from lmpress.quantize.awq_search import can_fold, fold_scales
from lmpress.registry import StageContext
from lmpress.runtime.model import Transformer
from tests.conftest import _train_tokenizer
from tests.families import save_family_model


@pytest.fixture(scope="module")
def tokenizer():
    return _train_tokenizer()


def family_model(family: str, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    path = save_family_model(tmp_path / family, family, tokenizer)
    return AutoModelForCausalLM.from_pretrained(path).eval()


def ids(batch: int = 2, length: int = 40, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 300, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("family", "folded"), [("phi3", 4), ("gemma2", 3), ("gemma3_text", 3), ("llama", 3)])
def test_scaling_pairs_fold_without_changing_the_function(family, folded, tokenizer, tmp_path):
    """AWQ's and SmoothQuant's folding: Gemma's (1 + weight) norms keep their offset, Phi-3's fused qkv_proj and
    gate_up_proj absorb the scales in the rows that feed o_proj (v) and down_proj (up) only."""
    model = family_model(family, tokenizer, tmp_path)
    anatomy = get_anatomy(model)
    x = ids()
    with torch.no_grad():
        want = model(x).logits
    gen = torch.Generator().manual_seed(3)
    n = 0
    for layer in model.model.layers:
        for prev, names in anatomy.scaling_pairs:
            source, linears = layer.get_submodule(prev), [layer.get_submodule(n) for n in names]
            rows = anatomy.rows_feeding(prev)
            if can_fold(source, linears, rows):
                s = torch.rand(linears[0].in_features, generator=gen) * 3 + 0.25
                fold_scales(source, linears, s, anatomy.norm_offset, rows)
                n += 1
    assert n == folded * len(model.model.layers)  # GQA: v_proj -> o_proj widths differ, that pair is skipped
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, want, rtol=1e-4, atol=1e-4)


def relative_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).pow(2).mean() / want.float().pow(2).mean()).sqrt().item()


class Record(CalibrationMethod):
    """Keeps each layer's outputs as the engine computes them."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: dict[int, list[torch.Tensor]] = {}

    def on_output(self, session, batch, inputs, outputs) -> None:
        self.outputs.setdefault(session.index, []).append(outputs.float())


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "mistral"])
def test_engine_gives_each_layer_type_its_own_mask_and_rope(family, tokenizer, tmp_path):
    """Sliding-window and global layers get different masks (and, in Gemma 3, rotary tables): the layer-wise
    engine's layer outputs must be the model's own (the sliding window, 8, is shorter than the samples, 32)."""
    model = family_model(family, tokenizer, tmp_path)
    if family == "mistral":  # mistral's layers are all sliding: one kind, the engine's old path
        assert getattr(model.config, "layer_types", None) is None or len(set(model.config.layer_types)) == 1
    calibration = ids(4, 32, seed=5)
    with torch.no_grad():
        hidden = model(calibration, output_hidden_states=True).hidden_states
    method = Record()
    ctx = StageContext(calibration=lambda: calibration, state_dir=tmp_path / "state", resume=False, fingerprint="x")
    run_calibration(model, [method], lambda name: None, ctx, batch_size=2)
    got = torch.cat(method.outputs[0])  # layer 0's output is layer 1's input, the global layer's
    # The engine keeps activations in float16 between layers: a relative RMS of ~1e-4; a wrong mask gives ~1e-1.
    assert relative_rms(got, hidden[1]) < 2e-3
    last = torch.cat(method.outputs[len(model.model.layers) - 1])
    with torch.no_grad():
        final = model.model.norm(last)
    assert relative_rms(final, hidden[-1]) < 2e-3


@pytest.mark.parametrize("family", ["phi3", "gemma2", "gemma3_text", "mixtral", "qwen2_moe", "qwen3_moe"])
def test_runtime_logits_are_transformers(family, tokenizer, tmp_path):
    """Float weights: prefill and token-by-token decode against transformers' logits, for each quirk at once
    (Gemma: scaled embeddings, (1 + w) norms, sandwich norms, GeGLU, soft-capping, sliding layers, two ropes;
    MoE: routing, renormalized top-k weights, Qwen2-MoE's gated shared expert). Both the copied model and the
    view sharing the model's own layers (what the evals decode with)."""
    model = family_model(family, tokenizer, tmp_path)
    x = ids()
    with torch.no_grad():
        want = model(x).logits
        for runtime in (Transformer.from_hf(model), Transformer.sharing(model)):
            torch.testing.assert_close(runtime(x, runtime.new_cache(2, 64)), want, rtol=1e-4, atol=1e-4)
            cache = runtime.new_cache(2, 64)
            steps = [runtime(x[:, :20], cache)] + [runtime(x[:, i : i + 1], cache) for i in range(20, 40)]
            torch.testing.assert_close(torch.cat(steps, 1), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["phi3", "gemma2", "gemma3_text"])
def test_runtime_reads_checkpoints_directly(family, tokenizer, tmp_path):
    """The runtime's own checkpoint reader (no transformers model) finds Phi-3's fused linears and Gemma's
    sandwich norms."""
    from transformers import AutoModelForCausalLM

    from lmpress.runtime.checkpoint import load_checkpoint

    path = save_family_model(tmp_path / family, family, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    x = ids()
    with torch.no_grad():
        runtime = load_checkpoint(path)
        torch.testing.assert_close(runtime(x, runtime.new_cache(2, 64)), model(x).logits, rtol=1e-4, atol=1e-4)


def run_recipe(path, tmp_path, capsys, formats: list[str]) -> tuple[int, str, object]:
    from lmpress.cli import main

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "model": {"source": str(path)},
                "data": {"samples": 2, "seq_len": 32},
                "stages": [{"method": "gptq", "bits": 4, "group_size": 32}],
                "export": {"formats": formats},
                "eval": {"text": "builtin:python-docs", "perplexity": {"seq_len": 64, "windows": 2}},
            }
        )
    )
    out = tmp_path / "out"
    capsys.readouterr()
    code = main(["run", str(recipe), "--out", str(out), "--quiet"])
    return code, capsys.readouterr().err.strip(), out


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_a_format_and_the_runtime_refuse_mla_and_gpt_oss_in_one_line_before_work(family, tokenizer, tmp_path, capsys):
    """DeepSeek's latent attention and gpt-oss's sinks are calibrated and exported, but neither the ONNX writer nor
    the runtime computes them: each says so in one line, exit code 2, before any weight is quantized."""
    from lmpress.cli import main

    path = save_family_model(tmp_path / family, family, tokenizer)
    code, err, out = run_recipe(path, tmp_path, capsys, ["compressed-tensors", "onnx"])
    assert code == 2
    assert len(err.splitlines()) == 1 and f"architecture {family!r} is not written by" in err, err
    assert not out.exists() or not any(out.iterdir())
    code = main(["generate", str(path), "--prompt", "hello", "--max-new-tokens", "2", "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and f"the runtime does not support model type {family!r}" in err, err


def test_the_runtime_refuses_to_read_moe_checkpoints_directly(tokenizer, tmp_path):
    from lmpress.errors import LmpressInputError
    from lmpress.runtime.checkpoint import load_checkpoint

    path = save_family_model(tmp_path / "qwen3_moe", "qwen3_moe", tokenizer)
    with pytest.raises(LmpressInputError, match="qwen3_moe .* through transformers"):
        load_checkpoint(path)
