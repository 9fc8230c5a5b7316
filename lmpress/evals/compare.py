"""``lmpress compare RUN_A RUN_B``: two runs' metrics side by side, when they were measured alike.

Two numbers are comparable only under the same protocol (text and its sha256,
windows, tokenizer, prompts, tasks...). For every eval both runs report, the
protocols must match, except the tokenizer's path when both carry its vocab
digest; otherwise the comparison is refused with the first difference.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lmpress.errors import LmpressInputError

IGNORED_WHEN_DIGESTED = {"tokenizer": "tokenizer_sha256"}  # a path differs where the vocab is the same


def load_report(run: str | Path) -> dict[str, Any]:
    path = Path(run)
    path = path / "report.json" if path.is_dir() else path
    if not path.exists():
        raise LmpressInputError(f"{run}: no report.json (give a run directory or its report.json)")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise LmpressInputError(f"{path}: not valid JSON ({e})") from e


def protocol_difference(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """The first setting two protocols disagree on, as ``key: A vs B``; None when they agree."""
    for key in sorted(set(a) | set(b)):
        digest = IGNORED_WHEN_DIGESTED.get(key)
        if digest and digest in a and digest in b:
            continue
        if a.get(key) != b.get(key):
            return f"{key}: {a.get(key, '<absent>')!r} vs {b.get(key, '<absent>')!r}"
    return None


def check_same_protocols(report_a: dict[str, Any], report_b: dict[str, Any]) -> None:
    protocols_a = report_a.get("candidate", {}).get("protocol", {})
    protocols_b = report_b.get("candidate", {}).get("protocol", {})
    for name in sorted(set(protocols_a) & set(protocols_b)):
        difference = protocol_difference(protocols_a[name], protocols_b[name])
        if difference:
            raise LmpressInputError(
                f"cannot compare: eval {name!r} was measured under different protocols ({difference}); "
                "re-run one of them with the other's eval settings"
            )


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def comparison_rows(report_a: dict[str, Any], report_b: dict[str, Any]) -> list[list[str]]:
    """metric | A baseline | A candidate | B baseline | B candidate | B - A (candidates)."""
    sides = [(r.get("baseline", {}).get("metrics", {}), r["candidate"]["metrics"]) for r in (report_a, report_b)]
    (base_a, cand_a), (base_b, cand_b) = sides
    rows = []
    for name in dict.fromkeys([*cand_a, *cand_b]):
        a, b = cand_a.get(name), cand_b.get(name)
        delta = b - a if isinstance(a, int | float) and isinstance(b, int | float) else None
        rows.append([name, _fmt(base_a.get(name)), _fmt(a), _fmt(base_b.get(name)), _fmt(b), _fmt(delta)])
    return rows


def _verdict(report: dict[str, Any]) -> str:
    gates = report.get("gates", [])
    passed = sum(g["passed"] for g in gates)
    return f"{'PASS' if passed == len(gates) else 'FAIL'} ({passed}/{len(gates)} gates)"


def compare_runs(run_a: str | Path, run_b: str | Path) -> str:
    """A markdown side-by-side table of two runs; LmpressInputError when their protocols differ."""
    report_a, report_b = load_report(run_a), load_report(run_b)
    if "candidate" not in report_a or "candidate" not in report_b:
        raise LmpressInputError("cannot compare: a report.json without candidate metrics (not an lmpress run report)")
    check_same_protocols(report_a, report_b)
    header = ["metric", "A baseline", "A candidate", "B baseline", "B candidate", "B - A"]
    lines = [
        f"A: {run_a} ({report_a.get('model', {}).get('source', '?')}): {_verdict(report_a)}",
        f"B: {run_b} ({report_b.get('model', {}).get('source', '?')}): {_verdict(report_b)}",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    lines += ["| " + " | ".join(row) + " |" for row in comparison_rows(report_a, report_b)]
    only = sorted(set(report_a["candidate"].get("protocol", {})) ^ set(report_b["candidate"].get("protocol", {})))
    if only:
        lines += ["", f"evals in only one run: {', '.join(only)}"]
    return "\n".join(lines) + "\n"
