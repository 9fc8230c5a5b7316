"""Device placement, tested without a GPU: every stage kind, and the eval suite, run on a tiny random Llama with
a second device (tests/fake_device.py: tensors that say ``meta`` and hold CPU numbers, refused next to CPU
tensors as CUDA refuses them) under lmpress's placement guard (every forward's parameters, buffers and inputs
on the compute device). Between stages the model rests on the CPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from lmpress.errors import LmpressInputError
from lmpress.placement import (
    MisplacedTensor,
    OutOfDeviceMemory,
    naming_out_of_memory,
    on_device,
    placement_guard,
    resolve_device,
)
from tests.fake_device import OnFakeDevice, fake_accelerator, fake_device_self_test

pytestmark = pytest.mark.usefixtures("private_cache")


DISTILL = {"seq_len": 32, "batch_size": 2, "steps": 2, "eval_every": 1, "eval_windows": 2, "checkpoint_every": 1}
STAGES = {
    "rtn": [{"method": "rtn", "bits": 4, "group_size": 32}],
    "gptq": [{"method": "gptq", "bits": 4, "group_size": 32, "act_order": True}],
    "awq": [{"method": "awq", "bits": 4, "group_size": 32}],
    "smoothquant": [{"method": "smoothquant"}],
    "learned": [{"method": "learned", "bits": 4, "group_size": 32, "iterations": 2, "batch_size": 2}],
    "sparsegpt": [{"method": "sparsegpt", "pattern": "2:4"}],
    "wanda": [{"method": "wanda", "sparsity": 0.5}],
    "magnitude": [{"method": "magnitude", "sparsity": 0.5}],
    "structured": [{"method": "structured", "heads": 2, "mlp_channels": 0.25}],
    "structured-kl": [{"method": "structured", "layers": 1, "layer_importance": "kl", "kl_samples": 2}],
    "fp8": [{"method": "fp8"}],
    "distill": [{"method": "sparsegpt", "pattern": "2:4"}, {"method": "distill", **DISTILL}],
    "distill-quantized": [
        {"method": "rtn", "bits": 4, "group_size": 32},
        {"method": "distill", "learn_weights": False, "train_on": "calibration", **DISTILL},
    ],
    "distill-cache-answers": [
        {
            "method": "distill",
            **DISTILL,
            "seq_len": 96,
            "teacher_logits": "cache",
            "top_k": 8,
            "teacher_answers": {"prompts": 2, "quote_tokens": 8, "instructions": ["Say:"]},
        }
    ],
    "distill-hidden": [{"method": "distill", **DISTILL, "hidden": {"layers": {0: 1}}, "ce_weight": 0.5}],
}


CHAT = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}A:{% endif %}"


def recipe_for(model_dir, stages, text: str):
    from lmpress.recipe import parse_recipe

    raw = {
        "model": str(model_dir),
        "data": {"source": text, "samples": 4, "seq_len": 32},
        "stages": stages,
        "eval": {"text": "builtin:python-docs", "perplexity": {"seq_len": 64, "windows": 2}},
    }
    return parse_recipe(raw, "placement")


def assert_on_cpu(model: torch.nn.Module) -> None:
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        assert tensor.device.type == "cpu" and not isinstance(tensor, OnFakeDevice), f"{name} left on {tensor.device}"


def run_under_guard(model_dir, stages, text, tmp_path):
    from lmpress.loader import load_model
    from lmpress.pipeline import run_stages

    recipe = recipe_for(model_dir, stages, text)
    loaded = load_model(str(model_dir), "float32")
    loaded.tokenizer.chat_template = CHAT  # teacher_answers
    with fake_accelerator() as device, placement_guard(device):
        summaries = run_stages(loaded, recipe, tmp_path / "partial", False, device=device, bars=_quiet())
    return loaded, summaries


def _quiet():
    from lmpress.progress import QUIET

    return QUIET


def test_the_fake_device_refuses_a_mix_as_cuda_does():
    fake_device_self_test()


def test_the_guard_catches_a_forward_off_the_compute_device():
    linear = torch.nn.Linear(4, 4)
    with fake_accelerator() as device, placement_guard(device):
        with pytest.raises(MisplacedTensor, match="weight is on cpu"):
            linear(torch.ones(2, 4).to(device))
        linear.to(device)
        with pytest.raises(MisplacedTensor, match="input 0 is on cpu"):
            linear(torch.ones(2, 4))
        assert linear(torch.ones(2, 4).to(device)).device == device


@pytest.mark.parametrize("kind", list(STAGES))
def test_every_stage_computes_on_the_device_and_leaves_the_model_on_the_cpu(
    kind, tiny_llama_dir, training_text, tmp_path
):
    loaded, summaries = run_under_guard(tiny_llama_dir, STAGES[kind], training_text, tmp_path)
    assert [s["method"] for s in summaries] == [s["method"] for s in STAGES[kind]]
    assert all(s["device"] == "meta" for s in summaries)
    assert_on_cpu(loaded.model)
    # what the stage made still computes on the CPU, where the model rests
    with torch.no_grad():
        logits = loaded.model(torch.arange(16)[None] % 100).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("check", [True, False])
def test_check_placement_guards_every_stage_of_a_run(check, tiny_llama_dir, training_text, tmp_path, monkeypatch):
    """``lmpress run --check-placement``: a stage that computes off its device fails; unchecked, it goes by."""
    from lmpress import registry
    from lmpress.loader import load_model
    from lmpress.pipeline import run_stages

    def computes_on_the_cpu(model, config, ctx):  # the stage's device is the fake one; the model rests on the CPU
        with torch.no_grad():
            model(torch.arange(8)[None])
        return {}

    recipe = recipe_for(tiny_llama_dir, STAGES["rtn"], training_text)
    monkeypatch.setitem(registry.STAGE_HANDLERS, type(recipe.stages[0]), computes_on_the_cpu)
    loaded = load_model(str(tiny_llama_dir), "float32")
    with fake_accelerator() as device:
        run = lambda: run_stages(loaded, recipe, tmp_path / "p", False, _quiet(), device, check_placement=check)  # noqa: E731
        if check:
            with pytest.raises(MisplacedTensor, match="is on cpu"):
                run()
        else:
            assert [s["method"] for s in run()] == ["rtn"]


def test_the_run_command_passes_check_placement_on(monkeypatch, tmp_path):
    from pathlib import Path

    import lmpress.pipeline
    from lmpress.cli import main
    from lmpress.pipeline import RunResult

    seen = {}

    def fake_run(recipe, out, overwrite, resume, bars, check_placement=False):
        seen["check_placement"] = check_placement
        return RunResult(exit_code=0, out_dir=Path(out), report={})

    monkeypatch.setattr(lmpress.pipeline, "run_recipe", fake_run)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: x\nstages: [{method: rtn}]\n")
    for flags, expected in (([], False), (["--check-placement"], True)):
        assert main(["run", str(recipe), "--out", str(tmp_path / "out"), "--quiet", *flags]) == 0
        assert seen["check_placement"] is expected


def test_the_eval_suite_runs_on_the_device(tiny_llama_dir, tmp_path):
    from lmpress.evals.suite import run_suite
    from lmpress.loader import load_model
    from lmpress.progress import QUIET
    from lmpress.recipe import parse_recipe

    recipe = parse_recipe(
        {
            "model": str(tiny_llama_dir),
            "eval": {
                "text": "builtin:python-docs",
                "perplexity": {"seq_len": 64, "windows": 2},
                "ppl_by_position": {"seq_len": 64, "documents": 2},
            },
        },
        "suite",
    )
    loaded = load_model(str(tiny_llama_dir), "float32")
    on_cpu = run_suite(recipe.eval.evals, recipe.eval.text, loaded.model, loaded.tokenizer, "id", "baseline", QUIET)
    with fake_accelerator() as device, placement_guard(device), on_device(device, loaded.model):
        on_fake = run_suite(
            recipe.eval.evals, recipe.eval.text, loaded.model, loaded.tokenizer, "id2", "baseline", QUIET
        )
    assert on_fake["perplexity"].metrics["ppl"] == pytest.approx(on_cpu["perplexity"].metrics["ppl"], rel=1e-5)
    assert_on_cpu(loaded.model)


def test_cuda_without_a_gpu_is_an_input_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("cpu", "model.device") == torch.device("cpu")
    assert resolve_device("auto", "model.device") == torch.device("cpu")
    with pytest.raises(LmpressInputError, match=r"^--device: cuda, but no CUDA GPU is available here"):
        resolve_device("cuda", "--device")
    with pytest.raises(LmpressInputError, match=r"'tpu' is not one of cpu, cuda, auto"):
        resolve_device("tpu", "--device")


def test_out_of_memory_names_stage_and_layer():
    def fail():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(OutOfDeviceMemory) as caught:
        with naming_out_of_memory("stage 2 (gptq)", torch.device("cpu"), "rerun with --resume"):
            with naming_out_of_memory("layer 3", torch.device("cpu")):
                fail()
    assert str(caught.value) == (
        "stage 2 (gptq), layer 3: out of memory on cpu (CUDA out of memory. Tried to allocate 2.00 GiB); "
        "rerun with --resume"
    )


FREED_HEAP = """
import ctypes, psutil, torch
from lmpress.memory import GLIBC_MMAP_THRESHOLD_MAX, M_MMAP_THRESHOLD
from lmpress.placement import release_memory
# as after glibc has freed one mapped block of 32 MiB: blocks below that now come from the heap
ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, GLIBC_MMAP_THRESHOLD_MAX)
stage = [torch.ones(1 << 18) for _ in range(300)]  # a stage's transient buffers: 300 x 1 MiB
kept = torch.ones(1 << 18)  # something long-lived allocated after them, at the heap's top
del stage
before = psutil.Process().memory_info().rss
release_memory(torch.device("cpu"))
print((before - psutil.Process().memory_info().rss) / 2**20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")
def test_releasing_memory_hands_a_stages_freed_heap_back_to_the_os():
    done = subprocess.run([sys.executable, "-c", FREED_HEAP], capture_output=True, text=True, timeout=120, check=True)
    assert float(done.stdout.split()[-1]) > 250  # MiB no longer resident
