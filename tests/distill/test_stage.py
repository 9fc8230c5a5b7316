"""Distillation as a recipe stage on a tiny random Llama: it recovers what quantization lost, exports
like any other stage, resumes exactly after a kill, and refuses bad input with exit 2."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from lmpress.cli import main


def distill_stage(**changes) -> dict:
    stage = {"method": "distill", "seq_len": 64, "steps": 60, "batch_size": 4, "lr": 1e-3, "warmup_steps": 2}
    stage.update({"eval_every": 10, "eval_windows": 2, "checkpoint_every": 10, **changes})
    return stage


def write_recipe(tmp_path, model_dir, stages, name="recipe.yaml", **changes) -> str:
    recipe = {
        "model": str(model_dir),
        "data": {"source": "builtin:python-docs", "samples": 4, "seq_len": 64},
        "stages": stages,
        "export": {"formats": ["gptq"]},
        "eval": {"text": "builtin:python-docs", "perplexity": {"seq_len": 128, "windows": 4, "kld": {}}},
        "gates": [],
    }
    recipe.update(changes)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


RTN_W2 = {"method": "rtn", "bits": 2, "group_size": 32, "ignore": ["lm_head"]}


def run(tmp_path, model_dir, stages, out, **changes) -> dict:
    recipe = write_recipe(tmp_path, model_dir, stages, **changes)
    assert main(["run", recipe, "--out", str(tmp_path / out), "--quiet"]) == 0
    return json.loads((tmp_path / out / "report.json").read_text())


@pytest.mark.long
def test_distillation_recovers_what_quantization_lost_and_ships_in_the_same_format(
    tiny_llama_dir, tmp_path, training_text
):
    plain = run(tmp_path, tiny_llama_dir, [RTN_W2], "plain")
    recovered = run(tmp_path, tiny_llama_dir, [RTN_W2, distill_stage(text=training_text)], "recovered")
    summary = recovered["stages"][1]["summary"]
    assert summary["fake_quantized_layers"] == summary["frozen_quantized_layers"] == 14
    assert summary["steps"] == 60 and summary["tokens"] == 60 * 4 * 64
    losses = [row["loss"] for row in summary["training"]["losses"]]
    assert sum(losses[-5:]) < 0.7 * sum(losses[:5])
    # the candidate is the gptq export read back from disk, scored against the unmodified model
    assert recovered["export_checks"][0]["passed"]
    kld = {side: run["candidate"]["metrics"]["kld_mean"] for side, run in (("plain", plain), ("recovered", recovered))}
    assert kld["recovered"] < 0.7 * kld["plain"], kld
    assert (tmp_path / "recovered" / "training_stage1.png").stat().st_size > 0
    assert "training_stage1.png" in (tmp_path / "recovered" / "report.md").read_text()
    config = json.loads((tmp_path / "recovered" / "gptq" / "config.json").read_text())
    assert config["quantization_config"]["bits"] == 2


@pytest.mark.long
def test_training_only_scales_and_norms_keeps_the_latent_weights_and_still_recovers(
    tiny_llama_dir, tmp_path, training_text
):
    stage = distill_stage(text=training_text, steps=30, learn_weights=False, scale_lr=1e-3, norm_lr=1e-2)
    recovered = run(tmp_path, tiny_llama_dir, [RTN_W2, stage], "scales")
    summary = recovered["stages"][1]["summary"]
    config = json.loads((Path(tiny_llama_dir) / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    norms = (2 * layers + 1) * hidden
    scales = sum(out * -(-inp // 32) for out, inp in _linear_shapes(config)) * layers
    assert summary["trainable_parameters"] == norms + scales
    losses = [row["loss"] for row in summary["training"]["losses"]]
    assert sum(losses[-5:]) < sum(losses[:5])
    assert recovered["export_checks"][0]["passed"]


@pytest.mark.long
def test_an_nvfp4_model_trains_its_block_scales_and_norms_and_ships_as_nvfp4(tiny_llama_dir, tmp_path, training_text):
    rtn = {"method": "rtn", "fp4": "nvfp4", "ignore": ["lm_head"]}
    stage = distill_stage(text=training_text, steps=30, learn_weights=False, scale_lr=1e-4, norm_lr=1e-2)
    exports = {"formats": ["compressed-tensors"]}
    recovered = run(tmp_path, tiny_llama_dir, [rtn, stage], "fp4", export=exports)
    summary = recovered["stages"][1]["summary"]
    assert summary["fake_quantized_layers"] == summary["frozen_quantized_layers"] == 14
    config = json.loads((Path(tiny_llama_dir) / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    scales = sum(out * inp // 16 for out, inp in _linear_shapes(config)) * layers  # one per block of 16
    assert summary["trainable_parameters"] == (2 * layers + 1) * hidden + scales
    losses = [row["loss"] for row in summary["training"]["losses"]]
    assert sum(losses[-5:]) < sum(losses[:5])
    assert recovered["export_checks"][0]["passed"]
    quantization = json.loads((tmp_path / "fp4" / "compressed-tensors" / "config.json").read_text())
    assert quantization["quantization_config"]["format"] == "nvfp4-pack-quantized"


def _linear_shapes(config: dict) -> list[tuple[int, int]]:
    """(out, in) of each linear of a Llama decoder layer."""
    d, ff = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or d // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    return [(d, d), (kv, d), (kv, d), (d, d), (ff, d), (ff, d), (d, ff)]


@pytest.mark.long
def test_a_cached_teacher_trains_the_same_way_as_an_online_one_at_full_k(tiny_llama_dir, tmp_path, training_text):
    vocab = json.loads((Path(tiny_llama_dir) / "config.json").read_text())["vocab_size"]
    online = run(tmp_path, tiny_llama_dir, [RTN_W2, distill_stage(text=training_text, steps=6)], "online")
    cached = distill_stage(text=training_text, steps=6, teacher_logits="cache", top_k=vocab)
    cache = run(tmp_path, tiny_llama_dir, [RTN_W2, cached], "cached")
    a = [r["loss"] for r in online["stages"][1]["summary"]["training"]["losses"]]
    b = [r["loss"] for r in cache["stages"][1]["summary"]["training"]["losses"]]
    assert b == pytest.approx(a, rel=2e-3)  # the cache stores float16 log-probabilities


@pytest.mark.long
def test_bf16_mixed_precision_trains_under_autocast_and_exports_the_same_format(
    tiny_llama_dir, tmp_path, training_text
):
    fp32 = run(tmp_path, tiny_llama_dir, [RTN_W2, distill_stage(text=training_text, steps=6)], "fp32")
    stage = distill_stage(text=training_text, steps=6, mixed_precision="bf16")
    bf16 = run(tmp_path, tiny_llama_dir, [RTN_W2, stage], "bf16")
    a = [r["loss"] for r in fp32["stages"][1]["summary"]["training"]["losses"]]
    b = [r["loss"] for r in bf16["stages"][1]["summary"]["training"]["losses"]]
    assert b != a  # the student's matmuls ran in bfloat16 (8-bit mantissas) ...
    assert b == pytest.approx(a, rel=2e-2)  # ... and trained the same way
    assert bf16["export_checks"][0]["passed"]
    config = json.loads((tmp_path / "bf16" / "gptq" / "config.json").read_text())
    assert config["quantization_config"]["bits"] == 2


def exported_weights(out: Path) -> dict:
    return load_file(str(out / "gptq" / "model.safetensors"))


@pytest.mark.long
def test_resume_after_a_kill_gives_the_weights_of_an_uninterrupted_run(tiny_llama_dir, tmp_path, training_text):
    stages = [RTN_W2, distill_stage(text=training_text, steps=100, checkpoint_every=20, eval_every=0)]
    recipe = write_recipe(tmp_path, tiny_llama_dir, stages)
    out = tmp_path / "killed"
    env = {**os.environ, "LMPRESS_CACHE": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "lmpress.cli", "run", recipe, "--out", str(out), "--quiet"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    trainer = tmp_path / ".killed.partial" / "state" / "1-distill" / "checkpoint" / "trainer.json"
    deadline = time.monotonic() + 300
    while not trainer.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, "the run ended before its first checkpoint: nothing was killed mid-training"
    process.send_signal(signal.SIGKILL)
    process.wait()
    killed_at = json.loads(trainer.read_text())["log"]["step"]
    assert 0 < killed_at < 100
    assert main(["run", recipe, "--out", str(out), "--resume", "--quiet"]) == 0
    assert main(["run", recipe, "--out", str(tmp_path / "straight"), "--quiet"]) == 0
    resumed, straight = exported_weights(out), exported_weights(tmp_path / "straight")
    assert resumed.keys() == straight.keys()
    for name in straight:
        assert (resumed[name] == straight[name]).all(), name
    report = json.loads((out / "report.json").read_text())
    assert report["stages"][1]["summary"]["steps"] == 100


@pytest.mark.parametrize(
    "stage, message",
    [
        ({"hidden": {"layers": {0: 7}}}, "names teacher layer(s) [7]; the teacher has layers 0..1"),
        ({"hidden": {"layers": {5: 1}}}, "names student layer(s) [5]; the student has layers 0..1"),
        ({"text": "SHORT"}, "fewer than one batch of 4"),
        ({"text": "builtin:python-docs"}, "is the eval text"),
        ({"text_windows": 2}, "text_windows: 2 is fewer than one batch (4)"),
        ({"loss": "jsd", "teacher_logits": "cache"}, "teacher_logits: cache keeps the teacher's top-k"),
        ({"train_on": "calibration", "text_windows": 4}, "train_on: calibration trains on the recipe's"),
        ({"train_on": "calibration", "text": None, "seq_len": 32}, "train_on: calibration needs seq_len: 64"),
    ],
)
def test_bad_distillation_input_exits_2_with_one_line(tiny_llama_dir, tmp_path, training_text, capsys, stage, message):
    settings = {"text": training_text, **stage}
    if settings["text"] == "SHORT":
        (tmp_path / "short.txt").write_text("Only a few words of training text, not one batch.")
        settings["text"] = str(tmp_path / "short.txt")
    if settings["text"] is None:
        del settings["text"]
    data = {"source": training_text, "samples": 4, "seq_len": 64}
    recipe = write_recipe(tmp_path, tiny_llama_dir, [RTN_W2, distill_stage(**settings)], data=data)
    assert main(["run", recipe, "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_a_teacher_with_another_vocabulary_is_refused(tiny_llama_dir, tmp_path, training_text, capsys):
    from tests.conftest import save_tiny_model

    other = save_tiny_model(tmp_path / "other", "llama", vocab_size=500)
    recipe = write_recipe(tmp_path, tiny_llama_dir, [RTN_W2, distill_stage(text=training_text, teacher=str(other))])
    assert main(["run", recipe, "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "vocabulary" in err and "differs from the teacher's (500)" in err


@pytest.mark.long
def test_teacher_answers_join_the_training_windows(tiny_llama_dir, tmp_path, training_text):
    import shutil

    from transformers import AutoTokenizer

    from tests.distill.test_answers import TEMPLATE

    model_dir = tmp_path / "chat-model"
    shutil.copytree(tiny_llama_dir, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(model_dir)
    dense = {"export": {"formats": ["hf"]}}
    plain = run(tmp_path, model_dir, [distill_stage(text=training_text, steps=2)], "plain", **dense)
    answers = {"prompts": 5, "quote_tokens": 8, "batch_size": 4}
    stage = distill_stage(text=training_text, steps=2, teacher_answers=answers)
    chat = run(tmp_path, model_dir, [stage], "chat", **dense)
    windows = plain["stages"][0]["summary"]["training_windows"]
    assert chat["stages"][0]["summary"]["training_windows"] == windows + 5
    stage = distill_stage(text=training_text, steps=2, teacher_answers=answers, text_windows=6)
    capped = run(tmp_path, model_dir, [stage], "capped", **dense)
    assert windows > 6 and capped["stages"][0]["summary"]["training_windows"] == 6 + 5


def test_training_on_the_calibration_samples_uses_exactly_them_and_holds_out_other_windows(
    tiny_llama_dir, tmp_path, training_text
):
    from transformers import AutoTokenizer

    from lmpress.data import calibration_samples, load_text, tokenize
    from lmpress.distill.config import DistillConfig
    from lmpress.distill.stage import calibration_windows

    data = {"source": training_text, "samples": 8, "seq_len": 64, "seed": 3}
    stage = distill_stage(train_on="calibration", steps=4, eval_windows=3)
    report = run(tmp_path, tiny_llama_dir, [RTN_W2, stage], "calib", data=data)
    assert report["stages"][1]["summary"]["training_windows"] == 8
    # the windows the stage built: the calibration samples, and held-out text windows that are none of them
    ids = tokenize(AutoTokenizer.from_pretrained(tiny_llama_dir), load_text(training_text))
    samples = calibration_samples(ids, n_samples=8, seq_len=64, seed=3)
    windows = calibration_windows(samples, ids, DistillConfig(**stage))
    assert (windows.train == samples).all()
    assert windows.held_out.shape == (3, 64)
    assert not any((samples == w).all(dim=1).any() for w in windows.held_out)
    text_windows = ids[: ids.numel() // 64 * 64].view(-1, 64)
    assert all((text_windows == w).all(dim=1).any() for w in windows.held_out)


def test_training_on_the_eval_text_by_default_is_refused(tiny_llama_dir, tmp_path, capsys):
    # no text: the stage trains on data.source, here the eval text too
    recipe = write_recipe(tmp_path, tiny_llama_dir, [RTN_W2, distill_stage(train_on="calibration")])
    assert main(["run", recipe, "--out", str(tmp_path / "out"), "--quiet"]) == 2
    assert "text builtin:python-docs is the eval text" in capsys.readouterr().err
