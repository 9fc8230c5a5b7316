"""EAGLE-3 heads in the speculators format: written as vLLM's EAGLE-3 loader reads them (names, d2t/t2d, config
keys), read back by lmpress drafting the same tokens, and a head for another target or a damaged one refused in
one line."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lmpress.errors import LmpressInputError
from lmpress.runtime.eagle3 import load_draft_head, save_draft_head
from lmpress.runtime.model import Transformer
from lmpress.runtime.speculative import SpeculativeStats, speculative_decode
from tests.runtime.conftest import tiny_hf_model
from tests.runtime.test_eagle3 import head_for
from tests.runtime.test_speculative import prompt


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    hf = tiny_hf_model("llama", num_hidden_layers=8)
    target = Transformer.from_hf(hf)
    head = head_for(target, hf, draft_vocab=64)
    head.config = dataclasses.replace(head.config, targets=("abc123",))
    out = tmp_path_factory.mktemp("head")
    save_draft_head(head, out, "runs/x/compressed-tensors", ["LlamaForCausalLM"], 3)
    return target, head, out


def test_the_files_are_what_vllms_eagle3_loader_reads(saved):
    target, head, out = saved
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["speculators_config"]["verifier"]["name_or_path"] == "runs/x/compressed-tensors"
    assert config["transformer_layer_config"]["model_type"] == "llama"
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert config["draft_vocab_size"] == 64 and config["norm_before_residual"] is True
    tensors = load_file(str(out / "model.safetensors"))
    d = target.args.dim
    assert tensors["fc.weight"].shape == (d, 3 * d)
    assert tensors["layers.0.self_attn.q_proj.weight"].shape == (target.args.n_heads * target.args.head_dim, 2 * d)
    assert tensors["lm_head.weight"].shape == (64, d)
    assert "embed_tokens.weight" not in tensors  # vLLM then shares the target's embedding
    # vLLM: target id = draft id + d2t[draft id]; t2d marks the target ids the draft vocabulary holds
    assert torch.equal(torch.arange(64) + tensors["d2t"], head.draft_tokens)
    assert tensors["t2d"].dtype == torch.bool and torch.equal(tensors["t2d"].nonzero().flatten(), head.draft_tokens)


def test_a_head_read_back_drafts_the_same_tokens(saved):
    target, head, out = saved
    loaded = load_draft_head(out, target, "abc123")
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    runs = []
    for h in (head, loaded):
        stats = SpeculativeStats()
        tokens = list(
            speculative_decode(target, prompt(), draft_head=h, max_new_tokens=24, k=3, adaptive=False, stats=stats)
        )
        runs.append((tokens, stats))
    assert runs[0] == runs[1]


def test_a_head_for_another_target_or_a_damaged_one_is_refused(saved, tmp_path):
    target, head, out = saved
    with pytest.raises(LmpressInputError, match="trained for another target"):
        load_draft_head(out, target, "other")
    other_hf = tiny_hf_model("llama", num_hidden_layers=8, vocab_size=128)
    with pytest.raises(LmpressInputError, match="this target has 128"):
        load_draft_head(out, Transformer.from_hf(other_hf), None)

    def damaged(edit_config=None, edit_tensors=None):
        folder = tmp_path / f"d{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        config = json.loads((out / "config.json").read_text())
        tensors = load_file(str(out / "model.safetensors"))
        if edit_config:
            edit_config(config)
        if edit_tensors:
            edit_tensors(tensors)
        (folder / "config.json").write_text(json.dumps(config))
        save_file(tensors, str(folder / "model.safetensors"))
        return folder

    cases = {
        "lmpress drafts with eagle3": damaged(edit_config=lambda c: c.update(speculators_model_type="medusa")),
        "no fc.weight": damaged(edit_tensors=lambda t: t.pop("fc.weight")),
        "does not fit the target's 256": damaged(edit_tensors=lambda t: t["d2t"].add_(300)),
        "disagree": damaged(edit_config=lambda c: c.update(draft_vocab_size=65)),
        "do not fit its config": damaged(
            edit_tensors=lambda t: t.update({"layers.0.mlp.up_proj.weight": torch.zeros(3, 3)})
        ),
        "reads target layers": damaged(edit_config=lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 4, 40])),
        "not a draft head": tmp_path,
    }
    for message, folder in cases.items():
        with pytest.raises(LmpressInputError, match=message):
            load_draft_head(folder, target, None)
