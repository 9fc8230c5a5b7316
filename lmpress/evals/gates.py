"""Quality gates: thresholds on reported metrics, absolute or relative to the baseline.

gates:
  - ppl <= 25               # the candidate's value
  - ppl_ratio <= 1.05       # candidate / baseline
  - ppl_delta <= 0.5        # candidate - baseline
  - kld_mean <= 0.02        # candidate-only metrics (no baseline value) as they are
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from typing import Any

from lmpress.registry import EvalConfig

OPERATORS = {"<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt, "==": operator.eq}
_GATE = re.compile(r"^\s*([A-Za-z_][\w]*)\s*(<=|>=|==|<|>)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")
RELATIVE = ("_ratio", "_delta")


@dataclass(frozen=True)
class Gate:
    metric: str
    op: str
    threshold: float

    def __str__(self) -> str:
        return f"{self.metric} {self.op} {self.threshold:g}"


def available_metrics(evals: dict[str, EvalConfig]) -> set[str]:
    """Every name a gate may use with this eval suite."""
    names: set[str] = set()
    for config in evals.values():
        for metric in config.metric_names():
            names.add(metric)
            if metric not in config.candidate_only:
                names.update(metric + suffix for suffix in RELATIVE)
    return names


def parse_gate(text: str, metrics: set[str]) -> Gate:
    match = _GATE.match(text)
    if not match:
        raise ValueError(
            f"{text!r} is not a gate; write METRIC OP NUMBER, e.g. 'ppl_ratio <= 1.05' (OP: <=, <, >=, >, ==)"
        )
    metric, op, number = match.groups()
    if metric not in metrics:
        available = ", ".join(sorted(metrics)) or "none: the eval section is empty"
        raise ValueError(f"metric {metric!r} is not computed by this eval suite (available: {available})")
    return Gate(metric, op, float(number))


def derived_metrics(baseline: dict[str, float], candidate: dict[str, float]) -> dict[str, float]:
    """``NAME_delta`` and ``NAME_ratio`` for every metric both sides report."""
    derived = {}
    for name, value in candidate.items():
        if name in baseline:
            base = baseline[name]
            derived[name + "_delta"] = value - base
            derived[name + "_ratio"] = value / base if base != 0 else math.inf
    return derived


def evaluate_gates(gates: list[Gate], values: dict[str, float]) -> list[dict[str, Any]]:
    """One verdict per gate: value, threshold, passed, and the margin (how far inside/outside)."""
    verdicts = []
    for gate in gates:
        value = values.get(gate.metric)
        passed = value is not None and not math.isnan(value) and OPERATORS[gate.op](value, gate.threshold)
        margin = (
            None if value is None else (gate.threshold - value if gate.op in ("<=", "<") else value - gate.threshold)
        )
        verdicts.append(
            {
                "gate": str(gate),
                "metric": gate.metric,
                "op": gate.op,
                "threshold": gate.threshold,
                "value": value,
                "passed": bool(passed),
                "margin": margin,
            }
        )
    return verdicts
