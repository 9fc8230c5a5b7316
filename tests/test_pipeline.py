"""End to end through the CLI on a tiny random Llama: outputs, gates, exit codes, bad input."""

import json
import math
import os

import pytest
import torch
import yaml

from lmpress.cache import sha256_file
from lmpress.cli import main
from lmpress.export.manifest import verify_manifest
from lmpress.weights.scheme import QuantScheme, quantize_weight_rtn

pytestmark = pytest.mark.usefixtures("private_cache")


def write_recipe(tmp_path, model_dir, **changes) -> str:
    recipe = {
        "model": str(model_dir),
        "data": {"source": "builtin:python-docs", "samples": 4, "seq_len": 64},
        "stages": [{"method": "rtn", "bits": 8, "group_size": 32}],
        "eval": {"text": "builtin:python-docs", "perplexity": {"seq_len": 128, "windows": 4, "batch_size": 2}},
        "gates": ["ppl_ratio <= 1.05", "ppl_delta <= 5"],
    }
    recipe.update(changes)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def reference_ppl(model, tokenizer, seq_len: int, n: int) -> float:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"][: seq_len * n]).view(n, seq_len)
    with torch.no_grad():
        logits = model(ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    return math.exp(loss.item())


def test_run_writes_model_reports_manifest_and_passes(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    umask = os.umask(0o027)
    try:
        assert main(["run", write_recipe(tmp_path, tiny_llama_dir), "--out", str(out), "--quiet"]) == 0
    finally:
        os.umask(umask)
    # every file and folder a server reads is written with the user's umask, like any other new file
    modes = {str(p.relative_to(out)): p.stat().st_mode & 0o777 for p in [out, *out.rglob("*")]}
    assert modes and {m for p, m in modes.items() if (out / p).is_file()} == {0o640}, modes
    assert {m for p, m in modes.items() if (out / p).is_dir()} == {0o750}, modes
    report = json.loads((out / "report.json").read_text())
    assert report["passed"] and [g["passed"] for g in report["gates"]] == [True, True]
    assert "| ppl |" in (out / "report.md").read_text()
    assert verify_manifest(out) == []
    manifest = json.loads((out / "manifest.json").read_text())
    assert {"hf/model.safetensors", "report.json", "report.md"} <= {f["path"] for f in manifest["files"]}
    assert manifest["recipe"]["stages"][0]["bits"] == 8 and "torch" in manifest["versions"]

    original = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert math.isclose(report["baseline"]["metrics"]["ppl"], reference_ppl(original, tokenizer, 128, 4), rel_tol=1e-4)
    exported = AutoModelForCausalLM.from_pretrained(out / "hf")
    q_proj = original.model.layers[1].self_attn.q_proj.weight
    expected = quantize_weight_rtn(q_proj, QuantScheme(8, 32, True)).dequantize()
    assert torch.equal(exported.model.layers[1].self_attn.q_proj.weight, expected)
    assert math.isclose(report["candidate"]["metrics"]["ppl"], reference_ppl(exported, tokenizer, 128, 4), rel_tol=1e-4)


def test_failed_gate_exits_1_and_says_which(tiny_llama_dir, tmp_path, capsys):
    recipe = write_recipe(tmp_path, tiny_llama_dir, stages=[{"method": "rtn", "bits": 2, "group_size": -1}])
    out = tmp_path / "run"
    # A random tiny model is near-uniform, so even W2 moves its perplexity by only ~1%.
    gates = ["--set", "gates[0]=ppl_ratio <= 1.001", "--set", "gates[1]=ppl_delta <= 0.001"]
    assert main(["run", recipe, "--out", str(out), "--quiet", *gates]) == 1
    report = json.loads((out / "report.json").read_text())
    failed = [g for g in report["gates"] if not g["passed"]]
    assert [g["gate"] for g in failed] == ["ppl_ratio <= 1.001", "ppl_delta <= 0.001"]
    assert failed[1]["margin"] < 0
    assert "Verdict: FAIL" in (out / "report.md").read_text()


def test_second_run_reuses_baseline_and_is_bit_identical(tiny_llama_dir, tmp_path):
    recipe = write_recipe(tmp_path, tiny_llama_dir)
    assert main(["run", recipe, "--out", str(tmp_path / "a"), "--quiet"]) == 0
    cached = list((tmp_path / "cache" / "baseline").glob("*/result.json"))
    assert len(cached) == 1
    stamp = cached[0].stat().st_mtime_ns
    assert main(["run", recipe, "--out", str(tmp_path / "b"), "--quiet"]) == 0
    assert cached[0].stat().st_mtime_ns == stamp
    a, b = (json.loads((tmp_path / d / "report.json").read_text()) for d in "ab")
    assert a["candidate"]["metrics"]["ppl"] == b["candidate"]["metrics"]["ppl"]
    assert sha256_file(tmp_path / "a/hf/model.safetensors") == sha256_file(tmp_path / "b/hf/model.safetensors")


def test_overwrite_replaces_only_at_the_end(tiny_llama_dir, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    recipe = write_recipe(tmp_path, tiny_llama_dir)
    assert main(["run", recipe, "--out", str(out), "--quiet"]) == 2
    assert (out / "keep.txt").read_text() == "mine"
    assert main(["run", recipe, "--out", str(out), "--quiet", "--overwrite"]) == 0
    assert not (out / "keep.txt").exists() and (out / "report.json").exists()
    assert not list(tmp_path.glob(".run.*"))


BAD_INPUT = {
    "malformed yaml": ("text", "model: [unclosed\n", "malformed YAML"),
    "unknown key": ({"colour": "red"}, None, "colour: unknown key"),
    "unknown method": ({"stages": [{"method": "quantum"}]}, None, "unknown method 'quantum'"),
    "bits 5": ({"stages": [{"method": "rtn", "bits": 5}]}, None, "stages[0].bits: 5 is not one of 2, 3, 4, 8"),
    "group size": ({"stages": [{"method": "rtn", "group_size": 64}]}, "narrow", "group_size 64 does not divide"),
    "missing model": ({"model": "/no/such/model"}, None, "model path /no/such/model does not exist"),
    "hub offline": ({"model": "lmpress-tests/not-a-repo-4821"}, None, "hub"),
    "not gguf": ({"model": "FAKE_GGUF"}, None, "is not a GGUF file"),
    "empty text": ({"eval": {"text": "EMPTY_TXT", "perplexity": {"seq_len": 64, "windows": 1}}}, None, "is empty"),
    "missing text": ({"data": {"source": "/no/such.txt"}}, None, "text file /no/such.txt does not exist"),
    "window too long": ({"eval": {"perplexity": {"seq_len": 4096}}}, None, "longer than the model's context (512)"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_exits_2_with_one_line_and_keeps_existing_output(case, tiny_llama_dir, tmp_path, capsys):
    changes, variant, message = BAD_INPUT[case]
    model_dir = tiny_llama_dir
    if variant == "narrow":
        from tests.conftest import save_tiny_model

        model_dir = save_tiny_model(tmp_path / "narrow", hidden_size=96, intermediate_size=192)
    if changes == "text":
        recipe = tmp_path / "recipe.yaml"
        recipe.write_text(variant)
    else:
        (tmp_path / "fake.gguf").write_bytes(b"not a gguf file")
        (tmp_path / "empty.txt").write_text("")
        subst = {"FAKE_GGUF": str(tmp_path / "fake.gguf"), "EMPTY_TXT": str(tmp_path / "empty.txt")}
        text = yaml.safe_dump(changes)
        for key, value in subst.items():
            text = text.replace(key, value)
        recipe = write_recipe(tmp_path, model_dir, **yaml.safe_load(text))
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    capsys.readouterr()
    assert main(["run", str(recipe), "--out", str(out), "--quiet", "--overwrite"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert (out / "keep.txt").read_text() == "mine"


def test_unexpected_error_exits_3_with_traceback(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    from lmpress.quantize.rtn import RTNConfig
    from lmpress.registry import STAGE_HANDLERS

    def broken(model, config, ctx):
        raise RuntimeError("kernel exploded")

    monkeypatch.setitem(STAGE_HANDLERS, RTNConfig, broken)
    assert main(["run", write_recipe(tmp_path, tiny_llama_dir), "--out", str(tmp_path / "r"), "--quiet"]) == 3
    assert "Traceback" in capsys.readouterr().err


def test_eval_command_compares_a_checkpoint_with_its_baseline(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", write_recipe(tmp_path, tiny_llama_dir), "--out", str(out), "--quiet"]) == 0
    run_report = json.loads((out / "report.json").read_text())
    suite = tmp_path / "suite.yaml"
    suite.write_text(
        yaml.safe_dump(
            {
                "eval": {"text": "builtin:python-docs", "perplexity": {"seq_len": 128, "windows": 4, "batch_size": 2}},
                "gates": ["ppl_ratio <= 1.05"],
            }
        )
    )
    args = ["eval", str(out / "hf"), "--suite", str(suite), "--baseline", str(tiny_llama_dir), "--quiet"]
    assert main([*args, "--out", str(tmp_path / "ev")]) == 0
    report = json.loads((tmp_path / "ev" / "report.json").read_text())
    assert report["baseline"]["metrics"]["ppl"] == run_report["baseline"]["metrics"]["ppl"]
    assert math.isclose(report["candidate"]["metrics"]["ppl"], run_report["candidate"]["metrics"]["ppl"], rel_tol=1e-5)
    assert main(["eval", str(out / "hf"), "--suite", str(tmp_path / "nope.yaml")]) == 2


def test_inspect_command_reads_a_run(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path, tiny_llama_dir, export={"formats": ["hf", "gptq"]})
    assert main(["run", recipe, "--out", str(out), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    formats = {a["format"]: a for a in info["artifacts"]}
    assert set(formats) == {"hf", "gptq"} and formats["gptq"]["bits"] == 8 and formats["gptq"]["group_size"] == 32
    assert main(["inspect", str(tmp_path / "missing")]) == 2


def test_export_format_that_cannot_hold_the_scheme_is_refused_before_work(tiny_llama_dir, tmp_path, capsys):
    recipe = write_recipe(tmp_path, tiny_llama_dir, export={"formats": ["awq"]})  # AWQ GEMM holds 4-bit only
    assert main(["run", recipe, "--out", str(tmp_path / "r"), "--quiet"]) == 2
    assert "awq" in capsys.readouterr().err.lower()
    assert not list((tmp_path / "cache").glob("baseline/*"))  # refused before the baseline eval


def test_python_api_quantize_model(tiny_llama_dir):
    import lmpress
    from lmpress.weights.qlinear import QuantizedLinear

    loaded = lmpress.load_model(str(tiny_llama_dir))
    summary = lmpress.quantize_model(loaded.model, loaded.tokenizer, method="rtn", bits=4, group_size=32)
    assert summary["quantized_layers"] == 14
    assert isinstance(loaded.model.model.layers[0].mlp.down_proj, QuantizedLinear)
    with pytest.raises(lmpress.LmpressInputError, match="unknown method"):
        lmpress.quantize_model(loaded.model, method="nope")


@pytest.mark.long
@pytest.mark.parametrize("static_groups", [False, True])
def test_a_run_says_when_vllm_will_not_load_its_export(tiny_llama_dir, tmp_path, capsys, static_groups):
    gptq = {"method": "gptq", "bits": 4, "group_size": 32, "act_order": True, "static_groups": static_groups}
    recipe = write_recipe(tmp_path, tiny_llama_dir, stages=[gptq], export={"formats": ["gptq"]})
    out = tmp_path / "run"
    assert main(["run", recipe, "--out", str(out), "--quiet"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    warnings = json.loads((out / "report.json").read_text())["consumer_warnings"]
    act_order = [w for w in warnings if "desc_act=True" in w["why"]]
    if static_groups:  # the groups stay contiguous: desc_act false, as vLLM takes it
        assert not act_order
    else:
        assert [w["format"] for w in act_order] == ["gptq"] and "static_groups: true" in act_order[0]["why"]
        assert "gptq/: vllm will not load it" in printed
        assert "will not load" in (out / "report.md").read_text()
