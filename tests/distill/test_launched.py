"""A recipe with a distill stage run by a launcher (torchrun, as ``accelerate launch`` starts it) in
two CPU processes (DDP over gloo): the same steps as one process, one output directory written by
the main process, and ``--resume`` after a kill of the whole launch."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from lmpress.cli import main
from lmpress.distill.config import DistillConfig
from lmpress.distill.trainer import out_of_time
from lmpress.errors import LmpressInputError
from tests.distill.test_stage import RTN_W2, distill_stage, exported_weights, write_recipe


def launch(tmp_path, *args: str, **popen) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += ["-m", "lmpress.cli", "run", *args, "--quiet"]
    env = {**os.environ, "LMPRESS_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def finish(process: subprocess.Popen, timeout: float = 600) -> str:
    stdout, stderr = process.communicate(timeout=timeout)
    assert process.returncode == 0, stderr[-3000:]
    return stdout


def summary(out) -> dict:
    return json.loads((out / "report.json").read_text())["stages"][1]["summary"]


@pytest.mark.long
def test_two_launched_processes_take_the_steps_of_one_and_only_the_main_one_writes(
    tiny_llama_dir, tmp_path, training_text
):
    recipe = write_recipe(tmp_path, tiny_llama_dir, [RTN_W2, distill_stage(text=training_text, steps=8, eval_every=4)])
    stdout = finish(launch(tmp_path, recipe, "--out", str(tmp_path / "two")))
    assert stdout.count("PASS report") == 1  # one report, from the main process
    assert main(["run", recipe, "--out", str(tmp_path / "one"), "--quiet"]) == 0

    two, one = summary(tmp_path / "two"), summary(tmp_path / "one")
    assert two["tokens"] == one["tokens"] == 8 * 4 * 64
    # each process trains on its half of every batch and DDP averages the gradients: the logged loss of
    # the whole batch is one process's, up to the order of float sums (two processes training on the same
    # half of each batch move it by ~1e-2 from the second step on)
    for a, b in zip(two["training"]["losses"], one["training"]["losses"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3)
    weights_two, weights_one = exported_weights(tmp_path / "two"), exported_weights(tmp_path / "one")
    for name, want in weights_one.items():
        got = weights_two[name]
        if want.is_floating_point():  # Adam turns float-order differences into ~3e-3 here; the same-half bug: 8e-2
            assert (got.float() - want.float()).norm() <= 1e-2 * want.float().norm(), name
        else:
            assert (got != want).float().mean() <= 1e-3, name
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".two")]  # no partial or scratch left


@pytest.mark.long
def test_a_killed_launch_resumes_to_the_weights_of_an_unbroken_one(tiny_llama_dir, tmp_path, training_text):
    stages = [RTN_W2, distill_stage(text=training_text, steps=100, checkpoint_every=20, eval_every=0)]
    recipe = write_recipe(tmp_path, tiny_llama_dir, stages)
    out = tmp_path / "killed"
    process = launch(tmp_path, recipe, "--out", str(out))
    trainer = tmp_path / ".killed.partial" / "state" / "1-distill" / "checkpoint" / "trainer.json"
    deadline = time.monotonic() + 300
    while not trainer.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, "the launch ended before its first checkpoint: nothing was killed mid-training"
    launched = psutil.Process(process.pid).children(recursive=True)  # torchrun starts them in their own sessions
    for worker in [*launched, psutil.Process(process.pid)]:
        worker.send_signal(signal.SIGKILL)
    process.communicate()
    killed_at = json.loads(trainer.read_text())["log"]["step"]
    assert 0 < killed_at < 100
    assert (tmp_path / ".killed.partial-rank1").is_dir()  # the second process's stage state, kept for --resume

    # one process cannot continue what two started (each saved its own random state)
    assert main(["run", recipe, "--out", str(out), "--resume", "--quiet"]) == 2
    finish(launch(tmp_path, recipe, "--out", str(out), "--resume"))
    finish(launch(tmp_path, recipe, "--out", str(tmp_path / "unbroken")))
    resumed, unbroken = exported_weights(out), exported_weights(tmp_path / "unbroken")
    assert resumed.keys() == unbroken.keys()
    for name in unbroken:
        assert torch.equal(resumed[name], unbroken[name]), name
    assert summary(out)["steps"] == 100
    assert not (tmp_path / ".killed.partial-rank1").exists()


@pytest.mark.long
def test_a_failed_gate_fails_the_launch(tiny_llama_dir, tmp_path, training_text):
    stages = [RTN_W2, distill_stage(text=training_text, steps=2, eval_every=0)]
    recipe = write_recipe(tmp_path, tiny_llama_dir, stages, gates=["ppl <= 1"])
    process = launch(tmp_path, recipe, "--out", str(tmp_path / "gated"))
    stdout, _ = process.communicate(timeout=600)
    assert process.returncode == 1  # torchrun's code for a failed process; the main process exited 1 (gate)
    assert stdout.count("FAIL report") == 1
    assert json.loads((tmp_path / "gated" / "report.json").read_text())["passed"] is False


@pytest.mark.long
def test_max_minutes_ends_a_launched_training(tiny_llama_dir, tmp_path, training_text):
    stage = distill_stage(text=training_text, steps=100_000, max_minutes=0.05, eval_every=0, checkpoint_every=0)
    recipe = write_recipe(tmp_path, tiny_llama_dir, [RTN_W2, stage])
    finish(launch(tmp_path, recipe, "--out", str(tmp_path / "timed")), timeout=240)
    assert 0 < summary(tmp_path / "timed")["steps"] < 100_000


class TwoProcesses:
    """What ``out_of_time`` asks of accelerate, for one of two processes; ``reduce`` adds the other's value."""

    num_processes = 2
    device = torch.device("cpu")

    def __init__(self, is_main: bool, other: float):
        self.is_main_process, self.other = is_main, other

    def reduce(self, tensor, reduction):
        assert reduction == "sum"
        return tensor + self.other


@pytest.mark.parametrize("main_late", [True, False])
def test_every_launched_process_stops_when_the_main_ones_clock_says(main_late):
    # a process reading only its own clock could stop a step before or after the others, which would then wait
    # for it in an all-reduce until the launch times out
    now, minute = time.perf_counter(), 60
    late, early = now - 2 * minute, now
    main_view = out_of_time(TwoProcesses(True, 0.0), late if main_late else early, 1)
    # the other process's own clock says the opposite; the main's value (0 or 1) arrives through the reduction
    other_view = out_of_time(TwoProcesses(False, float(main_late)), early if main_late else late, 1)
    assert main_view is other_view is main_late


def test_a_batch_that_does_not_split_between_the_processes_is_refused():
    config = DistillConfig(method="distill", batch_size=6, grad_accum=2)
    config.check_processes(1)
    config.check_processes(3)
    with pytest.raises(LmpressInputError, match="batch_size 6 does not split into 2 launched processes"):
        config.check_processes(2)


def test_fsdp_asked_by_the_launcher_is_refused_before_any_work(
    tiny_llama_dir, tmp_path, training_text, capsys, monkeypatch
):
    # what `accelerate launch --use_fsdp` puts in every process's environment (accelerate itself
    # applies it on GPUs only; lmpress refuses it everywhere, rather than train with another strategy)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    out = tmp_path / "sharded"
    out.mkdir()
    (out / "kept.txt").write_text("written before")
    recipe = write_recipe(tmp_path, tiny_llama_dir, [RTN_W2, distill_stage(text=training_text, steps=2)])
    assert main(["run", recipe, "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "FSDP is not supported" in err and len(err.splitlines()) == 1, err
    assert [p.name for p in out.iterdir()] == ["kept.txt"]
