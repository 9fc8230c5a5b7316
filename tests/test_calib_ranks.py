"""Calibration spread over launched processes (lmpress.calib.ranks): each of two torchrun processes (gloo) replays
half of the calibration batches, statistics are summed across them and each GPTQ solve runs on one.

The artifact is bit-identical to one process's: Wanda's input norms and GPTQ's Hessians are float64 sums of the
same float32 per-batch terms (another grouping moves them by ~1e-16 relative, far below float32's rounding),
maxima reduce exactly, and searches (AWQ, SmoothQuant's α) score each candidate on the whole gathered recording."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lmpress.calib.ranks import check_shareable, collective, owners_by_cost, rank_batches
from lmpress.cli import main
from lmpress.errors import LmpressInputError, LmpressStopped

pytestmark = pytest.mark.usefixtures("private_cache")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def test_ranks_replay_every_batch_once_in_contiguous_shares():
    for n_batches in (2, 5, 32):
        for world in (1, 2, 3):
            if n_batches < world:
                continue
            shares = [rank_batches(n_batches, r, world) for r in range(world)]
            assert [b for share in shares for b in share] == list(range(n_batches))
            assert max(len(s) for s in shares) - min(len(s) for s in shares) <= 1


def test_solves_go_to_the_least_loaded_rank_costliest_first():
    cost = {"q": 9.0, "k": 3.0, "v": 3.0, "o": 9.0}.__getitem__
    owners = owners_by_cost(["q", "k", "v", "o"], cost, 2)
    assert owners == {"q": 0, "o": 1, "k": 0, "v": 1}
    assert owners_by_cost(["q", "k"], cost, 1) == {"q": 0, "k": 0}


def test_more_processes_than_calibration_batches_is_refused():
    check_shareable(8, 4, 2)
    with pytest.raises(LmpressInputError, match="make 2 batches, fewer than the 3 launched processes"):
        check_shareable(8, 4, 3)


def test_a_collective_that_loses_its_peers_is_reported_in_one_line():
    @collective
    def all_reduce() -> None:
        raise RuntimeError(
            "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:32182: "
            "Connection reset by peer. This is typically caused by a remote worker hanging"
        )

    with pytest.raises(LmpressStopped) as stopped:
        all_reduce()
    message = str(stopped.value)
    assert "\n" not in message and "pair.cc" not in message
    assert message.startswith("process 0 of 1: a collective of the calibration failed (Read error [127.0.0.1]")
    assert message.endswith("run the same launch with --resume")


def test_a_resume_with_another_number_of_processes_takes_each_batch_from_the_state_that_kept_it(tmp_path):
    import torch

    from lmpress.calib.resume import SavedStates, rank_state_dir
    from lmpress.calib.state import LayerState

    main_dir = tmp_path / ".run.partial" / "state" / "0-gptq"
    batches = [torch.full((2, 3, 4), float(b)) for b in range(5)]  # batch b's values are b
    for q, (share, done) in enumerate([(range(0, 3), 3), (range(3, 5), 2)]):  # process 0 saved a layer more
        state = LayerState(rank_state_dir(main_dir, q), "print", processes=2)
        state.dir.mkdir(parents=True)
        for layer in range(2, done + 1):  # a launched process keeps its last two layers' inputs
            state._write(f"inputs_{layer:05d}.safetensors", {f"h.{i}": batches[b] for i, b in enumerate(share)}, {})
        progress = {"version": 3, "fingerprint": "print", "done_layers": done, "processes": 2, "seconds": 1.0}
        state.progress_path.write_text(json.dumps(progress))
    own = LayerState(main_dir, "print", processes=1)
    saved = SavedStates.find(own, main_dir, rank=0, world=1)
    assert saved.regrouped and saved.done_layers(own) == 2
    inputs, carried = saved.load_inputs(2, 5, range(5), [{}] * 5)
    assert [inputs.hidden[i][0, 0, 0].item() for i in range(5)] == [0, 1, 2, 3, 4] and carried == {}
    (rank_state_dir(main_dir, 1) / "progress.json").unlink()  # process 1's state is on another machine
    with pytest.raises(LmpressInputError, match="process 1's state .* is not here"):
        saved.done_layers(own)


def test_a_resume_of_a_pass_that_shares_each_batchs_samples_joins_the_parts_and_cuts_them_anew(tmp_path):
    """Learned rounding's processes each save their part of every batch (and of its carried tensors): resumed by
    another number of processes, each takes its new part of every batch, the whole batch where it is alone."""
    import torch

    from lmpress.calib.ranks import rank_batches
    from lmpress.calib.resume import SavedStates, rank_state_dir
    from lmpress.calib.state import LayerState

    main_dir = tmp_path / ".run.partial" / "state" / "0-learned"
    batches = [torch.arange(b * 10, b * 10 + 5, dtype=torch.float32)[:, None, None].expand(5, 2, 3) for b in range(3)]
    for q in range(2):
        state = LayerState(rank_state_dir(main_dir, q), "print", processes=2)
        state.dir.mkdir(parents=True)
        parts = {f"h.{b}": batch[rank_batches(5, q, 2)] for b, batch in enumerate(batches)}
        parts |= {f"m.learned.{b}": -batch[rank_batches(5, q, 2)] for b, batch in enumerate(batches)}
        state._write("inputs_00002.safetensors", parts, {})
        progress = {"version": 3, "fingerprint": "print", "done_layers": 2, "processes": 2, "seconds": 1.0}
        state.progress_path.write_text(json.dumps(progress))
    for rank, world in [(0, 1), (0, 3), (2, 3)]:
        saved = SavedStates.find(LayerState(main_dir, "print", processes=world), main_dir, rank=rank, world=world)
        inputs, carried = saved.load_rows(2, 3, [{}] * 3)
        rows = rank_batches(5, rank, world)
        for b, batch in enumerate(batches):
            assert torch.equal(inputs.hidden[b], batch[rows]) and torch.equal(carried[f"learned.{b}"], -batch[rows])
    (rank_state_dir(main_dir, 1) / "inputs_00002.safetensors").unlink()
    with pytest.raises(LmpressInputError, match="saved inputs of layer 2 .* are not here"):
        saved.load_rows(2, 3, [{}] * 3)


def resume_in_two_to_the_unbroken_run(tmp_path, recipe: Path, out: Path) -> None:
    """Resume a one-process run killed after layer 1 in two launched processes: its export must be the unbroken
    one-process run's, every tensor."""
    launch(tmp_path, str(recipe), str(out), "--resume")
    summary = json.loads((out / "report.json").read_text())["stages"][0]["summary"]
    assert summary["resumed_at_layer"] == 2 and summary["processes"] == 2
    assert one_thread_run(recipe, tmp_path / "unbroken") == 0
    assert tensor_digests(out / "compressed-tensors") == tensor_digests(tmp_path / "unbroken" / "compressed-tensors")


def launch(tmp_path, recipe: str, out: str, *options: str) -> None:
    command = [*TORCHRUN, "-m", "lmpress.cli", "run", recipe, "--out", out, "--quiet", *options]
    env = {**os.environ, "LMPRESS_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]


def one_thread_run(recipe, out, *options: str) -> int:
    """``lmpress run`` in this process with one thread, as each launched process has: LAPACK's factorizations
    (the Hessian's Cholesky) round differently on another number of threads, and SparseGPT's masks follow them."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return main(["run", str(recipe), "--out", str(out), "--quiet", *options])
    finally:
        torch.set_num_threads(threads)


def tensor_digests(export) -> dict[str, str]:
    """sha256 of each stored tensor's bytes (packed codes, scales, everything the export holds)."""
    import torch
    from safetensors.torch import load_file

    tensors = load_file(export / "model.safetensors")
    return {k: hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy()).hexdigest() for k, t in tensors.items()}


STAGES = {
    # Wanda's input norms and GPTQ's Hessians summed across the processes, GPTQ's solves shared
    "wanda-gptq": [
        {"method": "wanda", "sparsity": 0.3},
        {"method": "gptq", "bits": 4, "group_size": 32, "act_order": True, "static_groups": True, "mse": True},
    ],
    # SparseGPT's solves shared; AWQ's 4 search batches recorded 2 + 2 and gathered, its trials and clipping
    # searches shared
    "sparsegpt-awq": [
        {"method": "sparsegpt", "sparsity": 0.3},
        {"method": "awq", "bits": 4, "group_size": 32, "search_samples": 16},
    ],
    # channel maxima reduced by max; the α search's 2 batches are all process 0's, its trials shared
    "smoothquant": [{"method": "smoothquant", "alpha_search": True}],
}


@pytest.mark.long
@pytest.mark.parametrize("stages", sorted(STAGES))
def test_two_launched_processes_write_the_export_of_one(tiny_llama_dir, tmp_path, stages):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "model": str(tiny_llama_dir),
                "data": {"source": "builtin:python-docs", "samples": 16, "seq_len": 64},
                "stages": STAGES[stages],
                "export": {"formats": ["compressed-tensors"]},
                "eval": {"text": "builtin:python-docs", "perplexity": {"seq_len": 64, "windows": 3}},
                "gates": ["ppl_ratio <= 3"],
            }
        )
    )
    launch(tmp_path, str(recipe), str(tmp_path / "two"))
    assert one_thread_run(recipe, tmp_path / "one") == 0
    two, one = (tensor_digests(tmp_path / run / "compressed-tensors") for run in ("two", "one"))
    assert two == one  # every packed code, scale and float tensor
    summaries = [s["summary"] for s in json.loads((tmp_path / "two" / "report.json").read_text())["stages"]]
    spread = [s.get("processes") for s in summaries]
    assert spread == [2] * len(STAGES[stages])
    assert all(s["calibration"] == [16, 64] for s in summaries)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".two")]  # no scratch left behind


MOE_STAGES = {
    "gptq": [{"method": "gptq", "bits": 4, "group_size": 32}],
    # each expert's mask and reconstruction on the process holding its Hessian
    "sparsegpt-gptq": [{"method": "sparsegpt", "sparsity": 0.3}, {"method": "gptq", "bits": 4, "group_size": 32}],
    # each expert's static activation scale from the maximum its Hessian's process saw
    "gptq-nvfp4-w4a4": [{"method": "gptq", "fp4": "nvfp4", "activations": "fp4"}],
}


@pytest.mark.long
@pytest.mark.parametrize("stages", sorted(MOE_STAGES))
def test_a_mixture_of_experts_spreads_its_expert_solves_and_writes_the_export_of_one(tmp_path, stages):
    """Each process holds and solves its experts' Hessians (over every process's tokens): the export is the one
    process's, every tensor."""
    from tests.conftest import _train_tokenizer
    from tests.families import save_family_model

    model = save_family_model(tmp_path / "model", "qwen3_moe", _train_tokenizer())
    recipe = gptq_recipe(tmp_path, model, MOE_STAGES[stages])
    launch(tmp_path, str(recipe), str(tmp_path / "two"))
    assert one_thread_run(recipe, tmp_path / "one") == 0
    two, one = (tensor_digests(tmp_path / run / "compressed-tensors") for run in ("two", "one"))
    assert two == one and sum(".experts." in k for k in one) >= 12
    summary = json.loads((tmp_path / "two" / "report.json").read_text())["stages"][0]["summary"]
    assert summary["processes"] == 2 and summary["moe_blocks_unfused"] >= 1


@pytest.mark.long
def test_wanda_masks_are_the_same_whichever_processes_summed_the_norms(tiny_llama_dir, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "model": str(tiny_llama_dir),
                "data": {"source": "builtin:python-docs", "samples": 16, "seq_len": 64},
                "stages": [{"method": "wanda", "sparsity": 0.3}],
                "export": {"formats": ["hf"]},
                "eval": {"text": "builtin:python-docs", "perplexity": {"seq_len": 64, "windows": 3}},
                "gates": ["ppl_ratio <= 3"],
            }
        )
    )
    launch(tmp_path, str(recipe), str(tmp_path / "two"))
    assert one_thread_run(recipe, tmp_path / "one") == 0
    from safetensors.torch import load_file

    two, one = (load_file(tmp_path / run / "hf" / "model.safetensors") for run in ("two", "one"))
    assert two.keys() == one.keys() and all(two[k].equal(one[k]) for k in one)


# Run in place of `-m lmpress.cli`: process KILL_RANK SIGKILLs itself once its layer 1 is saved (launched, the
# other goes on into layer 2 and waits there for its share of the Hessians).
KILLED_RANK = """
import os, signal, sys
from lmpress.calib.state import LayerState
from lmpress.cli import main
save_layer = LayerState.save_layer
def save_then_die(self, session, inputs, *carried, **seconds):
    save_layer(self, session, inputs, *carried, **seconds)
    if session.index == 1 and os.environ.get("RANK", "0") == os.environ["KILL_RANK"]:
        os.kill(os.getpid(), signal.SIGKILL)
LayerState.save_layer = save_then_die
sys.exit(main(sys.argv[1:]))
"""


def killed_run(tmp_path, recipe, out, launched: bool) -> subprocess.CompletedProcess:
    script = tmp_path / "killed_rank.py"
    script.write_text(KILLED_RANK)
    command = [*(TORCHRUN if launched else [sys.executable]), str(script), "run", str(recipe), "--out", str(out)]
    env = {**os.environ, "LMPRESS_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1", "KILL_RANK": "1"}
    if not launched:
        env["KILL_RANK"] = "0"
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


def gptq_recipe(tmp_path, model, stages: list[dict] | None = None) -> Path:
    """A W4 g32 GPTQ recipe (or ``stages``) over ``model`` exporting compressed-tensors, gated loosely."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "model": str(model),
                "data": {"source": "builtin:python-docs", "samples": 16, "seq_len": 64},
                "stages": stages or [{"method": "gptq", "bits": 4, "group_size": 32}],
                "export": {"formats": ["compressed-tensors"]},
                "eval": {"text": "builtin:python-docs", "perplexity": {"seq_len": 64, "windows": 3}},
                "gates": ["ppl_ratio <= 3"],
            }
        )
    )
    return recipe


def four_layer_gptq_recipe(tmp_path) -> Path:
    from tests.conftest import save_tiny_model

    return gptq_recipe(tmp_path, save_tiny_model(tmp_path / "model", "llama", num_hidden_layers=4))


@pytest.mark.long
def test_a_killed_process_stops_the_launch_and_one_process_resumes_it_to_the_unbroken_artifact(tmp_path):
    recipe = four_layer_gptq_recipe(tmp_path)
    out = tmp_path / "run"
    killed = killed_run(tmp_path, recipe, out, launched=True)
    assert killed.returncode != 0 and not out.exists()
    # the launcher names the process that died; the survivor says in one line why it stopped and what to do
    assert "exitcode  : -9" in killed.stderr and "rank      : 1 (local_rank: 1)" in killed.stderr
    said = [line for line in killed.stderr.splitlines() if line.startswith("stopped: process 0 of 2")]
    assert len(said) == 1 and said[0].endswith("run the same launch with --resume"), killed.stderr[-3000:]
    frames = [line for line in killed.stderr.splitlines() if line.lstrip().startswith('File "')]
    assert not [f for f in frames if "/lmpress/" in f], killed.stderr[-3000:]  # only the launcher's own traceback
    for state in (tmp_path / ".run.partial", tmp_path / ".run.partial-rank1"):
        assert json.loads((state / "state" / "0-gptq" / "progress.json").read_text())["done_layers"] == 2
        kept = sorted(p.name for p in (state / "state" / "0-gptq").glob("inputs_*"))
        assert kept == ["inputs_00001.safetensors", "inputs_00002.safetensors"]  # launched: the last two layers'

    # one process continues what two started: its batches from both processes' saved shares
    assert one_thread_run(recipe, out, "--resume") == 0
    launch(tmp_path, str(recipe), str(tmp_path / "unbroken"))
    report = json.loads((out / "report.json").read_text())
    assert report["stages"][0]["summary"]["resumed_at_layer"] == 2
    assert tensor_digests(out / "compressed-tensors") == tensor_digests(tmp_path / "unbroken" / "compressed-tensors")
    assert not (tmp_path / ".run.partial-rank1").exists()  # the departed process's state is removed


# Run in place of `-m lmpress.cli` by every launched process: process 1 is given 8-bit weights.
OTHER_RECIPE = """
import os, sys
from lmpress.cli import main
extra = ["--set", "stages[0].bits=8"] if os.environ["RANK"] == "1" else []
sys.exit(main(sys.argv[1:] + extra))
"""


@pytest.mark.long
def test_processes_given_different_recipes_are_refused_in_one_line(tmp_path):
    recipe = four_layer_gptq_recipe(tmp_path)
    script = tmp_path / "other_recipe.py"
    script.write_text(OTHER_RECIPE)
    env = {**os.environ, "LMPRESS_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    command = [*TORCHRUN, str(script), "run", str(recipe), "--out", str(tmp_path / "run"), "--quiet"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    said = [line for line in done.stderr.splitlines() if line.startswith("error: launched process(es) 1 of 2")]
    assert len(said) == 2, done.stderr[-3000:]  # each process says it, once, and exits 2
    assert "exitcode  : 2" in done.stderr and not (tmp_path / "run").exists()


@pytest.mark.long
def test_two_launched_processes_resume_what_one_process_started(tmp_path):
    recipe = four_layer_gptq_recipe(tmp_path)
    out = tmp_path / "run"
    assert killed_run(tmp_path, recipe, out, launched=False).returncode == -9
    assert (
        json.loads((tmp_path / ".run.partial" / "state" / "0-gptq" / "progress.json").read_text())["done_layers"] == 2
    )
    resume_in_two_to_the_unbroken_run(tmp_path, recipe, out)
    assert not (tmp_path / ".run.partial-rank1").exists()


def test_each_batch_shares_its_samples_once_and_a_batch_too_small_to_share_is_refused():
    import torch

    from lmpress.calib.ranks import rank_batch_rows

    calibration = torch.arange(22).reshape(11, 2)  # batches of 4: 4 + 4 + 3 samples
    parts = [rank_batch_rows(calibration, 4, r, 2) for r in range(2)]
    for b, batch in enumerate(calibration.split(4)):
        assert torch.cat([parts[0][b], parts[1][b]]).equal(batch)
    assert [len(p) for p in parts[0]] == [2, 2, 2] and [len(p) for p in parts[1]] == [2, 2, 1]
    check_shareable(12, 4, 4, by_rows=True)
    with pytest.raises(LmpressInputError, match="leave a batch of 3, fewer samples than the 4 launched processes"):
        check_shareable(11, 4, 4, by_rows=True)
    with pytest.raises(LmpressInputError, match="leave a batch of 2, fewer samples than the 3"):
        check_shareable(2, 8, 3, by_rows=True)


def learn_on_part(rank: int, world: int, port: int, out: str) -> None:
    """One launched process of the test below: its part of every batch, gradients summed over the gloo group."""
    import torch
    import torch.distributed as dist

    from lmpress.quantize.learned_rounding import learn_block_rounding

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        block, weights, hidden, targets = learning_problem()
        parts = [(h[rank_batches(len(h), rank, world)], t[rank_batches(len(t), rank, world)]) for h, t in
                 zip(hidden, targets, strict=True)]  # fmt: skip
        best, info = learn_block_rounding(
            block, weights, lambda i: (parts[i][0], {}), [t for _, t in parts], iterations=12, lr=0.05, seed=3,
            ranks=world,
        )  # fmt: skip
        torch.save({"v": {n: r.v for n, r in best.items()}, "info": info}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def learning_problem():
    """A two-linear block, its 4-bit weights to round and 3 batches of 5 samples with the float block's outputs."""
    import torch

    from lmpress.weights.scheme import QuantScheme

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.SiLU(), torch.nn.Linear(48, 32))
    scheme = QuantScheme(bits=4, group_size=16, symmetric=False)
    weights = {name: (block.get_submodule(name).weight.data.clone(), scheme) for name in ("0", "2")}
    hidden = [torch.randn(5, 7, 32) for _ in range(3)]
    with torch.no_grad():
        targets = [block(h) for h in hidden]
    return block, weights, hidden, targets


def test_a_learning_step_shared_by_samples_across_processes_takes_the_one_process_step(tmp_path):
    """Learned rounding across processes: each step's squared error and gradient, summed per sample in float64
    over the processes' parts of the batch, are the whole batch's bit for bit, so the steps, the kept iterate and
    its loss are the one process's."""
    import socket

    import torch
    import torch.multiprocessing as mp

    from lmpress.quantize.learned_rounding import learn_block_rounding

    block, weights, hidden, targets = learning_problem()
    best, info = learn_block_rounding(
        block, weights, lambda i: (hidden[i], {}), targets, iterations=12, lr=0.05, seed=3
    )  # fmt: skip
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(learn_on_part, args=(2, port, str(tmp_path / "part")), nprocs=2)
    for rank in range(2):
        shared = torch.load(tmp_path / f"part.{rank}")
        assert shared["info"] == info
        for name, r in best.items():
            assert torch.equal(shared["v"][name], r.v), name


def learned_recipe(tmp_path, model) -> Path:
    recipe = tmp_path / "recipe.yaml"
    stage = {"method": "learned", "bits": 4, "group_size": 32, "init": "gptq", "iterations": 30, "batch_size": 4}
    recipe.write_text(
        yaml.safe_dump(
            {
                "model": str(model),
                "data": {"source": "builtin:python-docs", "samples": 16, "seq_len": 64},
                "stages": [stage],
                "export": {"formats": ["compressed-tensors"]},
                "eval": {"text": "builtin:python-docs", "perplexity": {"seq_len": 64, "windows": 3}},
                "gates": ["ppl_ratio <= 3"],
            }
        )
    )
    return recipe


@pytest.mark.long
def test_learned_rounding_shares_each_step_batch_across_processes(tiny_llama_dir, tmp_path):
    """Two processes hold half of every batch's samples; GPTQ's start from Hessians summed over them, each step's
    error and gradient summed per sample in float64: the artifact is the one process's, every tensor bit for bit."""
    import torch
    from safetensors.torch import load_file

    recipe = learned_recipe(tmp_path, tiny_llama_dir)
    launch(tmp_path, str(recipe), str(tmp_path / "two"))
    assert one_thread_run(recipe, tmp_path / "one") == 0
    reports = {run: json.loads((tmp_path / run / "report.json").read_text()) for run in ("two", "one")}
    summary = reports["two"]["stages"][0]["summary"]
    assert summary["processes"] == 2 and summary["calibration"] == [16, 64]
    two, one = (load_file(tmp_path / run / "compressed-tensors" / "model.safetensors") for run in ("two", "one"))
    assert two.keys() == one.keys() and any(k.endswith("weight_packed") for k in one)
    assert [k for k in one if not torch.equal(two[k], one[k])] == []
    assert summary["mean_loss_ratio"] == reports["one"]["stages"][0]["summary"]["mean_loss_ratio"]


@pytest.mark.long
def test_learned_rounding_killed_in_one_process_resumes_in_two_to_the_unbroken_artifact(tmp_path):
    """One process killed after layer 1; two launched processes resume it, each cutting its part of every batch
    (and of the carried reference activations) from the one process's whole batches: the artifact of the unbroken
    one-process run, every tensor."""
    from tests.conftest import save_tiny_model

    recipe = learned_recipe(tmp_path, save_tiny_model(tmp_path / "model", "llama", num_hidden_layers=4))
    out = tmp_path / "run"
    assert killed_run(tmp_path, recipe, out, launched=False).returncode == -9
    resume_in_two_to_the_unbroken_run(tmp_path, recipe, out)


def moe_layer_session(calibration, ranks: int):
    """Layer 0 of a tiny Qwen3-MoE (the same weights in every process) with its experts unfused, on
    ``calibration``'s batches of 4, and its gate/up and down projection groups."""
    import torch
    from transformers import AutoModelForCausalLM

    from lmpress.anatomy import decoder_layers, get_anatomy, layer_linears
    from lmpress.calib.engine import capture_first_layer_inputs, expand_groups
    from lmpress.calib.moe import unfuse_experts
    from lmpress.calib.session import LayerSession
    from tests.families import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe", 64, {})).eval()
    unfuse_experts(model)
    inputs = capture_first_layer_inputs(model, calibration.split(4), torch.device("cpu"))
    layer = decoder_layers(model)[0]
    targets = {name: True for name in layer_linears(layer)}
    groups = expand_groups(get_anatomy(model), targets)
    session = LayerSession(0, layer, "model.layers.0.", targets, groups, inputs, torch.device("cpu"), ranks=ranks)
    return session, [g for g in groups if any(".experts." in n for n in g)]


def moe_calibration():
    import torch

    return torch.randint(0, 64, (20, 16), generator=torch.Generator().manual_seed(1))  # 5 batches: 3 + 2 spread


def expert_hessians_on_share(rank: int, world: int, port: int, out: str) -> None:
    """One launched process of the test below: its share of the batches, the MoE groups' Hessians."""
    import torch
    import torch.distributed as dist

    from lmpress.calib.ranks import rank_samples
    from lmpress.calib.statistics import group_hessians

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        session, groups = moe_layer_session(rank_samples(moe_calibration(), 4, rank, world), world)
        held = {}
        for group in groups:
            held |= {name: h.H for name, h in group_hessians(session, group).items()}
            held["owners"] = {**held.get("owners", {}), **session.hessian_owners}
            session.finish_group(group)
        torch.save(held, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_each_process_holds_the_hessians_of_its_own_experts_over_every_processs_tokens(tmp_path):
    """Spread over 2 processes, a MoE layer's expert down projections' Hessians are not summed in every process:
    each process holds those of the experts it solves (half of them), equal bit for bit to the one process's over
    all batches; the experts' gate/up Hessian (one input, shared) is summed as every other statistic."""
    import socket

    import torch
    import torch.multiprocessing as mp

    from lmpress.calib.statistics import group_hessians

    session, groups = moe_layer_session(moe_calibration(), 1)
    one = {}
    for group in groups:
        one |= {name: h.H for name, h in group_hessians(session, group).items()}
        session.finish_group(group)
    downs = sorted(n for n in one if n.endswith(".down_proj") and ".experts." in n)
    assert len(downs) >= 4
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(expert_hessians_on_share, args=(2, port, str(tmp_path / "held")), nprocs=2)
    held = [torch.load(tmp_path / f"held.{rank}") for rank in range(2)]
    owners = held[0].pop("owners")
    assert owners == held[1].pop("owners") and sorted(owners) == downs
    for rank, hessians in enumerate(held):
        mine = {n for n in downs if owners[n] == rank}
        assert len(mine) == len(downs) // 2  # experts of one cost: shared out evenly
        assert {n for n in hessians if n in downs} == mine  # the other process's experts: not held here
        for name, H in hessians.items():
            assert torch.equal(H, one[name]), name  # gate/up (summed) and own experts (gathered tokens) alike


def gptq_layer_on_share(rank: int, world: int, port: int, out: str) -> None:
    """One launched process (or, with ``world`` 1, the one process) of the test below: GPTQ W4 over layer 0 of
    the tiny Qwen3-MoE on its share of the batches, then the layer's outputs."""
    import torch
    import torch.distributed as dist

    from lmpress.calib.engine import process_layer
    from lmpress.calib.ranks import rank_samples
    from lmpress.quantize.gptq import GPTQConfig, GPTQMethod
    from lmpress.weights.scheme import QuantScheme

    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        session, _ = moe_layer_session(rank_samples(moe_calibration(), 4, rank, world), world)
        session.targets = dict.fromkeys(session.targets, QuantScheme(bits=4, group_size=16, symmetric=True))
        process_layer(session, [GPTQMethod(GPTQConfig(method="gptq", bits=4, group_size=16), last_reader=True)])
        experts = [n for n in session.targets if ".experts." in n]
        held = {
            "stand-ins": sorted(n for n in experts if isinstance(session.linear(n), torch.nn.Linear)),
            "owners": session.expert_owners,
            "codes": {n: q.qweight for n, q in session.quantized.items()},
            "outputs": [h.clone() for h in session.outputs().hidden],
        }
        torch.save(held, f"{out}.{rank}")
    finally:
        if world > 1:
            dist.destroy_process_group()


def test_each_process_holds_the_float_stand_ins_of_its_own_experts_and_computes_the_layer_of_one(tmp_path):
    """Spread over 2 processes, GPTQ solves each MoE expert's three linears in one process, which alone holds
    their dequantized float stand-ins for the rest of the layer; the other runs that expert from its packed codes.
    Every process holds every expert's codes, equal to the one process's, and the layer's outputs on its batches
    are the one process's, bit for bit."""
    import socket

    import torch
    import torch.multiprocessing as mp

    gptq_layer_on_share(0, 1, 0, str(tmp_path / "one"))
    one = torch.load(tmp_path / "one.0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(gptq_layer_on_share, args=(2, port, str(tmp_path / "two")), nprocs=2)
    two = [torch.load(tmp_path / f"two.{rank}") for rank in range(2)]
    owners = two[0]["owners"]
    assert owners == two[1]["owners"] and len(owners) == len(one["stand-ins"]) >= 12
    for rank, held in enumerate(two):
        mine = sorted(n for n in owners if owners[n] == rank)
        assert held["stand-ins"] == mine and len(mine) == len(owners) // 2  # an expert's three linears together
        assert {n for n in owners if n.endswith(".gate_proj") and owners[n] == rank} == {
            n.replace(".down_proj", ".gate_proj") for n in mine if n.endswith(".down_proj")
        }
        assert held["codes"].keys() == one["codes"].keys()
        assert [n for n in one["codes"] if not torch.equal(held["codes"][n], one["codes"][n])] == []
    outputs = two[0]["outputs"] + two[1]["outputs"]  # process 0 has the first 3 of the 5 batches
    assert len(outputs) == len(one["outputs"]) == 5
    assert all(torch.equal(a, b) for a, b in zip(outputs, one["outputs"], strict=True))
