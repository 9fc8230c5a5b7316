"""``method: draft_head`` in a recipe on a tiny random Llama: the head lands in OUT/draft-head (speculators
format, the export's fingerprint recorded), ``eval.speculation`` scores it with greedy output unchanged,
``lmpress generate --draft-head`` drafts with it, and misuse is refused in one line with exit 2."""

from __future__ import annotations

import json

import pytest
import yaml

from lmpress.cli import main
from lmpress.export.speculators import export_fingerprint
from tests.conftest import save_tiny_model

HEAD_STAGE = {
    "method": "draft_head",
    "prompts": 20,
    "prompt_tokens": 16,
    "new_tokens": 24,
    "draft_vocab": 128,
    "epochs": 2,
    "held_out": 4,
}


@pytest.fixture(scope="module")
def eight_layer_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-8"), "llama", num_hidden_layers=8)


def write_recipe(tmp_path, model_dir, stages, evals=None, gates=()) -> str:
    recipe = {
        "model": str(model_dir),
        "data": {"source": "builtin:python-docs", "samples": 20, "seq_len": 32},
        "stages": stages,
        "export": {"formats": ["compressed-tensors"]},
        "eval": {"text": "builtin:wikitext2:test", **(evals or {})},
        "gates": list(gates),
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


@pytest.mark.long
def test_a_run_ships_the_head_its_eval_scores_and_generate_drafts_with(eight_layer_dir, tmp_path, capsys):
    rtn = {"method": "rtn", "bits": 4, "group_size": 32, "ignore": ["lm_head"]}
    speculation = {"speculation": {"prompts": 2, "prompt_tokens": 16, "new_tokens": 12}}
    recipe = write_recipe(tmp_path, eight_layer_dir, [rtn, HEAD_STAGE], speculation, ["accept_length >= 1.0"])
    out = tmp_path / "run"
    assert main(["run", recipe, "--out", str(out), "--quiet"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["candidate"]["metrics"]["accept_length"] >= 1.0
    assert report["candidate"]["metrics"]["draft_speedup"] > 0
    assert "accept_length" not in report["baseline"]["metrics"]
    stage = report["stages"][-1]["summary"]
    assert stage["sequences"] == 20 and len(stage["held_out_step_accuracy"]) == 3
    config = json.loads((out / "draft-head" / "config.json").read_text())
    assert config["lmpress"]["targets"] == [export_fingerprint(out / "compressed-tensors")]
    assert config["speculators_config"]["verifier"]["name_or_path"] == str((out / "compressed-tensors").resolve())
    manifest = json.loads((out / "manifest.json").read_text())
    assert any(f["path"] == "draft-head/model.safetensors" for f in manifest["files"])

    capsys.readouterr()
    prompt = ["--prompt", "def main():", "--max-new-tokens", "12"]
    assert main(["generate", str(out / "compressed-tensors"), *prompt]) == 0
    plain = capsys.readouterr()
    assert main(["generate", str(out / "compressed-tensors"), *prompt, "--draft-head", str(out / "draft-head")]) == 0
    drafted = capsys.readouterr()
    assert drafted.out == plain.out and "tokens per target step" in drafted.err

    bench = ["--prompt-tokens", "8", "--new-tokens", "8", "--repeats", "1"]
    assert main(["bench", str(out / "compressed-tensors"), *bench, "--draft-head", str(out / "draft-head")]) == 0
    table = capsys.readouterr().out
    assert "EAGLE-3 head" in table and "same tokens as plain decoding" in table

    # the head refuses a target it was not trained for: the same model quantized otherwise
    other = tmp_path / "other"
    rtn_g64 = {**rtn, "group_size": 64}
    assert main(["run", write_recipe(tmp_path, eight_layer_dir, [rtn_g64]), "--out", str(other), "--quiet"]) == 0
    code = main(["generate", str(other / "compressed-tensors"), *prompt, "--draft-head", str(out / "draft-head")])
    assert code == 2 and "trained for another target" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("stages", "evals", "message"),
    [
        ([HEAD_STAGE, {"method": "rtn", "bits": 4}], {}, "make it the last stage"),
        ([], {"speculation": {}}, "add a draft_head stage"),
        ([{**HEAD_STAGE, "draft_vocab": 100000}], {}, "larger than the target's vocabulary"),
        ([{**HEAD_STAGE, "held_out": 20}], {}, "leaves none"),
    ],
)
def test_misuse_is_refused_before_any_work(eight_layer_dir, tmp_path, capsys, stages, evals, message):
    recipe = write_recipe(tmp_path, eight_layer_dir, stages, evals)
    assert main(["run", recipe, "--out", str(tmp_path / "out"), "--quiet"]) == 2
    assert message in capsys.readouterr().err


def test_outputs_may_part_only_at_a_near_tie():
    """A verifying pass reads several tokens at once: where its sums round otherwise, plain and speculative greedy
    outputs may part at a near tie of the plain decode, and nowhere else."""
    import torch

    from lmpress.evals.agreement import FLOAT32_UNIT
    from lmpress.evals.speculation import check_near_tie
    from lmpress.runtime.generate import generate
    from lmpress.runtime.model import Transformer
    from tests.runtime.conftest import tiny_hf_model

    target = Transformer.from_hf(tiny_hf_model("llama"))
    prompt = [5, 17, 33, 90]
    plain = generate(target, prompt, max_new_tokens=6)[0]
    with torch.no_grad():
        logits = target(torch.tensor([prompt + plain[:3]]), target.new_cache(1, 8))[0, -1]
    worst = int(logits.argmin())
    parted = plain[:3] + [worst, *plain[4:]]
    with pytest.raises(RuntimeError, match="not a near tie"):
        check_near_tie(target, prompt, plain, parted, FLOAT32_UNIT)
    check_near_tie(target, prompt, plain, parted, 1.0)  # a unit as coarse as the logits: any split is a tie


def test_accept_length_is_scored_at_a_fixed_draft_length(tmp_path):
    """eval.speculation's accept_length is tokens per target pass with ``k`` drafts every round (a head's mean
    acceptance length as serving engines report it); the adaptive length that ``generate`` runs is timed and
    reported beside it."""
    import torch

    from lmpress.distill.draft_head import DraftHeadTraining, capture_draft_data, draft_vocabulary, train_draft_head
    from lmpress.evals.speculation import SpeculationConfig, eval_prompts, run_speculation
    from lmpress.registry import EvalContext
    from lmpress.runtime.eagle3 import Eagle3Config, Eagle3Head, attach_draft_head
    from lmpress.runtime.model import Transformer
    from lmpress.runtime.speculative import SpeculativeStats, speculative_decode
    from tests.runtime.conftest import tiny_hf_model

    hf = tiny_hf_model("llama", num_hidden_layers=8, vocab_size=32)
    target = Transformer.from_hf(hf)
    config = Eagle3Config.for_target(target, hf.config, 24)
    prompts = torch.randint(3, 32, (48, 8), generator=torch.Generator().manual_seed(1))
    data = capture_draft_data(target, prompts, 32, config.feature_layers)
    torch.manual_seed(0)
    head = Eagle3Head(config)
    head.draft_tokens.copy_(draft_vocabulary(data.choices, 24, 32))
    train_draft_head(head, target, data, DraftHeadTraining(epochs=4, steps=3, lr=3e-3))
    attach_draft_head(hf, head)
    text = torch.randint(3, 32, (400,), generator=torch.Generator().manual_seed(2))
    ctx = EvalContext(text=None, ids=lambda: text, role="candidate", store=tmp_path)
    result = run_speculation(hf, None, SpeculationConfig(prompts=4, prompt_tokens=8, new_tokens=24, k=3), ctx)

    fixed = SpeculativeStats()
    for prompt in eval_prompts(text, 4, 8):
        list(speculative_decode(target, prompt, draft_head=head, max_new_tokens=24, k=3, adaptive=False, stats=fixed))
    assert result.metrics["accept_length"] == pytest.approx(fixed.tokens_per_step, abs=1e-9)
    assert result.metrics["accept_length"] > 1.3  # the head drafts: rounds of 3 accept some
    details = result.details["speculation"]
    assert details["k"] == 3 and details["target_passes"] == fixed.target_steps
    assert details["adaptive_tokens_per_pass"] > 1.0 and result.metrics["draft_speedup"] > 0
