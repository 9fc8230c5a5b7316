import copy
import json

import pytest

from lmpress.errors import LmpressInputError
from lmpress.evals.compare import compare_runs
from tests.evals.reports import build_report


@pytest.fixture(scope="module")
def report(tiny, docs_text, tmp_path_factory):
    model, tokenizer = tiny
    return build_report(model, tokenizer, docs_text, tmp_path_factory.mktemp("store"))


def _write(tmp_path, name, report):
    run = tmp_path / name
    run.mkdir()
    (run / "report.json").write_text(json.dumps(report))
    return run


def test_side_by_side_table(report, tmp_path):
    other = copy.deepcopy(report)
    other["candidate"]["metrics"]["ppl"] = report["candidate"]["metrics"]["ppl"] + 2.5
    for protocol in other["candidate"]["protocol"].values():
        protocol["tokenizer"] = "/elsewhere/same-tokenizer"  # a path; the vocab digest is the same
    table = compare_runs(_write(tmp_path, "a", report), _write(tmp_path, "b", other))
    row = next(line for line in table.splitlines() if line.startswith("| ppl |"))
    assert row.rstrip(" |").endswith("2.5")
    assert "| kld_mean |" in table and "| passkey_accuracy |" in table and "FAIL (0/1 gates)" in table


def test_refuses_different_protocols(report, tmp_path):
    other = copy.deepcopy(report)
    other["candidate"]["protocol"]["perplexity"]["seq_len"] = 2048
    with pytest.raises(LmpressInputError, match=r"eval 'perplexity' was measured under different protocols \(seq_len"):
        compare_runs(_write(tmp_path, "a", report), _write(tmp_path, "b", other))
    other = copy.deepcopy(report)
    other["candidate"]["protocol"]["passkey"]["tokenizer_sha256"] = "0" * 64
    with pytest.raises(LmpressInputError, match="tokenizer_sha256"):
        compare_runs(_write(tmp_path, "c", report), _write(tmp_path, "d", other))


def test_missing_run_is_a_clear_error(tmp_path):
    with pytest.raises(LmpressInputError, match="no report.json"):
        compare_runs(tmp_path / "nope", tmp_path)
