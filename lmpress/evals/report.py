"""report.json (for machines) and report.md (for people) of one run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmpress.cache import write_json_atomic, write_text_atomic


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def metric_rows(report: dict[str, Any]) -> list[list[str]]:
    """metric | baseline | candidate | delta | gate | verdict, one row per reported metric."""
    baseline, candidate = report["baseline"]["metrics"], report["candidate"]["metrics"]
    gates_by_metric: dict[str, list[dict]] = {}
    for verdict in report["gates"]:
        base_name = verdict["metric"].removesuffix("_ratio").removesuffix("_delta")
        gates_by_metric.setdefault(base_name, []).append(verdict)
    rows = []
    for name in dict.fromkeys([*baseline, *candidate]):
        base, cand = baseline.get(name), candidate.get(name)
        delta = cand - base if isinstance(base, float | int) and isinstance(cand, float | int) else None
        gates = gates_by_metric.get(name, [])
        gate_text = "<br>".join(g["gate"] for g in gates) or ""
        verdict = " ".join("pass" if g["passed"] else "**FAIL**" for g in gates)
        rows.append([name, _fmt(base), _fmt(cand), _fmt(delta), gate_text, verdict])
    return rows


def float_cache_rows(report: dict[str, Any]) -> list[list[str]]:
    """metric | baseline | the candidate on a float cache | on its quantized cache, for the metrics both have."""
    floats = report["candidate_float_cache"]["metrics"]
    baseline, candidate = report["baseline"]["metrics"], report["candidate"]["metrics"]
    return [[name, _fmt(baseline.get(name)), _fmt(value), _fmt(candidate.get(name))] for name, value in floats.items()]


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _stage_seconds(stage: dict[str, Any]) -> str:
    if "seconds_all_runs" not in stage:
        return _fmt(stage["seconds"])
    return (
        f"{_fmt(stage['seconds_all_runs'])} over every run (resumed at layer {stage['resumed_at_layer']}; "
        f"{_fmt(stage['seconds'])} in this one)"
    )


def render_markdown(report: dict[str, Any], plots: list[tuple[str, str]] = ()) -> str:
    gates = report["gates"]
    failed = [g for g in gates if not g["passed"]]
    verdict = "PASS" if not failed else "FAIL"
    parts = [
        f"# lmpress report: {report['model']['source']}",
        "",
        f"**Verdict: {verdict}** ({len(gates) - len(failed)}/{len(gates)} gates passed)",
        "",
    ]
    for g in failed:
        value = "not reported" if g["value"] is None else _fmt(g["value"])
        parts.append(f"- gate `{g['gate']}` failed: value {value}, off by {_fmt(abs(g['margin'] or 0))}")
    if report["stages"]:
        parts += ["", "## Stages", ""]
        rows = [[s["method"], s["settings"], _stage_seconds(s), _fmt(s["peak_rss_mb"])] for s in report["stages"]]
        parts.append(markdown_table(["method", "settings", "seconds", "peak RSS (MB)"], rows))
    if report.get("phases"):
        forecast = report.get("memory_forecast_phases_mb") or {}
        parts += ["", f"Other phases (the run's peak RSS: {_fmt(report['peak_rss_mb'])} MB):", ""]
        rows = [
            [name, _fmt(m["seconds"]), _fmt(m["peak_rss_mb"]), _fmt(forecast[name]) if name in forecast else ""]
            for name, m in report["phases"].items()
        ]
        if "stages" in forecast and report["stages"]:
            peak = max(s["peak_rss_mb"] for s in report["stages"])
            rows.insert(1, ["stages (their largest)", "", _fmt(peak), _fmt(forecast["stages"])])
        parts.append(markdown_table(["phase", "seconds", "peak RSS (MB)", "forecast (MB)"], rows))
    parts += ["", "## Metrics", ""]
    measured_on = report.get("measured_on") or {}
    if measured_on:
        sides = "; ".join(f"{side}: {what}" for side, what in measured_on.items() if what)
        parts += [f"Measured on {sides}.", ""]
    parts.append(markdown_table(["metric", "baseline", "candidate", "delta", "gate", "verdict"], metric_rows(report)))
    if report.get("candidate_float_cache"):
        scheme = (report.get("kv_cache") or {}).get("scheme", "the quantized cache")
        intro = f"The candidate's weights on a float KV cache beside its {scheme} (what the cache alone costs):"
        parts += ["", intro, ""]
        header = ["metric", "baseline", "weights, float cache", f"weights + {scheme}"]
        parts.append(markdown_table(header, float_cache_rows(report)))
    if report.get("export_checks"):
        parts += ["", "## Export checks", ""]
        parts.append(
            "Each export read back from disk against the in-memory candidate: weights, and perplexity on the "
            "first eval window (allowed relative change "
            f"{_fmt(report['export_checks'][0]['tolerance'])}).\n"
        )
        header = ["format", "weights", "max weight change", "window ppl (export / candidate)", "verdict"]
        rows = [
            [
                c["format"],
                c["weights"],
                _fmt(c["max_weight_change"]),
                f"{c['window_ppl']:.6g} / {c['candidate_window_ppl']:.6g}",
                "pass" if c["passed"] else "**FAIL**",
            ]
            for c in report["export_checks"]
        ]
        parts.append(markdown_table(header, rows))
    if report.get("consumer_warnings"):
        parts += ["", "## Exports a named consumer will not load", ""]
        rows = [[w["format"], w["consumer"], w["why"]] for w in report["consumer_warnings"]]
        parts.append(markdown_table(["format", "consumer", "why"], rows))
    if report.get("size_and_speed"):
        from lmpress.evals.speed import SPEED_HEADER, speed_rows

        section = report["size_and_speed"]
        settings = section["settings"]
        parts += ["", "## Size and speed", ""]
        parts.append(
            f"Decode speed on lmpress's runtime ({section['device']}, {section['rows'][0]['threads']} threads): "
            f"{settings['prompt_tokens']}-token prompt, {settings['new_tokens']} new tokens, greedy, "
            f"median of {settings['repeats']}. Size: every file in the model's directory.\n"
        )
        parts.append(markdown_table(SPEED_HEADER, speed_rows(section)))
    for title, filename in plots:
        parts += ["", f"### {title}", "", f"![{title}]({filename})"]
    if report.get("exports"):
        parts += ["", "## Exports", ""]
        rows = [[e["format"], e["path"], _fmt(e["size_mb"])] for e in report["exports"]]
        parts.append(markdown_table(["format", "directory", "size (MB)"], rows))
    parts += ["", "## Protocol", ""]
    for name, protocol in report["candidate"]["protocol"].items():
        settings = ", ".join(f"{k}={v}" for k, v in protocol.items())
        parts.append(f"- **{name}**: {settings}")
    parts.append("- perplexity is token-level (lm-eval's `wikitext` task reports word perplexity, a different number)")
    return "\n".join(parts) + "\n"


def write_report(report: dict[str, Any], out_dir: Path, plots: list[tuple[str, str]] = ()) -> None:
    write_json_atomic(out_dir / "report.json", report)
    if not plots:
        from lmpress.evals.plots import write_plots

        plots = write_plots(report, out_dir)
    write_text_atomic(out_dir / "report.md", render_markdown(report, plots))
