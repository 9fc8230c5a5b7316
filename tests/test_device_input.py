"""Bad device input, through the CLI, without a GPU: CUDA asked for where torch has none, an FP8 artifact on a
GPU without FP8 tensor cores (a monkeypatched compute capability), and the compute device running out of
memory inside a stage (a layer's forward raising torch.OutOfMemoryError). Each: exit 2, one line, nothing
already written lost; after the out-of-memory error the run resumes with --resume."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from lmpress.cli import main

pytestmark = pytest.mark.usefixtures("private_cache")


def write_recipe(tmp_path, model_dir, **changes) -> str:
    recipe = {
        "model": str(model_dir),
        "data": {"source": "builtin:python-docs", "samples": 4, "seq_len": 64},
        "stages": [{"method": "gptq", "bits": 4, "group_size": 32}],
        "eval": {"text": "builtin:python-docs", "perplexity": {"seq_len": 128, "windows": 2}},
        "gates": ["ppl_ratio <= 10"],
    }
    recipe.update(changes)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def one_error_line(capsys, *fragments: str) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err
    return err


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def old_gpu(monkeypatch):
    """torch says an A100 (compute capability 8.0) is here; nothing may reach it before the refusal."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")


def test_run_with_device_cuda_and_no_gpu_exits_2_before_any_work(no_cuda, tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "kept.txt").write_text("earlier results")
    recipe = write_recipe(tmp_path, tiny_llama_dir, model={"source": str(tiny_llama_dir), "device": "cuda"})
    assert main(["run", recipe, "--out", str(out), "--overwrite", "--quiet"]) == 2
    one_error_line(capsys, "model.device: cuda, but no CUDA GPU is available here")
    assert [p.name for p in out.iterdir()] == ["kept.txt"] and (out / "kept.txt").read_text() == "earlier results"
    assert main(["run", recipe, "--out", str(out), "--quiet", "--overwrite", "--set", "model.device=cuda"]) == 2


@pytest.mark.parametrize("command", ["generate", "eval", "bench"])
def test_commands_with_device_cuda_and_no_gpu_exit_2(command, no_cuda, tiny_llama_dir, capsys, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("a model was loaded before the device was checked")

    monkeypatch.setattr("lmpress.loader.load_model", never)
    extra = ["--prompt", "Hello"] if command == "generate" else []
    assert main([command, str(tiny_llama_dir), "--device", "cuda", *extra]) == 2
    one_error_line(capsys, "--device: cuda, but no CUDA GPU is available here")


@pytest.fixture
def fp8_artifact(tiny_llama_dir, tmp_path):
    recipe = write_recipe(
        tmp_path, tiny_llama_dir, stages=[{"method": "fp8"}], export={"formats": ["compressed-tensors"]}
    )
    assert main(["run", recipe, "--out", str(tmp_path / "fp8"), "--quiet"]) == 0
    return tmp_path / "fp8" / "compressed-tensors"


@pytest.mark.long
@pytest.mark.parametrize("command", ["generate", "eval"])
def test_an_fp8_artifact_on_a_gpu_before_fp8_tensor_cores_exits_2(command, fp8_artifact, old_gpu, capsys, tmp_path):
    capsys.readouterr()
    suite = tmp_path / "suite.yaml"
    suite.write_text(yaml.safe_dump({"eval": {"text": "builtin:python-docs", "perplexity": {"seq_len": 64}}}))
    extra = ["--prompt", "Hello"] if command == "generate" else ["--suite", str(suite)]
    assert main([command, str(fp8_artifact), "--device", "cuda", *extra]) == 2
    one_error_line(capsys, "(FP8 layers) needs a GPU of compute capability 8.9 or newer", "A100", "is 8.0")


def fail_in(monkeypatch, layer_index: int, calls_before: int = 0, training: bool = False) -> list[int]:
    """Decoder layer ``layer_index``'s forward raises CUDA's out-of-memory error after ``calls_before`` calls
    (``training``: counting only the calls of a model in training mode: the student's)."""
    original, calls = LlamaDecoderLayer.forward, [0]

    def forward(self, *args, **kwargs):
        if self.self_attn.layer_idx == layer_index and (self.training or not training):
            calls[0] += 1
            if calls[0] > calls_before:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LlamaDecoderLayer, "forward", forward)
    return calls


@pytest.mark.long
def test_out_of_memory_in_a_layer_names_stage_and_layer_and_the_run_resumes(
    tiny_llama_dir, tmp_path, capsys, monkeypatch
):
    recipe = write_recipe(tmp_path, tiny_llama_dir)
    fresh, out = tmp_path / "fresh", tmp_path / "run"
    assert main(["run", recipe, "--out", str(fresh), "--quiet"]) == 0
    assert main(["run", recipe, "--out", str(out), "--quiet"]) == 0
    before = (out / "report.json").read_bytes()
    capsys.readouterr()

    with monkeypatch.context() as patch:
        fail_in(patch, 1)
        assert main(["run", recipe, "--out", str(out), "--quiet", "--overwrite"]) == 2
    one_error_line(
        capsys,
        "stage 0 (gptq), layer 1 (model.layers.1): out of memory on cpu (CUDA out of memory. Tried to allocate",
        "then rerun with --resume",
    )
    assert (out / "report.json").read_bytes() == before  # the earlier run's results are still there

    assert main(["run", recipe, "--out", str(out), "--quiet", "--overwrite", "--resume"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["stages"][0]["summary"]["resumed_at_layer"] == 1  # layer 0, finished before, was kept
    assert (out / "hf" / "model.safetensors").read_bytes() == (fresh / "hf" / "model.safetensors").read_bytes()


@pytest.mark.long
def test_out_of_memory_in_a_training_step_names_the_step_and_the_run_resumes(
    tiny_llama_dir, tmp_path, capsys, monkeypatch
):
    from pydoc_data.topics import topics

    text = tmp_path / "train.txt"
    text.write_text("\n\n".join(topics[k] for k in sorted(topics)[40:100]))
    distill = {"method": "distill", "text": str(text), "seq_len": 32, "batch_size": 2, "steps": 3}
    recipe = write_recipe(
        tmp_path,
        tiny_llama_dir,
        stages=[{"method": "rtn", "bits": 8, "group_size": 32}, {**distill, "checkpoint_every": 1, "eval_every": 0}],
    )
    out = tmp_path / "run"
    with monkeypatch.context() as patch:
        fail_in(patch, 0, calls_before=1, training=True)  # in the second step
        assert main(["run", recipe, "--out", str(out), "--quiet"]) == 2
    one_error_line(capsys, "stage 1 (distill), step 2: out of memory on cpu", "then rerun with --resume")
    assert main(["run", recipe, "--out", str(out), "--quiet", "--resume"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["stages"][1]["summary"]["steps"] == 3
