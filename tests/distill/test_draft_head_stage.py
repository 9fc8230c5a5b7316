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
