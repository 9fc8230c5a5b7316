"""JUnit XML with one test case per quality gate, so CI systems show gates as tests."""

from __future__ import annotations

import math
import os
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from lmpress.cache import atomic_path


def _num(value: float | None) -> str:
    return "not reported" if value is None else f"{value:.6g}"


def failure_message(gate: dict[str, Any]) -> str:
    """What failed, in one line: value, threshold, and by how much."""
    value = gate.get("value")
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f"{gate['metric']} was not reported (gate {gate['gate']})"
    margin = gate.get("margin")
    off = "" if margin is None else f", off by {abs(margin):.6g}"
    return f"{gate['metric']} = {_num(value)}, required {gate['op']} {gate['threshold']:g}{off}"


def junit_xml(gates: list[dict[str, Any]], suite: str = "lmpress.gates") -> ET.Element:
    failures = [g for g in gates if not g["passed"]]
    root = ET.Element("testsuites", name=suite, tests=str(len(gates)), failures=str(len(failures)))
    suite_el = ET.SubElement(
        root, "testsuite", name=suite, tests=str(len(gates)), failures=str(len(failures)), errors="0", skipped="0"
    )
    for gate in gates:
        case = ET.SubElement(suite_el, "testcase", classname=suite, name=gate["gate"], time="0")
        if not gate["passed"]:
            message = failure_message(gate)
            failure = ET.SubElement(case, "failure", message=message, type="GateFailed")
            failure.text = message
        else:
            ET.SubElement(case, "system-out").text = f"{gate['metric']} = {_num(gate.get('value'))}"
    return root


def write_junit(gates: list[dict[str, Any]], path: str | os.PathLike, suite: str = "lmpress.gates") -> None:
    """Write the gate verdicts (``evaluate_gates`` output) as JUnit XML at ``path``, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tree = ET.ElementTree(junit_xml(gates, suite))
    ET.indent(tree)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        tree.write(f, encoding="utf-8", xml_declaration=True)
