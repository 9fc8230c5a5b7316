"""The gate scores what ships: every export is read back, checked against the candidate, and scored."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml

from lmpress.cli import main
from lmpress.export.verify import WINDOW_PPL_TOLERANCE, check_export, compare_weights, window_ppl
from lmpress.loader import load_model
from lmpress.weights.qlinear import QuantizedLinear

FORMATS = ["gptq", "awq", "compressed-tensors", "hf"]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LMPRESS_CACHE", str(tmp_path / "cache"))


def write_recipe(tmp_path, model_dir, formats, **changes) -> str:
    recipe = {
        "model": str(model_dir),
        "stages": [{"method": "rtn", "bits": 4, "group_size": 32}],
        "export": {"formats": formats},
        "eval": {"text": "builtin:python-docs", "perplexity": {"seq_len": 128, "windows": 3, "batch_size": 3}},
        "gates": ["ppl_ratio <= 1.5"],
    }
    recipe.update(changes)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


@pytest.fixture(scope="module")
def run_all_formats(tmp_path_factory, tiny_llama_dir):
    """One run exporting every format (module-scoped: several tests read it)."""
    tmp = tmp_path_factory.mktemp("verify-run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LMPRESS_CACHE", str(tmp / "cache"))
        out = tmp / "run"
        code = main(["run", write_recipe(tmp, tiny_llama_dir, FORMATS), "--out", str(out), "--quiet"])
    return code, out, json.loads((out / "report.json").read_text())


def test_every_export_is_read_back_and_matches(run_all_formats):
    code, _, report = run_all_formats
    assert code == 0 and report["passed"]
    checks = {c["format"]: c for c in report["export_checks"]}
    assert list(checks) == FORMATS and all(c["passed"] and c["weights_match"] for c in checks.values())
    assert "scales as float16" in checks["gptq"]["weights"] and "scales as float16" in checks["awq"]["weights"]
    assert "scales as float32" in checks["compressed-tensors"]["weights"]
    assert checks["compressed-tensors"]["max_weight_change"] == 0.0
    assert "dense, dequantized" in checks["hf"]["weights"] and checks["hf"]["max_weight_change"] == 0.0
    # float16 scales move weights a little, never by more than half a float16 step of the scale times 8 codes.
    assert 0 < checks["gptq"]["max_weight_change"] < 1e-3
    for check in checks.values():
        assert check["window_ppl_change"] <= WINDOW_PPL_TOLERANCE


def test_the_eval_scores_the_first_export_as_read_back(run_all_formats, tmp_path):
    _, out, report = run_all_formats
    assert report["measured_on"]["candidate"].startswith("gptq/")
    shipped = load_model(str(out / "gptq"))
    assert any(isinstance(m, QuantizedLinear) and m.scales.dtype == torch.float16 for m in shipped.model.modules())
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = torch.tensor(shipped.tokenizer(text, add_special_tokens=False)["input_ids"][: 3 * 128]).view(3, 128)
    with torch.no_grad():
        logits = shipped.model(ids).logits
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    assert math.isclose(report["candidate"]["metrics"]["ppl"], math.exp(nll.item()), rel_tol=1e-5)
    md = (out / "report.md").read_text()
    assert "gptq/ (the export, read back from disk)" in md and "## Export checks" in md


@pytest.mark.parametrize("fmt", FORMATS)
def test_lmpress_eval_loads_every_export(run_all_formats, fmt, tmp_path):
    _, out, _ = run_all_formats
    suite = tmp_path / "suite.yaml"
    suite.write_text(yaml.safe_dump({"eval": {"perplexity": {"seq_len": 64, "windows": 1}}}))
    assert main(["eval", str(out / fmt), "--suite", str(suite), "--quiet", "--out", str(tmp_path / "e")]) == 0
    report = json.loads((tmp_path / "e" / "report.json").read_text())
    assert math.isfinite(report["candidate"]["metrics"]["ppl"])


def test_a_damaged_export_in_a_run_is_refused_by_its_manifest(run_all_formats, tmp_path, capsys):
    import shutil

    _, out, _ = run_all_formats
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    config = copy / "gptq" / "config.json"
    config.write_text(config.read_text().replace('"bits": 4', '"bits": 8'))
    assert main(["eval", str(copy / "gptq"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "config.json" in err and "manifest.json" in err and "Traceback" not in err


def test_a_writer_that_changes_codes_fails_the_run(tiny_llama_dir, tmp_path, monkeypatch):
    from lmpress.export import gptq as gptq_export

    real = gptq_export.gptq_tensors

    def off_by_one(name, qw, v1):
        if name.endswith("layers.1.mlp.down_proj"):
            qw.qweight = qw.qweight.clone()
            qw.qweight[0, 0] = (qw.qweight[0, 0] + 1) % 16
        return real(name, qw, v1)

    monkeypatch.setattr(gptq_export, "gptq_tensors", off_by_one)
    out = tmp_path / "run"
    assert main(["run", write_recipe(tmp_path, tiny_llama_dir, ["gptq", "hf"]), "--out", str(out), "--quiet"]) == 1
    report = json.loads((out / "report.json").read_text())
    checks = {c["format"]: c for c in report["export_checks"]}
    assert not checks["gptq"]["passed"] and "model.layers.1.mlp.down_proj" in checks["gptq"]["weights"]
    assert checks["hf"]["passed"]
    failed = [g for g in report["gates"] if not g["passed"]]
    assert [g["metric"] for g in failed] == ["export_gptq_window_ppl_change"]
    assert "export gptq matches the candidate" in (out / "report.md").read_text()


def test_the_window_check_catches_what_weights_cannot(tiny_llama_dir):
    """Identical weights but another norm epsilon: only the scored window shows it."""
    from lmpress.api import quantize_model

    candidate, artifact = load_model(str(tiny_llama_dir)), load_model(str(tiny_llama_dir))
    for model in (candidate.model, artifact.model):
        quantize_model(model, method="rtn", bits=4, group_size=32)
        model.model.norm.weight.data.mul_(100)  # a random tiny model is near-uniform; make its logits peaked
    window = torch.randint(0, 300, (1, 64), generator=torch.Generator().manual_seed(0))
    same = check_export("gptq", candidate.model, artifact.model, window, window_ppl(candidate.model, window))
    assert same.passed and same.window_ppl_change == 0.0
    artifact.model.model.norm.variance_epsilon = 10.0
    changed = check_export("gptq", candidate.model, artifact.model, window, window_ppl(candidate.model, window))
    assert changed.weights_match and not changed.passed and changed.window_ppl_change > WINDOW_PPL_TOLERANCE


def test_compare_weights_names_the_first_difference(tiny_llama_dir):
    from lmpress.api import quantize_model

    a, b = load_model(str(tiny_llama_dir)).model, load_model(str(tiny_llama_dir)).model
    for model in (a, b):
        quantize_model(model, method="rtn", bits=4, group_size=32)
    assert compare_weights(a, b)[0] is None
    b.model.layers[0].input_layernorm.weight.data[3] += 1e-3
    assert compare_weights(a, b)[0] == "model.layers.0.input_layernorm.weight differs from the candidate's"
    b.model.layers[0].input_layernorm.weight.data.copy_(a.model.layers[0].input_layernorm.weight)
    b.model.layers[1].self_attn.o_proj.scales.mul_(1.01)
    assert "model.layers.1.self_attn.o_proj: scales differ" in compare_weights(a, b)[0]


def test_eval_of_a_whole_run_directory_names_its_exports(run_all_formats, capsys):
    _, out, _ = run_all_formats
    assert main(["eval", str(out), "--quiet"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "it holds the exports awq, compressed-tensors, gptq, hf" in err and "Traceback" not in err
