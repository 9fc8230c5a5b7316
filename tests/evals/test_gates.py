import math

import pytest

from lmpress.evals.gates import Gate, available_metrics, derived_metrics, evaluate_gates, parse_gate
from lmpress.evals.perplexity import PerplexityConfig


def test_available_metrics_include_relative_forms():
    names = available_metrics({"perplexity": PerplexityConfig()})
    assert {"ppl", "ppl_ratio", "ppl_delta", "nll_delta"} <= names


def test_parse_gate():
    assert parse_gate("ppl_ratio<=1.05", {"ppl_ratio"}) == Gate("ppl_ratio", "<=", 1.05)
    assert parse_gate(" top1 >= 9.5e-1 ", {"top1"}) == Gate("top1", ">=", 0.95)
    with pytest.raises(ValueError, match="not computed"):
        parse_gate("kld <= 1", {"ppl"})


def test_verdicts_and_margins():
    values = {"ppl": 21.0, **derived_metrics({"ppl": 20.0}, {"ppl": 21.0})}
    assert math.isclose(values["ppl_ratio"], 1.05) and math.isclose(values["ppl_delta"], 1.0)
    verdicts = evaluate_gates([Gate("ppl_ratio", "<=", 1.04), Gate("ppl", ">", 20), Gate("ppl_delta", "<", 2)], values)
    assert [v["passed"] for v in verdicts] == [False, True, True]
    assert math.isclose(verdicts[0]["margin"], -0.01, abs_tol=1e-12)
    assert math.isclose(verdicts[1]["margin"], 1.0)


def test_missing_or_nan_metric_fails():
    verdicts = evaluate_gates([Gate("ppl", "<=", 30), Gate("nll", "<=", 3)], {"ppl": float("nan")})
    assert not verdicts[0]["passed"] and not verdicts[1]["passed"] and verdicts[1]["value"] is None
