"""The long-context, KLD and report hooks through ``lmpress eval`` and ``lmpress compare`` on tiny models."""

import json
import xml.etree.ElementTree as ET

import pytest
import yaml

from lmpress.cli import main
from tests.conftest import save_tiny_model

SUITE = {
    "eval": {
        "text": "builtin:python-docs",
        "perplexity": {"seq_len": 128, "windows": 4, "kld": {}},  # exact KLD, the default
        "passkey": {"lengths": [256, 512], "depths": [0, 1], "max_new_tokens": 2},
        "ppl_by_position": {"seq_len": 512, "documents": 1, "edges": [0, 128, 256, 512]},
    },
    "gates": ["kld_mean <= 1e-9", "top1_agreement >= 0.5", "nll_pos_256_512_delta <= 10"],
}


@pytest.fixture()
def suite_file(tmp_path, monkeypatch):
    monkeypatch.setenv("LMPRESS_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(SUITE))
    return path


def test_eval_writes_plots_junit_and_compares(tiny_llama_dir, tmp_path, suite_file):
    other = save_tiny_model(tmp_path / "other", seed=1)  # same tokenizer, other weights
    out, junit = tmp_path / "run", tmp_path / "gates.xml"
    args = ["eval", str(other), "--baseline", str(tiny_llama_dir), "--suite", str(suite_file)]
    code = main([*args, "--out", str(out), "--junit", str(junit), "--quiet"])
    assert code == 1  # kld_mean <= 1e-9 cannot hold for other weights
    report = json.loads((out / "report.json").read_text())
    assert report["candidate"]["metrics"]["kld_mean"] > 0
    assert "kld_mean" not in report["baseline"]["metrics"]
    assert "nll_pos_256_512_delta" in report["derived"] and "kld_mean_delta" not in report["derived"]
    markdown = (out / "report.md").read_text()
    for png in ("nll_by_position.png", "passkey.png", "kld_histogram.png"):
        assert (out / png).exists() and f"]({png})" in markdown
    cases = ET.parse(junit).getroot().findall("testsuite/testcase")
    assert [c.find("failure") is not None for c in cases] == [True, False, False]

    assert main(["compare", str(out), str(out)]) == 0


def test_candidate_with_other_vocabulary_is_exit_2(tiny_llama_dir, tmp_path, suite_file, capsys):
    other = save_tiny_model(tmp_path / "bigger", vocab_size=400)
    args = ["eval", str(other), "--baseline", str(tiny_llama_dir), "--suite", str(suite_file), "--quiet"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "KLD is undefined" in err and "Traceback" not in err


def test_passkey_longer_than_context_is_exit_2(tiny_llama_dir, tmp_path, suite_file, capsys):
    suite = {"eval": {"text": "builtin:python-docs", "passkey": {"lengths": [1024]}}}
    suite_file.write_text(yaml.safe_dump(suite))
    assert main(["eval", str(tiny_llama_dir), "--suite", str(suite_file), "--quiet"]) == 2
    assert "exceed the model's context of 512" in capsys.readouterr().err


def test_stride_equal_to_seq_len_is_the_non_overlapping_default(tiny_llama_dir, tmp_path, suite_file):
    metrics = []
    for stride in (None, 64):
        suite = {"eval": {"text": "builtin:python-docs", "perplexity": {"seq_len": 64, "windows": 3, "stride": stride}}}
        suite_file.write_text(yaml.safe_dump(suite))
        out = tmp_path / f"stride-{stride}"
        assert main(["eval", str(tiny_llama_dir), "--suite", str(suite_file), "--out", str(out), "--quiet"]) == 0
        report = json.loads((out / "report.json").read_text())["candidate"]
        metrics.append((report["metrics"]["ppl"], report["details"]["perplexity"]["scored_tokens"]))
    assert metrics[0] == metrics[1] and metrics[0][1] == 3 * 63


@pytest.mark.parametrize(
    ("gate", "eval_section"),
    [
        ("ppl_ratio <= 1.1", {"perplexity": {"seq_len": 64, "windows": 2}}),
        ("nll_delta <= 0.1", {"perplexity": {"seq_len": 64, "windows": 2}}),
        ("kld_mean <= 0.1", {"perplexity": {"seq_len": 64, "windows": 2, "kld": {"top_k": 8}}}),
    ],
)
def test_gate_needing_a_baseline_without_one_is_exit_2(tmp_path, suite_file, capsys, gate, eval_section):
    suite_file.write_text(yaml.safe_dump({"eval": eval_section, "gates": [gate]}))
    missing_model = tmp_path / "not-loaded"  # the check comes before the model is loaded
    assert main(["eval", str(missing_model), "--suite", str(suite_file), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"gate '{gate}' compares with a baseline; pass --baseline MODEL" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"eval:\n  perplexity: {\x89\xff", "not UTF-8 text (byte 0x89 at offset 21)"), (b"eval: [\n", "malformed YAML")],
)
def test_binary_or_malformed_suite_is_exit_2(tiny_llama_dir, suite_file, capsys, content, message):
    suite_file.write_bytes(content)
    assert main(["eval", str(tiny_llama_dir), "--suite", str(suite_file), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) <= 2
