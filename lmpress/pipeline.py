"""Run a recipe: plan checks -> load -> baseline eval -> stages -> export -> read back -> candidate eval -> gates.

Everything a run writes goes to ``.<out>.partial/`` beside ``--out`` first and is
renamed into place at the end, so an existing output directory is never half
overwritten. The partial directory keeps stage state (``state/``) between an
interrupted run and ``--resume``.

The gate scores what ships: each export is read back from disk and checked
against the in-memory candidate (``lmpress.export.verify``), and the eval suite
runs on the first listed format's artifact as read back.

Under a launcher (``accelerate launch``, ``torchrun``) only the main process does all of this;
the others run the stages up to the last distill stage, whose training they share
(``lmpress.distributed``).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmpress.cache import sha256_json
from lmpress.calib.ranks import calibration_ranks, check_same_run, check_shareable
from lmpress.data import calibration_samples, check_text_source, load_text, same_text, token_windows, tokenize
from lmpress.distributed import (
    Processes,
    last_shared_stage,
    launched_processes,
    remove_departed_states,
    stop_when_the_launcher_does,
)
from lmpress.errors import EXIT_GATE_FAILED, EXIT_PASS, LmpressInputError
from lmpress.evals.agreement import check_runtime_agreement
from lmpress.evals.perplexity import PerplexityConfig
from lmpress.evals.report import write_report
from lmpress.evals.speed import size_and_speed
from lmpress.evals.suite import baseline_identity, cache_sensitive, merged, run_suite, suite_report
from lmpress.export.formats import check_export_plan, check_recipe_exports
from lmpress.export.inspect import consumer_warnings
from lmpress.export.manifest import write_manifest
from lmpress.export.verify import ExportCheck, check_export, window_ppl
from lmpress.loader import LoadedModel, load_model, model_skeleton, resolve_checkpoint
from lmpress.memory import RunPhases, process_peak_mb, return_freed_memory, track_peak_rss
from lmpress.memory_plan import available_memory, check_fits, forecast_recipe
from lmpress.placement import (
    naming_out_of_memory,
    on_device,
    placement_guard,
    release_memory,
    resolve_device,
)
from lmpress.progress import QUIET, Bars
from lmpress.quantize.kv_attention import (
    attach_kv_quant,
    attention_configs,
    calibrate_kv_scales,
    float_cache,
    kv_cache_report,
    kv_quantized,
)
from lmpress.recipe import Recipe
from lmpress.registry import StageContext, exporter, stage_handler_for


@dataclass
class RunResult:
    exit_code: int
    out_dir: Path
    report: dict[str, Any]  # empty in a launched process other than the main one (it writes nothing)


def partial_dir(out: Path) -> Path:
    """Where a run into ``out`` writes until it is done (renamed into place at the end)."""
    return out.parent / f".{out.name}.partial"


def prepare_output(out: Path, overwrite: bool, resume: bool) -> Path:
    """Check ``out`` before any work and return the partial directory the run writes into."""
    if out.exists() and not out.is_dir():
        raise LmpressInputError(f"--out {out} exists and is not a directory")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise LmpressInputError(f"--out {out} exists and is not empty; pass --overwrite to replace it")
    partial = partial_dir(out)
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


def relocated(value: Any, partial: Path, out: Path) -> Any:
    """``value`` (a report) with every path inside ``partial`` named as it will be once renamed to ``out``."""
    if isinstance(value, dict):
        return {k: relocated(v, partial, out) for k, v in value.items()}
    if isinstance(value, list):
        return [relocated(v, partial, out) for v in value]
    if isinstance(value, str) and (value == str(partial) or value.startswith(str(partial) + "/")):
        return str(out) + value[len(str(partial)) :]
    return value


def check_plan(recipe: Recipe, model: nn.Module) -> None:
    """Everything that can be refused before work starts: stages, export formats and evals.

    ``model`` may be a skeleton on the meta device (``model_skeleton``): checks read names and shapes only.
    """
    for config in recipe.eval.evals.values():
        config.check(model)
    targets = {}
    for stage in recipe.stages:
        stage.check(model)
        targets.update(stage.quantized_linears(model))
    for fmt in recipe.export.formats:
        check_export_plan(fmt, model, targets)
    if recipe.kv_cache is not None:
        attention_configs(model)  # refuses a model whose attention lmpress cannot put a quantized cache under
        if recipe.kv_cache.rotate and "compressed-tensors" in recipe.export.formats:
            raise LmpressInputError(
                "kv_cache.rotate: a compressed-tensors export would hand vLLM rotated-key scales it cannot use "
                "(vLLM has no online rotation of queries and keys): drop rotate, or export another format"
            )


def teacher_loader(checkpoint: Path, dtype: str) -> Callable[[str | None], nn.Module]:
    """``StageContext.teacher``: the unmodified model read from disk again, or model ``source``, in CPU memory
    (the stage takes it to its compute device)."""

    def load(source: str | None) -> nn.Module:
        path = checkpoint if source is None else resolve_checkpoint(source)
        return load_model(str(path), dtype, fingerprint=False).model

    return load


@contextmanager
def stage_placement(index: int, method: str, device: torch.device, check: bool = False) -> Iterator[None]:
    """Around one stage: an out-of-memory error names the stage (and the layer or step inside it) and says how
    to go on; with ``check`` (``lmpress run --check-placement``) every forward is checked to run on ``device``;
    the device's memory is given back after."""
    advice = "free memory on it (or lower the stage's batch_size), then rerun with --resume: finished work is kept"
    guard = placement_guard(device) if check else nullcontext()
    try:
        with naming_out_of_memory(f"stage {index} ({method})", device, advice), guard:
            yield
    finally:
        release_memory(device)


def calibration_of(recipe: Recipe, tokenizer) -> Callable[[], torch.Tensor]:
    """The recipe's calibration samples ``(samples, seq_len)``, tokenized at the first call."""
    data = recipe.data

    @cache
    def calibration() -> torch.Tensor:
        ids = tokenize(tokenizer, load_text(data.source, default_split="train"))
        return calibration_samples(ids, data.samples, data.seq_len, data.seed)

    return calibration


def run_stages(
    loaded: LoadedModel,
    recipe: Recipe,
    partial: Path,
    resume: bool,
    bars: Bars,
    device: torch.device | None = None,
    stop: int | None = None,
    shared_partial: Path | None = None,
    check_placement: bool = False,
) -> list[dict]:
    """Run the recipe's stages in order (up to index ``stop``); one-shot stages compute on ``device``
    (``model.device`` resolved). ``shared_partial``: the main process's partial directory, where training
    stages of launched processes keep their common checkpoint (default: ``partial``)."""
    device = device if device is not None else resolve_device(recipe.model.device, "model.device")
    tokenizer = loaded.tokenizer
    data = recipe.data

    calibration = calibration_of(recipe, tokenizer)
    world = calibration_ranks()[1]
    if world > 1 and last_shared_stage(recipe.stages) >= 0:  # every launched process must run the same work
        stages = [s.model_dump() for s in recipe.stages]
        check_same_run(
            sha256_json({"model": loaded.fingerprint, "data": data.calibration_settings(), "stages": stages})
        )
    summaries = []
    for index, stage in enumerate(recipe.stages[: None if stop is None else stop + 1]):
        ctx = StageContext(
            calibration=calibration,
            state_dir=partial / "state" / f"{index}-{stage.method}",
            shared_state_dir=(shared_partial or partial) / "state" / f"{index}-{stage.method}",
            resume=resume,
            fingerprint=sha256_json(
                {
                    "model": loaded.fingerprint,
                    "data": data.calibration_settings(),
                    "stages": [s.model_dump() for s in recipe.stages[: index + 1]],
                    # a state computed on a GPU is not resumed on the CPU (their float sums differ)
                    **({"device": device.type} if device.type != "cpu" else {}),
                    # training across launched processes resumes with as many (a layer-wise pass with any number)
                    **({"processes": world} if world > 1 and not stage.calibrates_layerwise else {}),
                }
            ),
            bars=bars,
            device=device,
            tokenizer=tokenizer,
            text_source=data.source,
            teacher=teacher_loader(loaded.path, recipe.model.dtype),
            activations_ram_bytes=None if data.activations_ram_gb is None else int(data.activations_ram_gb * 2**30),
            spill_dir=None if data.spill_dir is None else Path(data.spill_dir).expanduser(),
        )
        ctx.state_dir.mkdir(parents=True, exist_ok=True)
        began = time.perf_counter()
        with track_peak_rss() as peak, stage_placement(index, stage.method, device, check_placement):
            summary = stage_handler_for(stage)(loaded.model, stage, ctx)
        # what the stage freed goes back to the OS before the next phase: glibc keeps freed heap pages resident
        # (after the draft-head stage 0.56 GiB, which the read-back and the runtime agreement then carried)
        return_freed_memory()
        settings = ", ".join(f"{k}={v}" for k, v in stage.model_dump(exclude={"method"}).items())
        record = {
            "method": stage.method,
            "settings": settings,
            "seconds": time.perf_counter() - began,
            "device": device.type,
            "peak_rss_mb": peak.mb,  # this stage's own peak, not the process's so far
            "summary": summary,
        }
        if isinstance(summary, dict) and "earlier_seconds" in summary:  # resumed: the earlier runs' time too
            record["resumed_at_layer"] = summary["resumed_at_layer"]
            record["seconds_all_runs"] = record["seconds"] + summary["earlier_seconds"]
        summaries.append(record)
    return summaries


def export_model(model: nn.Module, tokenizer, formats: list[str], partial: Path) -> list[dict]:
    exports = []
    for fmt in formats:
        tmp = partial / f".{fmt}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        exporter(fmt)(model, tokenizer, tmp)
        target = partial / fmt
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        size = sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
        exports.append({"format": fmt, "path": fmt, "size_mb": size / 1e6})
    return exports


def first_eval_window(recipe: Recipe, tokenizer) -> torch.Tensor:
    """The first window the eval suite scores (perplexity's, else 512 tokens of the eval text)."""
    ids = tokenize(tokenizer, load_text(recipe.eval.text))
    config = recipe.eval.evals.get("perplexity")
    if isinstance(config, PerplexityConfig):
        return config.windows_for(ids, tokenizer)[:1]
    return token_windows(ids, min(512, ids.numel()), 1)


def read_back_exports(
    loaded: LoadedModel, recipe: Recipe, partial: Path, bars: Bars
) -> tuple[list[ExportCheck], LoadedModel | None]:
    """Load each export from disk, check it against the candidate; returns the checks and the first artifact."""
    if not recipe.export.formats:
        return [], None
    window = first_eval_window(recipe, loaded.tokenizer)
    candidate_ppl = window_ppl(loaded.model, window)
    # each forward's and each read's freed buffers go back to the OS before the next read: kept by glibc, the
    # tokenized eval text and the candidate's forward alone held 1 GiB into the next load (SmolLM2, 2,048 tokens)
    return_freed_memory()
    checks, shipped = [], None
    for fmt in recipe.export.formats:
        bars.log(f"reading back {fmt}/ and checking it against the candidate")
        with bars.activity(f"reading back {fmt}/"):
            artifact = load_model(str(partial / fmt), recipe.model.dtype, fingerprint=False)
            return_freed_memory()  # the readers' buffers: 190 MiB of a W8A8 SmolLM2 export's sat under the check
            check = check_export(fmt, loaded.model, artifact.model, window, candidate_ppl)
        checks.append(check)
        if shipped is None:
            shipped = artifact
        del artifact  # only the first export is kept (it is scored); the others go as soon as they are checked
        return_freed_memory()
        if not check.passed:
            bars.log(
                f"[red]export {fmt} does not match the candidate:[/] {check.weights}; "
                f"first-window ppl {check.window_ppl:.6g} vs {check.candidate_window_ppl:.6g}"
            )
    return checks, shipped


def run_as_launched_worker(
    recipe: Recipe, path: Path, out: Path, resume: bool, processes: Processes, device: torch.device
) -> RunResult:
    """A launched process other than the main one: the stages up to the last one it shares with the main
    process (distillation's training, the calibration engine's passes), in a scratch directory of its own; it
    writes nothing else."""
    last = last_shared_stage(recipe.stages)
    if last >= 0:
        scratch = processes.scratch_dir(out)
        if not resume:
            shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True, exist_ok=True)
        loaded = load_model(str(path), recipe.model.dtype, recipe.model.revision, recipe.model.trust_remote_code)
        run_stages(loaded, recipe, scratch, resume, QUIET, device, stop=last, shared_partial=partial_dir(out))
        shutil.rmtree(scratch, ignore_errors=True)
    return RunResult(exit_code=EXIT_PASS, out_dir=out, report={})


def run_recipe(
    recipe: Recipe,
    out: str | Path,
    overwrite: bool = False,
    resume: bool = False,
    bars: Bars = QUIET,
    check_placement: bool = False,
) -> RunResult:
    """Run ``recipe`` into ``out``; the exit code says whether every gate passed. ``check_placement``: every
    forward of every stage asserts that it computes on the stage's device (a mixed-device bug fails loudly)."""
    out = Path(out)
    began = time.perf_counter()
    check_recipe_exports(recipe.stages, recipe.export.formats)
    check_text_source(recipe.data.source)
    check_text_source(recipe.eval.text)
    for stage in recipe.stages:
        for source in stage.texts():
            check_text_source(source)
        for source in stage.training_texts(recipe.data.source):
            if same_text(source, recipe.eval.text):
                raise LmpressInputError(
                    f"stage {stage.method}: text {source} is the eval text; training on it would score memorization"
                )
    spec = recipe.model
    device = resolve_device(spec.device, "model.device")
    processes = launched_processes(device)
    stop_when_the_launcher_does(processes)
    device = processes.device or device
    for stage in recipe.stages:
        stage.check_processes(processes.world)
        if stage.calibrates_layerwise and processes.world > 1:
            check_shareable(recipe.data.samples, stage.batch_size, processes.world, stage.shares_batch_rows)
    with processes.main_first():  # a GGUF source is converted once, by the main process
        path = resolve_checkpoint(spec.source, spec.revision)
    skeleton = model_skeleton(path, spec.trust_remote_code)
    check_plan(recipe, skeleton)
    forecast = forecast_recipe(recipe, skeleton, path, device, processes.world)
    del skeleton
    if not processes.is_main:
        return run_as_launched_worker(recipe, path, out, resume, processes, device)
    bars.log(forecast.describe())
    check_fits(forecast, *available_memory(device))
    partial = prepare_output(out, overwrite, resume)
    bars.log(f"loading {spec.source}")
    phases = RunPhases()
    with phases.phase("load"):
        loaded = load_model(str(path), spec.dtype, spec.revision, spec.trust_remote_code)

    evals = recipe.eval.evals
    with phases.phase("baseline eval"), on_device(device, loaded.model):  # the evals compute where the stages do
        identity = baseline_identity(loaded.fingerprint, loaded.model)
        baseline = run_suite(evals, recipe.eval.text, loaded.model, loaded.tokenizer, identity, "baseline", bars)
    stages = run_stages(loaded, recipe, partial, resume, bars, device, check_placement=check_placement)
    kv = None
    if recipe.kv_cache is not None:
        with phases.phase("kv cache calibration"), on_device(device, loaded.model):
            samples = calibration_of(recipe, loaded.tokenizer)()
            kv = calibrate_kv_scales(
                loaded.model, samples, recipe.kv_cache.scheme(), bars, rotate=recipe.kv_cache.rotate
            )
        attach_kv_quant(loaded.model, kv)  # the exports write it where their format has a place for it
    from lmpress.distill.draft_head_stage import export_draft_head  # the runtime's modules: only for a run
    from lmpress.runtime.eagle3 import attach_draft_head, draft_head_of

    with phases.phase("export"), bars.activity(f"exporting {', '.join(recipe.export.formats) or 'nothing'}"):
        exports = export_model(loaded.model, loaded.tokenizer, recipe.export.formats, partial)
        head = draft_head_of(loaded.model)
        if head is not None:
            tokens = next(s.speculative_tokens for s in recipe.stages if s.method == "draft_head")
            exports.append(export_draft_head(loaded.model, partial, out, recipe.export.formats, tokens))
        consumers = consumer_warnings({fmt: partial / fmt for fmt in recipe.export.formats})  # printed by the CLI
    with phases.phase("read-back"):
        checks, shipped = read_back_exports(loaded, recipe, partial, bars)
    agreement = None
    if shipped is not None:
        fmt = recipe.export.formats[0]
        bars.log(f"running {fmt}/ in lmpress's runtime and checking it against the evaluator")
        window = first_eval_window(recipe, shipped.tokenizer)
        with phases.phase("runtime agreement"), bars.activity(f"running {fmt}/ in lmpress's runtime"):
            agreement = check_runtime_agreement(
                fmt, partial / fmt, shipped.model, window, recipe.model.dtype, device=device, kv=kv
            )
        if not agreement.passed:
            bars.log(
                f"[red]lmpress's runtime disagrees with the evaluator on {fmt}/:[/] {agreement.as_gate()['detail']}"
            )
    if shipped is not None:
        loaded.model = None  # what is scored from here on is the artifact read back from disk
        scored, measured_on = shipped, f"{recipe.export.formats[0]}/ (the export, read back from disk)"
    else:
        scored, measured_on = loaded, "the in-memory candidate (the recipe exports nothing)"
    attach_draft_head(scored.model, head)  # eval.speculation drafts for the scored model with it
    with phases.phase("candidate eval"), on_device(device, scored.model), kv_quantized(scored.model, kv):
        candidate = run_suite(evals, recipe.eval.text, scored.model, scored.tokenizer, identity, "candidate", bars)
    float_side = cache_sensitive(evals) if kv is not None else {}
    if float_side:  # the same weights on a float cache: what the quantized cache alone costs
        bars.log("scoring the candidate once more with a float KV cache")
        with phases.phase("candidate eval, float cache"), on_device(device, scored.model), float_cache(scored.model):
            weights_only = run_suite(
                float_side, recipe.eval.text, scored.model, scored.tokenizer, identity, "candidate", bars
            )

    report = {
        "recipe": recipe.as_dict(),
        "model": {"source": spec.source, "checkpoint": str(loaded.path), "fingerprint": loaded.fingerprint},
        **suite_report(baseline, candidate, recipe.gates),
        "measured_on": {"baseline": f"{spec.source} ({spec.dtype})", "candidate": measured_on},
        "export_checks": [c.as_dict() for c in checks],
        "consumer_warnings": consumers,
        "runtime_agreement": None if agreement is None else agreement.as_dict(),
        "stages": stages,
        "exports": exports,
        "seconds": time.perf_counter() - began,
        "peak_rss_mb": process_peak_mb(),
        "phases": phases.measured,  # each phase's seconds and peak RSS (the stages': under "stages")
        "memory_forecast_mb": {k: round(v / 2**20, 1) for k, v in forecast.parts.items()},
        "memory_forecast_phases_mb": {k: round(v / 2**20, 1) for k, v in forecast.phase_bytes().items()},
        "kv_cache": None if kv is None else kv_cache_report(kv, scored.model),
    }
    if float_side:
        report["candidate_float_cache"] = {k: merged(weights_only, k) for k in ("metrics", "details")}
    if recipe.speed is not None:
        exported = [(f"{fmt}/", partial / fmt) for fmt in recipe.export.formats]
        baseline_model = (f"baseline ({spec.dtype}, as loaded)", loaded.path)
        report["size_and_speed"] = size_and_speed(baseline_model, exported, recipe.speed, bars.log)
    report["gates"] += [c.as_gate() for c in checks if not c.passed]
    if agreement is not None and not agreement.passed:
        report["gates"].append(agreement.as_gate())
    report["passed"] = all(v["passed"] for v in report["gates"])
    report = relocated(report, partial, out)  # the tokenizer each eval read is named where it will be
    write_report(report, partial)
    metrics = {side: report[side]["metrics"] for side in ("baseline", "candidate")}
    write_manifest(partial, recipe.as_dict(), metrics)
    finalize_output(partial, out)
    remove_departed_states(partial, processes.world)
    code = EXIT_PASS if report["passed"] else EXIT_GATE_FAILED
    return RunResult(exit_code=code, out_dir=out, report=report)
