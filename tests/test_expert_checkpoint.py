"""Mixture-of-experts checkpoints stored one tensor per expert load as per-expert linears read in place from the
mapped files (``lmpress.expert_checkpoint``), not stacked into new memory as transformers' loader does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmpress.calib.moe import UnfusedExperts, unfuse_experts
from lmpress.calib.pages import file_mapped
from lmpress.expert_checkpoint import experts_stream
from lmpress.loader import load_model, model_skeleton
from lmpress.memory_plan import forecast_memory
from lmpress.registry import stage_config
from tests.conftest import _train_tokenizer
from tests.families import save_family_model


def expert_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p for m in model.modules() if isinstance(m, UnfusedExperts) for p in m.parameters()]


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "deepseek_v3", "mixtral"])
def test_experts_are_read_in_place_from_the_files_and_compute_what_transformers_loads(family, tmp_path):
    from transformers import AutoModelForCausalLM

    path = save_family_model(tmp_path / family, family, _train_tokenizer())
    model = load_model(str(path), "float32", fingerprint=False).model
    experts = expert_weights(model)
    assert experts and all(file_mapped(w) for w in experts)
    reference = AutoModelForCausalLM.from_pretrained(path).eval()  # its experts stacked, in new memory
    assert not expert_weights(reference)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)


def test_experts_stored_stacked_are_left_to_transformers_and_forecast_as_held(tmp_path):
    stacked = save_family_model(tmp_path / "gpt_oss", "gpt_oss", _train_tokenizer())
    per_expert = save_family_model(tmp_path / "qwen3_moe", "qwen3_moe", _train_tokenizer())
    assert not expert_weights(load_model(str(stacked), "float32", fingerprint=False).model)
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / "config.json").write_text((per_expert / "config.json").read_text())
    gptq = stage_config("gptq")(method="gptq", bits=4, group_size=32)
    weights = {}
    for path in (stacked, per_expert, config_only):
        skeleton = model_skeleton(path, weights=path != config_only)
        with torch.device("meta"):
            unfuse_experts(skeleton)
        stages = forecast_memory(skeleton, path, "float32", [gptq], 4, 32, torch.device("cpu")).phases["stages"]
        held = stages["weights"] + stages.get("float weights until quantized", 0)
        weights[path] = held, sum(p.numel() * 4 for p in skeleton.parameters())
        assert experts_stream(path, skeleton) == (path != stacked)
    held, whole = weights[stacked]
    assert held == whole  # every float weight, held when the stage begins
    streamed, whole = weights[per_expert]
    layer = max(sum(p.numel() for p in layer.parameters()) for layer in skeleton.model.layers)
    assert streamed == weights[config_only][0] == 2 * 4 * layer  # one layer's float weights and their stand-ins


# In a fresh process, loading once first so that what the loaders import is not counted.
LOAD_PEAK = """
import gc, json, sys
import psutil
from transformers import AutoModelForCausalLM
from lmpress.loader import load_model
from lmpress.memory import return_freed_memory, track_peak_rss


def load():
    if sys.argv[2] == "lmpress":
        return load_model(sys.argv[1], "float32", fingerprint=False).model
    return AutoModelForCausalLM.from_pretrained(sys.argv[1])


load()
gc.collect()
return_freed_memory()  # the first load's freed heap handed back: a baseline that does not depend on it
before = psutil.Process().memory_info().rss / 2**20
with track_peak_rss() as peak:
    model = load()
print(json.dumps(peak.mb - before))
"""


def test_loading_a_moe_checkpoint_does_not_hold_its_experts_in_memory(tmp_path):
    """transformers' loader holds every expert of every layer (stacked copies); lmpress's load reads none of them
    until a layer runs: the peak grows by less than a fifth of the experts' bytes."""
    save_moe(tmp_path)
    expert_mb = 4 * 16 * 3 * 256 * 512 * 4 / 2**20  # 96 MiB of the checkpoint's 100
    grown = {}
    for loader in ("lmpress", "transformers"):
        done = subprocess.run(
            [sys.executable, "-c", LOAD_PEAK, str(tmp_path), loader], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-2000:]
        grown[loader] = json.loads(done.stdout.strip().splitlines()[-1])
    assert grown["transformers"] > 0.9 * expert_mb  # what the test would catch: the experts copied in
    assert grown["lmpress"] < 0.2 * expert_mb, grown


def save_moe(path, experts: int = 16, layers: int = 4):
    """A Qwen3-MoE of ``layers`` x ``experts`` experts of 256 x 512 (96 MiB of float32 experts by default)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=384, hidden_size=256, intermediate_size=512, moe_intermediate_size=512, num_experts=experts,
        num_experts_per_tok=2, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    _train_tokenizer().save_pretrained(path)
    return path


def test_reading_back_a_moe_export_packs_each_block_before_the_next_is_split(tmp_path):
    """A compressed-tensors export of a MoE reads back with one block's float experts made at a time: over a
    baseline whose freed heap was handed back, the peak grows by the export's codes, one layer's float experts and
    the load's transient buffers (84-88 MiB measured), against 148-149 MiB with every block's float copies made
    before any is packed (2026-12-07; over the first load's freed heap, as this test measured before, 48-53
    against 104-109: a baseline that moved whenever a load handed its freed heap back)."""
    import lmpress
    from lmpress.registry import exporter

    loaded = load_model(str(save_moe(tmp_path / "model")), "float32", fingerprint=False)
    lmpress.quantize_model(loaded.model, method="rtn", bits=4, group_size=64, symmetric=False, ignore=["lm_head"])
    exporter("compressed-tensors")(loaded.model, loaded.tokenizer, tmp_path / "export")
    expert_mb = 4 * 16 * 3 * 256 * 512 * 4 / 2**20
    done = subprocess.run(
        [sys.executable, "-c", LOAD_PEAK, str(tmp_path / "export"), "lmpress"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    grown = json.loads(done.stdout.strip().splitlines()[-1])
    assert grown < 1.2 * expert_mb, grown  # its codes and one block of float copies (all at once: 148 MiB)


def resident_kb(path_part: str) -> tuple[int, int]:
    """(resident, mapped) kB of this process's mappings of files whose path contains ``path_part``."""
    resident = size = 0
    current = None
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if not fields[0].endswith(":"):
            current = fields[5] if len(fields) >= 6 else None
        elif current and path_part in current and fields[0] in ("Rss:", "Size:"):
            resident += int(fields[1]) if fields[0] == "Rss:" else 0
            size += int(fields[1]) if fields[0] == "Size:" else 0
    return resident, size


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps (Linux)")
def test_a_moe_layers_mapped_codes_stay_in_their_state_file_until_read(tmp_path):
    """A finished layer's packed buffers are views of its state file: a MoE layer's hundreds of small buffers
    must not come out resident when mapped (safetensors' reader made the whole file resident, layer after layer)."""
    import lmpress

    loaded = load_model(str(save_moe(tmp_path / "model", experts=32, layers=3)), "float32", fingerprint=False)
    data = {"source": "builtin:python-docs", "samples": 8, "seq_len": 64}
    lmpress.quantize_model(loaded.model, loaded.tokenizer, data=data, method="gptq", bits=4, group_size=128)
    resident, mapped = resident_kb("/layer_0")
    assert mapped > 3 * 6000  # three layers' codes, mapped
    assert resident < mapped / 5, (resident, mapped)
