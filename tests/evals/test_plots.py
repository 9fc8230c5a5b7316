import copy

import pytest

from lmpress.evals.plots import write_plots
from tests.evals.reports import build_report

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def report(tiny, docs_text, tmp_path_factory):
    model, tokenizer = tiny
    return build_report(model, tokenizer, docs_text, tmp_path_factory.mktemp("store"))


def test_writes_the_three_plots(report, tmp_path):
    written = write_plots(report, tmp_path)
    assert [f for _, f in written] == ["nll_by_position.png", "passkey.png", "kld_histogram.png"]
    for title, filename in written:
        data = (tmp_path / filename).read_bytes()
        assert title and data.startswith(PNG) and len(data) > 5000


def test_skips_plots_that_say_no_more_than_a_number(report, tmp_path):
    thin = copy.deepcopy(report)
    for side in ("baseline", "candidate"):
        details = thin[side]["details"]
        details["ppl_by_position"]["nll_by_position"] = details["ppl_by_position"]["nll_by_position"][:1]
        details["passkey"]["passkey_grid"] = {"lengths": [256], "depths": [0.5], "accuracy": [[1.0]]}
    del thin["candidate"]["details"]["perplexity"]["kld_histogram"]
    assert write_plots(thin, tmp_path) == []
    assert not list(tmp_path.glob("*.png"))


def test_candidate_only_report_still_plots(report, tmp_path):
    alone = copy.deepcopy(report)
    alone["baseline"] = {"metrics": {}, "details": {}, "protocol": {}}
    assert [f for _, f in write_plots(alone, tmp_path)] == ["nll_by_position.png", "passkey.png", "kld_histogram.png"]
