"""Run a recipe: load -> baseline eval -> stages -> export -> candidate eval -> gates -> report.

Everything a run writes goes to ``.<out>.partial/`` beside ``--out`` first and is
renamed into place at the end, so an existing output directory is never half
overwritten. The partial directory keeps stage state (``state/``) between an
interrupted run and ``--resume``.
"""

from __future__ import annotations

import resource
import shutil
import sys
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from torch import nn

from lmpress.cache import sha256_json
from lmpress.data import calibration_samples, check_text_source, load_text, tokenize
from lmpress.errors import EXIT_GATE_FAILED, EXIT_PASS, LmpressInputError
from lmpress.evals.report import write_report
from lmpress.evals.suite import run_suite, suite_report
from lmpress.export.checkpoint import check_export_plan
from lmpress.export.manifest import write_manifest
from lmpress.model import LoadedModel, load_model
from lmpress.progress import QUIET, Bars
from lmpress.quantize.targets import WeightQuantConfig
from lmpress.recipe import Recipe
from lmpress.registry import EXPORTERS, STAGE_HANDLERS, StageContext


@dataclass
class RunResult:
    exit_code: int
    out_dir: Path
    report: dict[str, Any]


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024


def prepare_output(out: Path, overwrite: bool, resume: bool) -> Path:
    """Check ``out`` before any work and return the partial directory the run writes into."""
    if out.exists() and not out.is_dir():
        raise LmpressInputError(f"--out {out} exists and is not a directory")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise LmpressInputError(f"--out {out} exists and is not empty; pass --overwrite to replace it")
    partial = out.parent / f".{out.name}.partial"
    if partial.exists() and not resume:
        shutil.rmtree(partial)
    partial.mkdir(parents=True, exist_ok=True)
    return partial


def finalize_output(partial: Path, out: Path) -> None:
    shutil.rmtree(partial / "state", ignore_errors=True)
    if out.exists():
        old = out.parent / f".{out.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        partial.rename(out)
        shutil.rmtree(old)
    else:
        partial.rename(out)


def check_plan(recipe: Recipe, model: nn.Module) -> None:
    """Everything that can be refused before work starts: stage settings and export formats."""
    targets = {}
    for stage in recipe.stages:
        stage.check(model)
        if isinstance(stage, WeightQuantConfig):
            targets.update(stage.targets(model))
    for fmt in recipe.export.formats:
        check_export_plan(fmt, model, targets)


def run_stages(loaded: LoadedModel, recipe: Recipe, partial: Path, resume: bool, bars: Bars) -> list[dict]:
    tokenizer = loaded.tokenizer
    data = recipe.data

    @cache
    def calibration():
        ids = tokenize(tokenizer, load_text(data.source, default_split="train"))
        return calibration_samples(ids, data.samples, data.seq_len, data.seed)

    summaries = []
    for index, stage in enumerate(recipe.stages):
        ctx = StageContext(
            calibration=calibration,
            state_dir=partial / "state" / f"{index}-{stage.method}",
            resume=resume,
            fingerprint=sha256_json(
                {
                    "model": loaded.fingerprint,
                    "data": data.model_dump(),
                    "stages": [s.model_dump() for s in recipe.stages[: index + 1]],
                }
            ),
            bars=bars,
        )
        ctx.state_dir.mkdir(parents=True, exist_ok=True)
        began = time.perf_counter()
        summary = STAGE_HANDLERS[type(stage)](loaded.model, stage, ctx)
        settings = ", ".join(f"{k}={v}" for k, v in stage.model_dump(exclude={"method"}).items())
        summaries.append(
            {
                "method": stage.method,
                "settings": settings,
                "seconds": time.perf_counter() - began,
                "peak_rss_mb": peak_rss_mb(),
                "summary": summary,
            }
        )
    return summaries


def export_model(model: nn.Module, tokenizer, formats: list[str], partial: Path) -> list[dict]:
    exports = []
    for fmt in formats:
        tmp = partial / f".{fmt}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        EXPORTERS[fmt](model, tokenizer, tmp)
        target = partial / fmt
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        size = sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
        exports.append({"format": fmt, "path": fmt, "size_mb": size / 1e6})
    return exports


def run_recipe(
    recipe: Recipe, out: str | Path, overwrite: bool = False, resume: bool = False, bars: Bars = QUIET
) -> RunResult:
    """Run ``recipe`` into ``out``; the exit code says whether every gate passed."""
    out = Path(out)
    began = time.perf_counter()
    check_text_source(recipe.data.source)
    check_text_source(recipe.eval.text)
    partial = prepare_output(out, overwrite, resume)
    spec = recipe.model
    bars.log(f"loading {spec.source}")
    loaded = load_model(spec.source, spec.dtype, spec.revision, spec.trust_remote_code)
    check_plan(recipe, loaded.model)
    for config in recipe.eval.evals.values():
        config.check(loaded.model)

    evals = recipe.eval.evals
    baseline = run_suite(evals, recipe.eval.text, loaded.model, loaded.tokenizer, loaded.fingerprint, "baseline", bars)
    stages = run_stages(loaded, recipe, partial, resume, bars)
    exports = export_model(loaded.model, loaded.tokenizer, recipe.export.formats, partial)
    candidate = run_suite(
        evals, recipe.eval.text, loaded.model, loaded.tokenizer, loaded.fingerprint, "candidate", bars
    )

    report = {
        "recipe": recipe.as_dict(),
        "model": {"source": spec.source, "checkpoint": str(loaded.path), "fingerprint": loaded.fingerprint},
        **suite_report(baseline, candidate, recipe.gates),
        "stages": stages,
        "exports": exports,
        "seconds": time.perf_counter() - began,
        "peak_rss_mb": peak_rss_mb(),
    }
    write_report(report, partial)
    metrics = {side: report[side]["metrics"] for side in ("baseline", "candidate")}
    write_manifest(partial, recipe.as_dict(), metrics)
    finalize_output(partial, out)
    code = EXIT_PASS if report["passed"] else EXIT_GATE_FAILED
    return RunResult(exit_code=code, out_dir=out, report=report)
