"""The scaling pairs of a decoder layer that AWQ and SmoothQuant rescale: a source (a norm, or a linear whose
output channels can absorb per-channel factors) and the linears that read its output."""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from lmpress.anatomy import get_anatomy
from lmpress.calib.engine import CalibrationMethod, run_one_shot_stage
from lmpress.calib.session import LayerSession
from lmpress.quantize.awq_search import can_fold
from lmpress.registry import StageContext, calibration_method
from lmpress.weights.online_rotation import input_rotation_of


def foldable_pairs(session: LayerSession, skipped: set[str]) -> list[tuple[str, list[str]]]:
    """(source, linears) for each of the layer's scaling pairs whose linears are all targets of the stage and
    whose factors fold exactly into the source; a pair present but not foldable is added to ``skipped``."""
    found = []
    anatomy = get_anatomy(session.model)
    for prev, linears in anatomy.scaling_pairs:
        linears = list(linears)
        try:
            source = session.layer.get_submodule(prev)
            modules = [session.layer.get_submodule(n) for n in linears]
        except AttributeError:
            continue
        if not all(n in session.targets for n in linears):
            continue
        # an input rotated at run time (R4) no longer carries the channels the source's factors would scale
        rotated = any(input_rotation_of(m) is not None for m in modules)
        if rotated or not can_fold(source, modules, anatomy.rows_feeding(prev)):
            skipped.add(f"{prev} -> {', '.join(linears)}")
            continue
        found.append((prev, linears))
    return found


def run_scaling_stage(
    model: nn.Module, config: Any, ctx: StageContext, method: CalibrationMethod, skipped_pairs: str
) -> dict:
    """The pass of a scaling method (AWQ, SmoothQuant) whose ``config.rounding`` is ``rtn`` (``method`` rounds)
    or ``gptq`` (GPTQ rounds after ``method`` in the same pass); ``skipped_pairs`` introduces, in the log, the
    pairs ``method`` could not fold."""
    methods = [method] if config.rounding == "rtn" else [method, calibration_method(config.rounding, config)]
    true_sequential = config.true_sequential if config.rounding == "gptq" else False
    summary = run_one_shot_stage(model, [config], methods, config.scheme_for, ctx, true_sequential, config.batch_size)
    if method.skipped_pairs:
        logging.getLogger(type(method).__module__).info(
            "%s: %s", skipped_pairs, "; ".join(sorted(method.skipped_pairs))
        )
    return summary
