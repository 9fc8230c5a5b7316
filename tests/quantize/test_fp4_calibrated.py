"""FP4 (NVFP4, MXFP4) through the calibrated methods: GPTQ over the E2M1 grid, NVFP4 W4A4's calibrated
activation scale, AWQ's searches on the FP4 grid, mixed FP4 / integer overrides, and resume."""

from __future__ import annotations

import pydantic
import pytest
import torch

from lmpress.anatomy import decoder_layers
from lmpress.calib.hooks import first_input
from lmpress.calib.session import LayerSession
from lmpress.calib.statistics import HessianAccumulator
from lmpress.data import calibration_samples, load_text, tokenize
from lmpress.loader import load_model
from lmpress.quantize.awq import AWQConfig, run_awq
from lmpress.quantize.awq_search import apply_clip, fake_quantize_weight, search_clip
from lmpress.quantize.fp4_rounding import e2m1_rounder, neighbours, offsets_towards, round_between_neighbours
from lmpress.quantize.gptq import GPTQConfig, run_gptq
from lmpress.quantize.gptq_quantize import gptq_quantize_layer, layer_output_error
from lmpress.quantize.learned_rounding import LearnedRoundingConfig, run_learned
from lmpress.quantize.learned_rounding_quantize import (
    Rounding,
    _fp4_learned,
    freeze,
    init_rounding,
    learned_fake_quantize,
)
from lmpress.quantize.rtn import RTNConfig, run_rtn
from lmpress.registry import StageContext
from lmpress.weights import fp4 as fp4_module
from lmpress.weights.fp4 import (
    E2M1_VALUES,
    FP4_BLOCK,
    Fp4Linear,
    Fp4Weight,
    fake_quantize_e2m1,
    nvfp4_global_scale,
    quantize_weight_fp4,
    round_to_e2m1,
    round_to_e4m3,
)
from lmpress.weights.qlinear import QuantizedLinear
from lmpress.weights.scheme import QuantScheme
from tests.conftest import save_tiny_model

FORMATS = ["nvfp4", "mxfp4"]
FP8_MAX, E2M1_MAX = 448.0, 6.0


def scheme(fmt: str, activations: str | None = None) -> QuantScheme:
    return QuantScheme(4, FP4_BLOCK[fmt], True, activations, fp4=fmt)


def correlated_inputs(tokens: int = 1024, cols: int = 256, seed: int = 0) -> torch.Tensor:
    """Activations like an LLM's: correlated channels with a few large ones."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(cols, cols, generator=g) / cols**0.5 + torch.eye(cols)
    x = torch.randn(tokens, cols, generator=g) @ mix
    x[:, :4] *= 10
    return x


@pytest.fixture(scope="module")
def layer():
    x = correlated_inputs()
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    acc = HessianAccumulator(256)
    acc.add(x)
    return w, x, acc.H


def assert_on_the_grid(q: Fp4Weight, fmt: str) -> None:
    assert q.codes.dtype == torch.uint8 and int(q.codes.max()) <= 15
    assert not (q.codes == 8).any()  # -0 is never written
    if fmt == "nvfp4":
        assert torch.equal(q.scales, round_to_e4m3(q.scales)) and (q.scales > 0).all()
    else:
        assert q.global_scale is None
        assert torch.equal(torch.exp2(torch.log2(q.scales).round()), q.scales)


# GPTQ over the E2M1 grid ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "options", [{}, {"mse": True}, {"act_order": True, "static_groups": True}], ids=["minmax", "mse", "act-order"]
)
def test_gptq_fp4_output_error_is_below_rtn_fp4(layer, fmt, options):
    w, x, H = layer
    quantized, info = gptq_quantize_layer(w, H, scheme(fmt), **options)
    assert isinstance(quantized, Fp4Weight) and quantized.scheme == scheme(fmt)
    assert_on_the_grid(quantized, fmt)
    if fmt == "nvfp4":  # fixed up front from the original weight
        assert torch.equal(quantized.global_scale, nvfp4_global_scale(w))
    rtn = quantize_weight_fp4(w, scheme(fmt), mse=options.get("mse", False))
    gptq_error = layer_output_error(w, quantized.dequantize(), x)
    rtn_error = layer_output_error(w, rtn.dequantize(), x)
    assert gptq_error < 0.7 * rtn_error, (gptq_error, rtn_error)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mse", [False, True])
def test_gptq_fp4_with_an_identity_hessian_is_rtn_fp4(fmt, mse):
    """No cross-column updates: every block's scale comes from the original weights and every column rounds to
    nearest, so GPTQ gives RTN's codes and scales exactly (block_size 48 splits blocks across lazy batches)."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(24, 128, generator=g) * torch.rand(24, 1, generator=g)
    w[:, 7] *= 9
    quantized, _ = gptq_quantize_layer(w, torch.eye(128), scheme(fmt), block_size=48, mse=mse)
    rtn = quantize_weight_fp4(w, scheme(fmt), mse=mse)
    assert torch.equal(quantized.codes, rtn.codes)
    assert torch.equal(quantized.scales, rtn.scales)
    assert (quantized.global_scale is None) == (rtn.global_scale is None)
    if rtn.global_scale is not None:
        assert torch.equal(quantized.global_scale, rtn.global_scale)


def test_the_column_loops_e2m1_rounding_is_round_to_e2m1s():
    values = torch.tensor(E2M1_VALUES)
    midpoints = (values[1:] + values[:-1]) / 2  # the ties
    x = torch.cat([torch.linspace(-8, 8, 20001), values, -values, midpoints, -midpoints])
    x = torch.cat([x, torch.nextafter(x, torch.full_like(x, 9)), torch.nextafter(x, torch.full_like(x, -9))])
    rounded = x.clone()
    e2m1_rounder("cpu")(rounded)
    assert torch.equal(rounded, fake_quantize_e2m1(x))
    assert torch.equal(round_to_e2m1(rounded), round_to_e2m1(x))


def test_gptq_fp4_by_hand():
    """One row, one NVFP4 block, identity Hessian: the codes worked out by hand."""
    w = torch.tensor([[6.0, 3.0, -1.4, 0.2, 0.3, -0.74, 0.76, 5.2] + [0.0] * 8])
    quantized, _ = gptq_quantize_layer(w, torch.eye(16), scheme("nvfp4"))
    # global scale 448 * 6 / 6 = 448: the block scale is E4M3(6 / 6 * 448) = 448, the effective scale 1
    assert quantized.global_scale.item() == 448.0 and quantized.scales.tolist() == [[448.0]]
    # 6 -> 6 (7), 3 -> 3 (5), -1.4 -> -1.5 (8 | 3), 0.2 -> 0 (0), 0.3 -> 0.5 (1), -0.74 -> -0.5 (8 | 1),
    # 0.76 -> 1 (2), 5.2 -> 6 (7)
    assert quantized.codes[0, :8].tolist() == [7, 5, 11, 0, 1, 9, 2, 7]
    assert quantized.codes[0, 8:].tolist() == [0] * 8


def test_gptq_fp4_static_groups_take_rtn_block_scales(layer):
    w, _, H = layer
    quantized, _ = gptq_quantize_layer(w, H, scheme("nvfp4"), act_order=True, static_groups=True, mse=True)
    assert torch.equal(quantized.scales, quantize_weight_fp4(w, scheme("nvfp4"), mse=True).scales)


def test_gptq_fp4_refuses_act_order_without_static_groups(layer):
    w, _, H = layer
    with pytest.raises(ValueError, match="act_order needs static_groups"):
        gptq_quantize_layer(w, H, scheme("mxfp4"), act_order=True)
    with pytest.raises(pydantic.ValidationError, match="needs static_groups: true"):
        GPTQConfig(fp4="nvfp4", act_order=True)
    with pytest.raises(pydantic.ValidationError, match="needs static_groups: true"):
        AWQConfig(bits=4, group_size=32, rounding="gptq", act_order=True, overrides={".*down_proj": {"fp4": "mxfp4"}})
    assert GPTQConfig(fp4="nvfp4", act_order=True, static_groups=True).act_order


def test_gptq_fp4_keeps_pruned_entries_at_zero(layer):
    w, _, H = layer
    pruned = torch.rand(w.shape, generator=torch.Generator().manual_seed(4)) < 0.5
    quantized, _ = gptq_quantize_layer(w, H, scheme("nvfp4"), pruned=pruned)
    assert (quantized.codes[pruned] == 0).all() and (quantized.dequantize()[pruned] == 0).all()


# On a tiny model -----------------------------------------------------------------------------------


def calibration_for(tokenizer, n: int = 8, seq_len: int = 32) -> torch.Tensor:
    return calibration_samples(tokenize(tokenizer, load_text("builtin:python-docs")), n, seq_len, seed=0)


def context(tmp_path, calibration, resume: bool = False) -> StageContext:
    return StageContext(calibration=lambda: calibration, state_dir=tmp_path / "state", resume=resume, fingerprint="fp4")


def recording_calibration_inputs(monkeypatch) -> dict[str, float]:
    """max |x| of the inputs the engine hands each watched linear (by full name) in the last calibration pass that
    watched it (an AWQ search pass before it saw the layer before its scales were folded)."""
    amax: dict[str, float] = {}
    forward = LayerSession.forward

    def recording(session, watch, on_input, *args, **kwargs):
        seen: dict[str, float] = {}

        def record(name, batch, call_args, call_kwargs):
            key = session.prefix + name
            seen[key] = max(seen.get(key, 0.0), first_input(call_args, call_kwargs).abs().max().item())
            on_input(name, batch, call_args, call_kwargs)

        forward(session, watch, record, *args, **kwargs)
        amax.update(seen)

    monkeypatch.setattr(LayerSession, "forward", recording)
    return amax


def test_gptq_nvfp4_w4a4_layers_carry_the_calibrated_input_scale(tiny_llama_dir, tmp_path, monkeypatch):
    loaded = load_model(str(tiny_llama_dir))
    calibration = calibration_for(loaded.tokenizer)
    config = GPTQConfig(fp4="nvfp4", activations="fp4", overrides={".*o_proj": {"fp4": "mxfp4"}})
    amax = recording_calibration_inputs(monkeypatch)
    summary = run_gptq(loaded.model, config, context(tmp_path, calibration))
    layers = {n: m for n, m in loaded.model.named_modules() if isinstance(m, Fp4Linear)}
    assert summary["quantized_linears"] == len(layers) == 14
    for name, module in layers.items():
        if name.endswith("o_proj"):  # MXFP4 activations scale per block at run time
            assert module.fmt == "mxfp4" and module.input_global_scale is None, name
            continue
        want = torch.tensor([FP8_MAX * E2M1_MAX / amax[name]])
        torch.testing.assert_close(module.input_global_scale, want, rtol=1e-6, atol=0, msg=name)
    # independently for layer 0's q/k/v: input_layernorm of the embeddings, as the engine holds them (float16)
    model = loaded.model
    layer = decoder_layers(model)[0]
    with torch.no_grad():
        x = layer.input_layernorm(model.model.embed_tokens(calibration).half().float())
    for name in ("q_proj", "k_proj", "v_proj"):
        got = getattr(layer.self_attn, name).input_global_scale
        torch.testing.assert_close(got, torch.tensor([FP8_MAX * E2M1_MAX / x.abs().max().item()]), rtol=1e-6, atol=0)
    # the layers' inputs differ in range (the test can tell them apart), and the model runs as W4A4
    assert len({module.input_global_scale.item() for module in layers.values() if module.fmt == "nvfp4"}) > 3
    reference = load_model(str(tiny_llama_dir)).model
    with torch.no_grad():
        got, want = loaded.model(calibration[:2]).logits, reference(calibration[:2]).logits
    assert torch.isfinite(got).all() and (got - want).pow(2).mean() < 0.1 * want.var()


def test_gptq_mixes_fp4_and_integer_layers_by_override(tiny_llama_dir, tmp_path):
    loaded = load_model(str(tiny_llama_dir))
    calibration = calibration_for(loaded.tokenizer)
    config = GPTQConfig(
        fp4="nvfp4",
        activations="fp4",
        overrides={".*down_proj": {"fp4": "int", "bits": 8, "group_size": 32}, ".*(gate|up)_proj": {"fp4": "mxfp4"}},
    )
    run_gptq(loaded.model, config, context(tmp_path, calibration))
    for name, module in loaded.model.named_modules():
        if name.endswith("down_proj"):
            assert isinstance(module, QuantizedLinear) and module.scheme == QuantScheme(8, 32, True), name
        elif name.endswith(("gate_proj", "up_proj")):
            assert isinstance(module, Fp4Linear) and module.scheme == scheme("mxfp4", "fp4"), name
        elif name.endswith("_proj"):
            assert isinstance(module, Fp4Linear) and module.scheme == scheme("nvfp4", "fp4"), name
            assert module.input_global_scale is not None
    # and the other way round: an integer stage with FP4 layers
    loaded = load_model(str(tiny_llama_dir))
    config = GPTQConfig(bits=4, group_size=32, overrides={".*(q|k|v)_proj": {"fp4": "nvfp4"}})
    run_gptq(loaded.model, config, context(tmp_path / "int", calibration))
    kinds = {n.rpartition(".")[2]: type(m).__name__ for n, m in loaded.model.named_modules() if n.endswith("_proj")}
    assert kinds == {
        "q_proj": "Fp4Linear", "k_proj": "Fp4Linear", "v_proj": "Fp4Linear", "o_proj": "QuantizedLinear",
        "gate_proj": "QuantizedLinear", "up_proj": "QuantizedLinear", "down_proj": "QuantizedLinear",
    }  # fmt: skip


@pytest.fixture(scope="module")
def deep_llama_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("deep-llama-fp4"), "llama", num_hidden_layers=4)


def comparable(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor


@pytest.mark.long
@pytest.mark.parametrize(
    "settings",
    [
        {"fp4": "nvfp4", "activations": "fp4", "overrides": {".*down_proj": {"fp4": "int", "group_size": 32}}},
        {"fp4": "mxfp4", "mse": True, "act_order": True, "static_groups": True},
    ],
    ids=["nvfp4-w4a4-mixed", "mxfp4"],
)
def test_resume_restores_fp4_layers_bit_identically(deep_llama_dir, tmp_path, settings):
    calibration = calibration_for(load_model(str(deep_llama_dir)).tokenizer)
    reference = load_model(str(deep_llama_dir)).model
    run_gptq(reference, GPTQConfig(**settings), context(tmp_path / "ref", calibration))

    crashing = load_model(str(deep_llama_dir)).model

    def crash(*_):
        raise RuntimeError("killed")

    decoder_layers(crashing)[2].register_forward_pre_hook(crash)
    with pytest.raises(RuntimeError, match="killed"):
        run_gptq(crashing, GPTQConfig(**settings), context(tmp_path, calibration))

    resumed = load_model(str(deep_llama_dir)).model
    summary = run_gptq(resumed, GPTQConfig(**settings), context(tmp_path, calibration, resume=True))
    assert summary["resumed_at_layer"] == 2
    want, got = reference.state_dict(), resumed.state_dict()
    assert want.keys() == got.keys()
    assert any(k.endswith("weight_global_scale") for k in want) == (settings["fp4"] == "nvfp4")
    assert any(k.endswith("input_global_scale") for k in want) == ("activations" in settings)
    for key in want:
        assert want[key].dtype == got[key].dtype and torch.equal(comparable(want[key]), comparable(got[key])), key
    schemes = {name: m.scheme for name, m in resumed.named_modules() if hasattr(m, "scheme")}
    assert schemes == {name: m.scheme for name, m in reference.named_modules() if hasattr(m, "scheme")}
    with torch.no_grad():
        torch.testing.assert_close(resumed(calibration[:2]).logits, reference(calibration[:2]).logits, rtol=0, atol=0)


# AWQ on the FP4 grid --------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_awq_scale_search_quantizes_on_the_fp4_grid(fmt):
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(5)) * torch.linspace(0.01, 1, 128)
    assert torch.equal(fake_quantize_weight(w, scheme(fmt)), quantize_weight_fp4(w, scheme(fmt)).dequantize())


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp4_clip_search_never_loses_to_no_clipping(fmt):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g)
    w[:, 3] *= 6
    x = torch.randn(256, 64, generator=g)
    shrink = search_clip(w, x, scheme(fmt))
    linear = torch.nn.Linear(64, 48, bias=False)
    linear.weight.data = w.clone()
    apply_clip(linear, shrink, scheme(fmt))
    # NVFP4's global scale follows the clipped weight in RTN; keep the unclipped one, as the search did
    clipped = quantize_weight_fp4(linear.weight.data, scheme(fmt))
    if fmt == "nvfp4":
        gs = nvfp4_global_scale(w)
        blocks = linear.weight.data.reshape(48, 4, 16)
        scales = fp4_module.fp4_block_scales(blocks, fmt, gs)
        codes = fp4_module.round_to_e2m1((blocks / (scales / gs)[..., None]).clamp(-6, 6)).reshape(48, 64)
        clipped = Fp4Weight(codes, scales, scheme(fmt), gs)
    plain = quantize_weight_fp4(w, scheme(fmt))
    err = lambda q: ((x @ (w - q.dequantize()).T) ** 2).mean().item()  # noqa: E731
    assert (shrink < 1).any()
    assert err(clipped) < err(plain)


def kl_to_float(model_dir, model, calibration) -> float:
    reference = load_model(str(model_dir)).model
    with torch.no_grad():
        target = torch.log_softmax(reference(calibration).logits, -1)
        logits = model(calibration).logits
    return torch.nn.functional.kl_div(
        torch.log_softmax(logits, -1), target, reduction="batchmean", log_target=True
    ).item()


def with_salient_channels(model) -> None:
    """A few input channels with large activations, as real LLMs have (random tiny models do not)."""
    g = torch.Generator().manual_seed(3)
    for layer in decoder_layers(model):
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.data[torch.randperm(128, generator=g)[:6]] *= 25


@pytest.mark.parametrize("rounding", ["rtn", "gptq"])
def test_awq_fp4_error_is_below_rtn_fp4(tiny_llama_dir, tmp_path, rounding):
    calibration = calibration_for(load_model(str(tiny_llama_dir)).tokenizer, n=8)

    def kl(run, config):
        model = load_model(str(tiny_llama_dir)).model
        with_salient_channels(model)
        summary = run(model, config, context(tmp_path / config.method, calibration))
        reference = load_model(str(tiny_llama_dir)).model
        with_salient_channels(reference)
        with torch.no_grad():
            target = torch.log_softmax(reference(calibration).logits, -1)
            logits = model(calibration).logits
        assert sum(isinstance(m, Fp4Linear) for m in model.modules()) == 14
        loss = torch.nn.functional.kl_div(torch.log_softmax(logits, -1), target, reduction="batchmean", log_target=True)
        return loss.item(), summary

    rtn_kl, _ = kl(run_rtn, RTNConfig(fp4="nvfp4"))
    awq_kl, summary = kl(run_awq, AWQConfig(fp4="nvfp4", rounding=rounding, search_samples=8))
    assert summary["quantized_linears"] == 14
    assert awq_kl < 0.6 * rtn_kl, (awq_kl, rtn_kl)


@torch.no_grad()
def test_awq_nvfp4_w4a4_takes_the_input_scale_of_the_scaled_layer(tiny_llama_dir, tmp_path):
    """q_proj of layer 0 reads input_layernorm(embeddings) with AWQ's scales folded into the norm: its static
    activation scale is 448 * 6 / max of that over the calibration samples, as the engine holds them (float16)."""
    loaded = load_model(str(tiny_llama_dir))
    model = loaded.model
    calibration = calibration_for(loaded.tokenizer)
    run_awq(model, AWQConfig(fp4="nvfp4", activations="fp4", search_samples=8), context(tmp_path, calibration))
    layer = decoder_layers(model)[0]
    hidden = model.model.embed_tokens(calibration).half().float()
    want = torch.tensor([FP8_MAX * E2M1_MAX / layer.input_layernorm(hidden).abs().max().item()])
    torch.testing.assert_close(layer.self_attn.q_proj.input_global_scale, want, rtol=1e-6, atol=0)
    assert all(
        m.input_global_scale is not None and torch.isfinite(m.input_global_scale).all()
        for m in model.modules()
        if isinstance(m, Fp4Linear)
    )


# Learned rounding on the FP4 grid -------------------------------------------------------------------


def fp4_weight(out: int = 48, cols: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, cols, generator=g) * 0.05
    w[:, 3] *= 12  # an outlier column, so clipping matters
    w[5, :64] = 0  # all-zero blocks
    return w


def random_fp4_rounding(w: torch.Tensor, fmt: str, seed: int = 1) -> Rounding:
    g = torch.Generator().manual_seed(seed)
    blocks = (w.shape[0], w.shape[1] // FP4_BLOCK[fmt])
    alpha = 0.5 + 0.5 * torch.rand(blocks, generator=g)
    return Rounding(v=torch.rand(w.shape, generator=g) - 0.5, alpha=alpha, beta=torch.ones(blocks))


@pytest.mark.parametrize("fmt", FORMATS)
def test_learned_fp4_starts_at_rtn_fp4_and_freezes_exactly(fmt):
    w = fp4_weight()
    start = init_rounding(w, scheme(fmt))
    rtn = quantize_weight_fp4(w, scheme(fmt))
    assert torch.equal(learned_fake_quantize(w, scheme(fmt), start), rtn.dequantize())
    frozen = freeze(w, scheme(fmt), start)
    assert torch.equal(frozen.codes, rtn.codes) and torch.equal(frozen.scales, rtn.scales)
    rounding = random_fp4_rounding(w, fmt)
    frozen = freeze(w, scheme(fmt), rounding)
    assert isinstance(frozen, Fp4Weight)
    assert_on_the_grid(frozen, fmt)
    assert torch.equal(frozen.dequantize(), learned_fake_quantize(w, scheme(fmt), rounding))
    assert not torch.equal(frozen.codes, rtn.codes)


@pytest.mark.parametrize("fmt", FORMATS)
def test_learned_fp4_rounds_each_weight_to_one_of_its_two_neighbours(fmt):
    """Every learned value is the E2M1 value just below or just above w / s, and V = ±0.5 picks the one above or
    below (by hand: 0.3 -> 0 or 0.5; 2.2 -> 2 or 3; 5.9 -> 4 or 6; -0.3 -> 0 or -0.5; 6, on the grid, stays)."""
    w = fp4_weight()
    rounding = random_fp4_rounding(w, fmt)
    q, effective, _ = _fp4_learned(w, scheme(fmt), rounding)
    x = (w.reshape(q.shape) / effective[..., None]).clamp(-6, 6)
    grid = torch.tensor([-6, -4, -3, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 3, 4, 6])
    below = grid[(torch.searchsorted(grid, x, right=True) - 1).clamp(0, 13)]
    above = grid[(torch.searchsorted(grid, x, right=True) - 1).clamp(0, 13) + 1]
    assert ((q == below) | (q == above)).all()
    x = torch.tensor([0.3, 2.2, 5.9, -0.3, 6.0])
    assert round_between_neighbours(x, torch.full_like(x, 0.49)).tolist() == [0.5, 3.0, 6.0, 0.0, 6.0]
    assert round_between_neighbours(x, torch.full_like(x, -0.49)).tolist() == [0.0, 2.0, 4.0, -0.5, 6.0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_learned_fp4_gradients_reach_offsets_and_clipping(fmt):
    w = fp4_weight()
    rounding = init_rounding(w, scheme(fmt))
    x = torch.randn(32, w.shape[1], generator=torch.Generator().manual_seed(2))
    loss = ((x @ learned_fake_quantize(w, scheme(fmt), rounding).T - x @ w.T) ** 2).mean()
    loss.backward()
    assert rounding.v.grad.abs().sum() > 0 and rounding.alpha.grad.abs().sum() > 0
    assert rounding.beta.grad is None  # the grid is symmetric


@pytest.mark.parametrize("fmt", FORMATS)
def test_learned_fp4_reproduces_a_gptq_start_within_the_offsets_range(layer, fmt):
    """init: gptq — α from GPTQ's block scales, V towards its E2M1 values, clamped into [-0.5, 0.5]: every value
    GPTQ left on one of w / s's two neighbours is reproduced, with its block scales (min/max block scales: α <= 1
    reaches them; MSE-searched NVFP4 scales may lie above the range's max)."""
    w, _, H = layer
    start, _ = gptq_quantize_layer(w, H, scheme(fmt), act_order=True, static_groups=True, mse=fmt == "mxfp4")
    rounding = init_rounding(w, scheme(fmt), start)
    assert rounding.v.min() >= -0.5 and rounding.v.max() <= 0.5
    frozen = freeze(w, scheme(fmt), rounding)
    assert torch.equal(frozen.scales, start.scales)
    _, effective, _ = _fp4_learned(w, scheme(fmt), rounding)
    blocks = effective.shape + (-1,)
    x = (w.reshape(blocks) / effective[..., None]).clamp(-6, 6)
    target = start.dequantize().reshape(blocks) / effective[..., None]
    lo, hi = neighbours(x)
    reachable = ((target == lo) | ((target == hi) & (x > lo))).reshape(w.shape)  # GPTQ moves some values further
    assert reachable.float().mean() > 0.6
    assert torch.equal(offsets_towards(x, target).clamp(-0.5, 0.5), rounding.v.detach().reshape(blocks))
    assert torch.equal(frozen.codes[reachable], start.codes[reachable])
    assert not torch.equal(frozen.codes, quantize_weight_fp4(w, scheme(fmt)).codes)


def test_learned_fp4_refuses_full_range():
    with pytest.raises(pydantic.ValidationError, match="full_range is an integer grid"):
        LearnedRoundingConfig(fp4="nvfp4", full_range=True)


def test_learned_nvfp4_w4a4_stage(tiny_llama_dir, tmp_path, monkeypatch):
    """The stage learns every layer on the FP4 grid (below its start's loss) and sets each W4A4 layer's static
    activation scale from the inputs the engine hands it, after AWQ's scales are folded (init: awq)."""
    loaded = load_model(str(tiny_llama_dir))
    calibration = calibration_for(loaded.tokenizer)
    amax = recording_calibration_inputs(monkeypatch)
    config = LearnedRoundingConfig(fp4="nvfp4", activations="fp4", iterations=20, batch_size=4, init="awq")
    summary = run_learned(loaded.model, config, context(tmp_path, calibration))
    assert summary["quantized_linears"] == 14 and summary["mean_loss_ratio"] < 1
    layers = {n: m for n, m in loaded.model.named_modules() if isinstance(m, Fp4Linear)}
    assert len(layers) == 14
    for name, module in layers.items():
        want = torch.tensor([FP8_MAX * E2M1_MAX / amax[name]])
        torch.testing.assert_close(module.input_global_scale, want, rtol=1e-6, atol=0, msg=name)
