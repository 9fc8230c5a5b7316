"""The rotate stage: the rotated model is the same function, its weights have fewer outliers, and what it cannot
rotate is refused before any weight is touched."""

import copy
import json
from pathlib import Path

import pytest
import torch
import yaml

from lmpress.errors import LmpressInputError
from lmpress.quantize.rotate import RotateConfig, run_rotate
from lmpress.quantize.rtn import RTNConfig, run_rtn
from lmpress.recipe import parse_recipe
from lmpress.registry import StageContext, stage_config, stage_handler_for
from lmpress.weights.hadamard import hadamard_matrix
from lmpress.weights.scheme import quantize_weight_rtn

VOCAB = 300
# hidden 96 = 8 x 12 (Paley I), head_dim 24 = 2 x 12: not only powers of two
SHAPE = dict(hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
READERS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def context(tmp_path: Path) -> StageContext:
    return StageContext(calibration=lambda: None, state_dir=tmp_path, resume=False, fingerprint="x")


def tiny_model(config_class: str, dtype=torch.float32, seed: int = 0, **settings):
    """A tiny random model built from its config, every norm scale and bias random (a fold that drops one, or a
    bias rotated the wrong way, changes the logits)."""
    import transformers
    from transformers import AutoModelForCausalLM

    config = getattr(transformers, config_class)(vocab_size=VOCAB, max_position_embeddings=64, **{**SHAPE, **settings})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=dtype))
    return model


def exact_norms(model, monkeypatch) -> None:
    """transformers' RMSNorm computes in float32 whatever the model's dtype: in a float64 model that rounding
    (1e-7) would hide the rotation's own error; this computes it in the input's dtype."""

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for cls in {type(m) for m in model.modules() if type(m).__name__.endswith("RMSNorm")}:
        monkeypatch.setattr(cls, "forward", forward)


def logits(model, seed: int = 1) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


CASES = {
    "llama-tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    "llama-untied-biases": ("LlamaConfig", {"tie_word_embeddings": False, "attention_bias": True, "mlp_bias": True}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False}),  # q/k/v biases
    "qwen3-tied": ("Qwen3Config", {"tie_word_embeddings": True, "head_dim": 32}),  # q_norm / k_norm per head
    "mistral": ("MistralConfig", {"tie_word_embeddings": False, "sliding_window": 8}),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rotated_model_computes_the_same_logits(case, dtype, tmp_path, monkeypatch):
    config_class, settings = CASES[case]
    model = tiny_model(config_class, dtype, **settings)
    if dtype == torch.float64:
        exact_norms(model, monkeypatch)
    before = logits(model)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    info = run_rotate(model, RotateConfig(seed=3), context(tmp_path))
    after = logits(model)
    relative = ((after - before).abs().max() / before.abs().max()).item()
    assert relative < (1e-12 if dtype == torch.float64 else 1e-5), relative
    # the weights did change: every linear's, the embedding's, and every norm scale is now 1
    changed = [n for n, p in model.named_parameters() if n in weights and not torch.equal(p, weights[n])]
    assert "model.embed_tokens.weight" in changed and "model.layers.1.mlp.down_proj.weight" in changed
    assert all(torch.equal(p, torch.ones_like(p)) for n, p in model.named_parameters() if "layernorm" in n)
    tied = settings["tie_word_embeddings"]
    assert info == {
        "rotated_layers": 2,
        "hidden_hadamard": 96,
        "head_hadamard": settings.get("head_dim", 24),
        "random": True,
        "seed": 3,
        "untied_head": tied,
        "down_proj_hadamard_block": None,
        "input_hadamard_block": None,
    }
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert model.config.tie_word_embeddings is False


def test_plain_hadamard_without_heads_is_the_same_function_too(tmp_path, monkeypatch):
    model = tiny_model("LlamaConfig", torch.float64, tie_word_embeddings=False)
    exact_norms(model, monkeypatch)
    before = logits(model)
    layer = model.model.layers[0]
    scale, v_proj = layer.input_layernorm.weight.detach().clone(), layer.self_attn.v_proj.weight.detach().clone()
    info = run_rotate(model, RotateConfig(random=False, rotate_heads=False), context(tmp_path))
    assert info["head_hadamard"] is None and info["seed"] is None and not info["untied_head"]
    assert ((logits(model) - before).abs().max() / before.abs().max()).item() < 1e-12
    # without R2, v_proj's output rows are not mixed: W_v -> W_v diag(s) H (the norm folded, the plain Hadamard)
    expected = (v_proj * scale) @ hadamard_matrix(96)
    assert torch.allclose(layer.self_attn.v_proj.weight, expected, rtol=0, atol=1e-12)


def test_a_tied_head_stays_tied_when_the_final_norm_is_already_one(tmp_path):
    model = tiny_model("LlamaConfig", tie_word_embeddings=True)
    with torch.no_grad():
        model.model.norm.weight.fill_(1.0)
    before = logits(model)
    info = run_rotate(model, RotateConfig(), context(tmp_path))
    assert not info["untied_head"]
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.config.tie_word_embeddings
    assert torch.allclose(logits(model), before, atol=1e-4 * before.abs().max().item())


def test_an_untied_rotated_model_saves_and_loads_as_the_same_function(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model("LlamaConfig", tie_word_embeddings=True)
    run_rotate(model, RotateConfig(), context(tmp_path))
    model.save_pretrained(tmp_path / "m")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert loaded.lm_head.weight is not loaded.model.embed_tokens.weight
    assert torch.equal(logits(loaded), logits(model))


def outlier_model(seed: int = 0):
    """A tiny Llama whose linears that read the residual stream have three outlier input channels (x20)."""
    model = tiny_model("LlamaConfig", seed=seed, tie_word_embeddings=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight") and any(r in name for r in READERS):
                p[:, [5, 40, 77]] *= 20
    return model


def peak_to_rms(w: torch.Tensor) -> float:
    return (w.abs().max() / w.pow(2).mean().sqrt()).item()


def test_rotation_spreads_outlier_channels(tmp_path):
    model = outlier_model()
    linears = {n: m for n, m in model.named_modules() if n.endswith(READERS)}
    before = {n: peak_to_rms(m.weight) for n, m in linears.items()}
    run_rotate(model, RotateConfig(), context(tmp_path))
    after = {n: peak_to_rms(m.weight) for n, m in linears.items()}
    assert all(after[n] < before[n] / 2 for n in linears), (before, after)


def test_rotate_then_rtn_w4_loses_less_than_rtn_alone_on_outlier_channels(tmp_path):
    model = outlier_model()
    base = logits(model)
    rtn = RTNConfig(bits=4, group_size=32)

    def weight_error(m) -> float:
        """Relative squared error of RTN W4 over every quantized linear (the same in the rotated basis: Q is
        orthogonal)."""
        err = total = 0.0
        for linear, scheme in rtn.targets(m).values():
            w = linear.weight.detach()
            err += (w - quantize_weight_rtn(w, scheme).dequantize()).pow(2).sum().item()
            total += w.pow(2).sum().item()
        return err / total

    plain, rotated = copy.deepcopy(model), copy.deepcopy(model)
    plain_weight_error = weight_error(plain)
    run_rtn(plain, rtn, context(tmp_path))
    run_rotate(rotated, RotateConfig(), context(tmp_path))
    rotated_weight_error = weight_error(rotated)
    run_rtn(rotated, rtn, context(tmp_path))

    def logit_error(m) -> float:
        return ((logits(m) - base).pow(2).mean() / base.pow(2).mean()).item()

    # measured: weight error 0.030 -> 0.0054, logit error 0.094 -> 0.026
    assert rotated_weight_error < plain_weight_error / 2, (plain_weight_error, rotated_weight_error)
    assert logit_error(rotated) < logit_error(plain) / 2, (logit_error(plain), logit_error(rotated))


def meta_model(config_class: str, **settings):
    """A model skeleton on the meta device, as the pipeline's plan checks see it."""
    import transformers
    from transformers import AutoModelForCausalLM

    config = getattr(transformers, config_class)(vocab_size=VOCAB, max_position_embeddings=64, **{**SHAPE, **settings})
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_check_passes_on_a_skeleton():
    RotateConfig().check(meta_model("LlamaConfig"))
    RotateConfig().check(meta_model("Qwen2Config"))


def test_a_hidden_size_without_a_hadamard_order_is_refused_before_any_weight_changes(tmp_path):
    with pytest.raises(LmpressInputError, match=r"hidden_size 100 of 'llama': no Hadamard matrix of order 100"):
        RotateConfig().check(meta_model("LlamaConfig", hidden_size=100, num_attention_heads=5, num_key_value_heads=5))
    model = tiny_model("LlamaConfig", hidden_size=100, num_attention_heads=5, num_key_value_heads=5)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(LmpressInputError, match="nearest orders that work are 96 and 104") as error:
        run_rotate(model, RotateConfig(), context(tmp_path))
    assert "\n" not in str(error.value)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_a_head_dim_without_a_hadamard_order_is_refused_unless_heads_are_left(tmp_path):
    skeleton = meta_model("LlamaConfig", hidden_size=80, num_attention_heads=8, num_key_value_heads=4)  # head_dim 10
    with pytest.raises(LmpressInputError, match=r"head_dim 10 .*; or set rotate_heads: false"):
        RotateConfig().check(skeleton)
    RotateConfig(rotate_heads=False).check(skeleton)


@pytest.mark.parametrize(
    ("config_class", "settings", "message"),
    [
        ("OPTConfig", {"ffn_dim": 192, "word_embed_proj_dim": 96}, "'opt' models cannot be rotated: its LayerNorm"),
        ("Gemma2Config", {"head_dim": 24}, "'gemma2' models cannot be rotated: its sandwich norms"),
        ("MixtralConfig", {"num_local_experts": 4}, "'mixtral' models cannot be rotated: mixture-of-experts"),
    ],
)
def test_families_the_algebra_does_not_hold_for_are_refused(config_class, settings, message):
    with pytest.raises(LmpressInputError, match=message):
        RotateConfig().check(meta_model(config_class, **settings))


def test_an_already_quantized_model_is_refused(tmp_path):
    model = tiny_model("LlamaConfig")
    run_rtn(model, RTNConfig(bits=4, group_size=32), context(tmp_path))
    with pytest.raises(LmpressInputError, match="q_proj is a QuantizedLinear, not a float nn.Linear"):
        run_rotate(model, RotateConfig(), context(tmp_path))


def test_config_keys_and_stage_order_in_a_recipe():
    stages = parse_recipe({"model": "x", "stages": [{"method": "rotate", "seed": 7}, {"method": "rtn"}]}).stages
    assert isinstance(stages[0], stage_config("rotate")) and stages[0].seed == 7 and stages[0].random
    assert stage_handler_for(stages[0]) is run_rotate
    with pytest.raises(LmpressInputError, match=r"stages\[0\]\.sed: unknown key"):
        parse_recipe({"model": "x", "stages": [{"method": "rotate", "sed": 1}]})
    with pytest.raises(
        LmpressInputError, match=r"recipe: stages\[2\]: rotate comes after stages\[1\] \(gptq\), which quantizes"
    ):
        parse_recipe({"model": "x", "stages": [{"method": "structured"}, {"method": "gptq"}, {"method": "rotate"}]})
    with pytest.raises(LmpressInputError, match=r"stages\[1\]: rotate comes after stages\[0\] \(wanda\)"):
        parse_recipe({"model": "x", "stages": [{"method": "wanda"}, {"method": "rotate"}]})


@pytest.mark.usefixtures("private_cache")
def test_rotate_then_rtn_through_a_recipe_run(tmp_path):
    """SmolLM2's layout (tied head, final norm scale not 1) through the CLI: the untied head is exported, read
    back and run in lmpress's runtime."""
    from transformers import AutoModelForCausalLM

    from lmpress.cli import main
    from tests.conftest import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    model.save_pretrained(model_dir)
    recipe = {
        "model": str(model_dir),
        "data": {"source": "builtin:python-docs", "samples": 4, "seq_len": 64},
        "stages": [{"method": "rotate"}, {"method": "rtn", "bits": 8, "group_size": 32}],
        "eval": {"text": "builtin:python-docs", "perplexity": {"seq_len": 128, "windows": 2, "batch_size": 2}},
        "gates": ["ppl_ratio <= 1.01"],
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = tmp_path / "run"
    assert main(["run", str(path), "--out", str(out), "--quiet"]) == 0
    report = json.loads((out / "report.json").read_text())
    summary = report["stages"][0]["summary"]
    assert summary["rotated_layers"] == 2 and summary["hidden_hadamard"] == 128 and summary["untied_head"]
    assert report["export_checks"][0]["passed"] and report["runtime_agreement"]["passed"]
    exported = AutoModelForCausalLM.from_pretrained(out / "hf")
    assert exported.config.tie_word_embeddings is False
    assert exported.lm_head.weight.data_ptr() != exported.model.embed_tokens.weight.data_ptr()
