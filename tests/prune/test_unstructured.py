"""Magnitude, Wanda and SparseGPT: exact sparsity patterns, the OBS update's benefit, joint quantization, resume."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lmpress.anatomy import decoder_layers, layer_linears
from lmpress.calib.statistics import HessianAccumulator
from lmpress.cli import main
from lmpress.data import calibration_samples, load_text, tokenize
from lmpress.loader import load_model
from lmpress.prune.magnitude import MagnitudeConfig, magnitude_prune_weight, run_magnitude
from lmpress.prune.masks import matrix_mask, nm_mask, row_mask
from lmpress.prune.sparsegpt import SparseGPTConfig, run_sparsegpt, sparsegpt_prune_layer
from lmpress.prune.targets import PruneTarget
from lmpress.prune.wanda import WandaConfig, run_wanda, wanda_prune_weight
from lmpress.quantize.gptq_quantize import gptq_quantize_layer
from lmpress.registry import StageContext
from lmpress.weights.qlinear import QuantizedLinear
from lmpress.weights.scheme import QuantScheme
from tests.conftest import save_tiny_model


def correlated_inputs(tokens: int = 2048, cols: int = 256, seed: int = 0) -> torch.Tensor:
    """Activations like an LLM's: correlated channels with a few large ones."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(cols, cols, generator=g) / cols**0.5 + torch.eye(cols)
    x = torch.randn(tokens, cols, generator=g) @ mix
    x[:, :8] *= 20
    return x


def output_error(W: torch.Tensor, W_hat: torch.Tensor, X: torch.Tensor) -> float:
    return torch.mean((X @ (W - W_hat).T) ** 2).item()


def hessian(X: torch.Tensor) -> torch.Tensor:
    acc = HessianAccumulator(X.shape[1])
    acc.add(X)
    return acc.H.clone()


@pytest.mark.parametrize(("n", "m"), [(2, 4), (4, 8), (1, 4)])
def test_nm_mask_prunes_exactly_m_minus_n_of_every_m(n, m):
    scores = torch.rand(64, 128)
    pruned = nm_mask(scores, n, m)
    assert (pruned.reshape(64, -1, m).sum(-1) == m - n).all()
    # the pruned ones are the lowest of their group
    groups, kept = scores.reshape(64, -1, m), ~pruned.reshape(64, -1, m)
    highest_pruned = groups.masked_fill(~pruned.reshape(64, -1, m), -1).amax(-1)
    lowest_kept = groups.masked_fill(~kept, 2).amin(-1)
    assert (highest_pruned < lowest_kept).all()


def test_row_and_matrix_masks_prune_exact_counts():
    scores = torch.rand(32, 100)
    assert (row_mask(scores, 0.5).sum(1) == 50).all()
    assert int(matrix_mask(scores, 0.3).sum()) == 960
    assert not row_mask(scores, 0.0).any()


def test_sparsegpt_beats_wanda_beats_magnitude_on_output_error():
    torch.manual_seed(0)
    X = correlated_inputs()
    W = torch.randn(128, 256)
    H = hessian(X)
    target = PruneTarget(0.5)
    magnitude, _ = magnitude_prune_weight(W, target)
    wanda, _ = wanda_prune_weight(W, X.norm(dim=0), target)
    sparse, pruned, info = sparsegpt_prune_layer(W, H, target)
    errors = [output_error(W, w, X) for w in (sparse, wanda, magnitude)]
    assert errors[0] < errors[1] < errors[2], errors
    assert info["dead_columns"] == 0
    assert torch.equal(sparse == 0, pruned)
    # per block of 128 columns exactly half of the block's weights
    assert int(pruned.sum()) == W.numel() // 2


@pytest.mark.parametrize(("n", "m"), [(2, 4), (4, 8)])
def test_sparsegpt_nm_is_exact_and_beats_wanda_nm(n, m):
    X = correlated_inputs(seed=1)
    W = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    target = PruneTarget(1 - n / m, n, m)
    sparse, pruned, _ = sparsegpt_prune_layer(W, hessian(X), target, block_size=64)
    assert ((sparse == 0).reshape(64, -1, m).sum(-1) == m - n).all()
    wanda, _ = wanda_prune_weight(W, X.norm(dim=0), target)
    assert output_error(W, sparse, X) < output_error(W, wanda, X)


def test_sparsegpt_without_sparsity_changes_nothing():
    X = correlated_inputs(tokens=512, cols=64)
    W = torch.randn(16, 64)
    out, pruned, _ = sparsegpt_prune_layer(W, hessian(X), PruneTarget(0.0))
    assert not pruned.any()
    assert torch.equal(out, W)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_keeps_pruned_weights_at_zero(act_order):
    X = correlated_inputs(tokens=1024, cols=128)
    W = torch.randn(32, 128)
    H = hessian(X)
    target = PruneTarget(0.5, 2, 4)
    sparse, pruned, _ = sparsegpt_prune_layer(W, H, target)
    scheme = QuantScheme(4, 32, True)
    q, _ = gptq_quantize_layer(sparse, H, scheme, act_order=act_order, static_groups=act_order, pruned=pruned)
    W_hat = q.dequantize(torch.float32)
    assert (W_hat[pruned] == 0).all()
    assert ((W_hat == 0).reshape(32, -1, 4).sum(-1) >= 2).all()


# On a tiny model through the engine --------------------------------------------------------------


@pytest.fixture(scope="module")
def deep_llama_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("deep-llama"), "llama", num_hidden_layers=4)


def context(tmp_path: Path, tokenizer) -> StageContext:
    calibration = calibration_samples(tokenize(tokenizer, load_text("builtin:python-docs")), 8, 32, seed=0)
    return StageContext(calibration=lambda: calibration, state_dir=tmp_path / "state", resume=False, fingerprint="f")


def pruned_linears(model) -> dict[str, torch.Tensor]:
    return {
        f"{i}.{name}": (
            linear.dequantized_weight(torch.float32) if isinstance(linear, QuantizedLinear) else linear.weight
        )
        for i, layer in enumerate(decoder_layers(model))
        for name, linear in layer.named_modules()
        if isinstance(linear, torch.nn.Linear | QuantizedLinear)
    }


@pytest.mark.long
@pytest.mark.parametrize(
    ("run", "config"),
    [
        (run_magnitude, MagnitudeConfig(pattern="2:4")),
        (run_wanda, WandaConfig(pattern="2:4")),
        (run_sparsegpt, SparseGPTConfig(pattern="2:4")),
        (run_sparsegpt, SparseGPTConfig(pattern="4:8", quantize={"bits": 4, "group_size": 32})),
    ],
    ids=["magnitude", "wanda", "sparsegpt", "sparsegpt-4:8-w4"],
)
def test_every_linear_of_a_pruned_model_has_exact_nm_zero_counts(tiny_llama_dir, tmp_path, run, config):
    loaded = load_model(str(tiny_llama_dir))
    run(loaded.model, config, context(tmp_path, loaded.tokenizer))
    m = 8 if config.pattern == "4:8" else 4
    weights = pruned_linears(loaded.model)
    assert len(weights) == 14
    for name, w in weights.items():
        zeros = (w == 0).reshape(w.shape[0], -1, m).sum(-1)
        assert (zeros == m // 2).all() if getattr(config, "quantize", None) is None else (zeros >= m // 2).all(), name
    if getattr(config, "quantize", None) is not None:
        assert all(
            isinstance(linear, QuantizedLinear) for linear in layer_linears(decoder_layers(loaded.model)[0]).values()
        )


def test_per_module_sparsity_and_ignore(tiny_llama_dir, tmp_path):
    loaded = load_model(str(tiny_llama_dir))
    config = WandaConfig(sparsity=0.5, ignore=[r".*\.1\.self_attn\..*"], overrides={r".*mlp.*": {"sparsity": 0.25}})
    summary = run_wanda(loaded.model, config, context(tmp_path, loaded.tokenizer))
    weights = pruned_linears(loaded.model)
    assert summary["rewritten_linears"] == 10
    for name, w in weights.items():
        fraction = (w == 0).float().mean().item()
        expected = 0.0 if name.startswith("1.self_attn") else 0.25 if ".mlp." in name else 0.5
        assert fraction == pytest.approx(expected, abs=1e-6), name


def _sha256_dir(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.glob("*.safetensors"))}


def _resume_recipe(model_dir: Path, tmp_path: Path) -> Path:
    recipe = {
        "model": str(model_dir),
        "data": {"source": "builtin:python-docs", "samples": 4, "seq_len": 64},
        "stages": [{"method": "sparsegpt", "pattern": "2:4", "quantize": {"bits": 4, "group_size": 32}}],
        "export": {"formats": ["compressed-tensors", "hf"]},
        "eval": {"text": "builtin:python-docs", "perplexity": {"seq_len": 64, "windows": 2}},
        "gates": ["ppl_ratio <= 1000"],
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _assert_resumed_identically(out: Path, ref: Path) -> None:
    report = yaml.safe_load((out / "report.json").read_text())
    assert report["stages"][0]["summary"]["resumed_at_layer"] == 2
    stage = report["stages"][0]  # its time over both runs: the first run's two layers and this run's
    assert stage["resumed_at_layer"] == 2 and stage["seconds_all_runs"] > stage["seconds"] > 0
    assert "resumed at layer 2" in (out / "report.md").read_text()
    assert _sha256_dir(out / "hf") == _sha256_dir(ref / "hf")
    assert _sha256_dir(out / "compressed-tensors") == _sha256_dir(ref / "compressed-tensors")
    from lmpress.export.inspect import inspect_artifact

    layers = inspect_artifact(out / "compressed-tensors")["layers"]
    assert layers and all(row["pattern"] == "2:4" for row in layers)


@pytest.mark.long
def test_resume_after_an_interrupt_gives_the_identical_artifact(deep_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("LMPRESS_CACHE", str(tmp_path / "cache"))
    path = _resume_recipe(deep_llama_dir, tmp_path)
    assert main(["run", str(path), "--out", str(tmp_path / "ref"), "--quiet"]) == 0

    from lmpress.calib.state import LayerState

    save_layer = LayerState.save_layer

    def interrupt_after_layer_1(self, session, inputs, *carried, **seconds):
        save_layer(self, session, inputs, *carried, **seconds)
        if session.index == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(LayerState, "save_layer", interrupt_after_layer_1)
    out = tmp_path / "run"
    main(["run", str(path), "--out", str(out), "--quiet"])
    assert not out.exists() and (tmp_path / ".run.partial").exists()
    monkeypatch.setattr(LayerState, "save_layer", save_layer)
    assert main(["run", str(path), "--out", str(out), "--quiet", "--resume"]) == 0
    _assert_resumed_identically(out, tmp_path / "ref")


# A child that SIGKILLs itself once layer 1's state is on disk: no exception handler, atexit or finally runs.
KILLED_CHILD = """
import os, signal, sys
from lmpress.calib.state import LayerState
from lmpress.cli import main
save_layer = LayerState.save_layer
def save_then_die(self, session, inputs, *carried, **seconds):
    save_layer(self, session, inputs, *carried, **seconds)
    if session.index == 1:
        os.kill(os.getpid(), signal.SIGKILL)
LayerState.save_layer = save_then_die
sys.exit(main(sys.argv[1:]))
"""


def run_killed_then_resumed(recipe: Path, tmp_path: Path) -> tuple[Path, Path]:
    """Run ``recipe`` whole into ``tmp_path/ref``, then into ``tmp_path/run`` in a child killed once layer 1's state
    is saved, then resumed there; the two outputs (the run's, the reference's) for the caller to compare."""
    assert main(["run", str(recipe), "--out", str(tmp_path / "ref"), "--quiet"]) == 0
    out = tmp_path / "run"
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_CHILD, "run", str(recipe), "--out", str(out), "--quiet"],
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "LMPRESS_CACHE": str(tmp_path / "cache")},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not out.exists() and (tmp_path / ".run.partial").exists()
    assert main(["run", str(recipe), "--out", str(out), "--quiet", "--resume"]) == 0
    return out, tmp_path / "ref"


@pytest.mark.long
def test_resume_after_a_kill_gives_the_identical_artifact(deep_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("LMPRESS_CACHE", str(tmp_path / "cache"))
    _assert_resumed_identically(*run_killed_then_resumed(_resume_recipe(deep_llama_dir, tmp_path), tmp_path))


def test_sparsegpt_and_gptq_in_one_pass_share_each_groups_hessian(tiny_llama_dir, tmp_path, monkeypatch):
    import lmpress.calib.statistics as statistics

    passes = []
    collect = statistics.collect_inputs

    def counting(session, names, make, *rest):
        passes.append((session.index, tuple(names)))
        return collect(session, names, make, *rest)

    monkeypatch.setattr(statistics, "collect_inputs", counting)
    loaded = load_model(str(tiny_llama_dir))
    config = SparseGPTConfig(pattern="2:4", quantize={"bits": 4, "group_size": 32})
    summary = run_sparsegpt(loaded.model, config, context(tmp_path, loaded.tokenizer))
    assert summary["quantized_linears"] == 14
    assert len(passes) == len(set(passes)) == 2 * 4  # 2 layers x 4 groups, one Hessian pass each
