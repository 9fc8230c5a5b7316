"""Decorator registries from recipe configs to the code that runs them.

A technique registers its pydantic config class under the name recipes use, and
the function that runs it under that config class:

    @register_stage("rtn")
    class RTNConfig(WeightQuantConfig): ...

    @stage_handler(RTNConfig)
    def run_rtn(model, config, ctx) -> dict: ...

Evals (``register_eval`` / ``eval_handler``) and export formats
(``register_exporter``) work the same way. ``lmpress.methods`` imports every
technique module so the registries are full before a recipe is validated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
from pydantic import BaseModel, ConfigDict

from lmpress.data import Text
from lmpress.progress import QUIET, Bars

T = TypeVar("T")


class StrictConfig(BaseModel):
    """Base of every recipe section: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class StageConfig(StrictConfig):
    """Base of one recipe stage; ``method`` names the registered technique."""

    method: str

    def check(self, model: Any) -> None:
        """Raise LmpressInputError when this stage cannot run on ``model`` (before any work)."""


class EvalConfig(StrictConfig):
    """Base of one eval in a recipe's ``eval:`` section."""

    # Metrics that exist only for a candidate (e.g. KLD against the baseline): gates use them
    # as they are; every other metric also gets NAME_delta and NAME_ratio (candidate vs baseline).
    candidate_only: ClassVar[frozenset[str]] = frozenset()

    def metric_names(self) -> list[str]:
        """Every metric this eval reports (the keys of its EvalResult.metrics)."""
        raise NotImplementedError

    def check(self, model: Any) -> None:
        """Raise LmpressInputError when this eval cannot run on ``model`` (before any work)."""


STAGE_CONFIGS: dict[str, type[StageConfig]] = {}
STAGE_HANDLERS: dict[type[StageConfig], Callable[..., dict]] = {}
EVAL_CONFIGS: dict[str, type[EvalConfig]] = {}
EVAL_HANDLERS: dict[type[EvalConfig], Callable[..., Any]] = {}
EXPORTERS: dict[str, Callable[..., None]] = {}


def _register(table: dict[str, Any], kind: str, name: str) -> Callable[[T], T]:
    def decorator(obj: T) -> T:
        if name in table and table[name] is not obj:
            raise RuntimeError(f"{kind} {name!r} is registered twice")
        table[name] = obj
        return obj

    return decorator


def register_stage(method: str) -> Callable[[type[StageConfig]], type[StageConfig]]:
    return _register(STAGE_CONFIGS, "stage method", method)


def stage_handler(config_cls: type[StageConfig]) -> Callable[[Callable], Callable]:
    def decorator(fn: Callable) -> Callable:
        STAGE_HANDLERS[config_cls] = fn
        return fn

    return decorator


def register_eval(name: str) -> Callable[[type[EvalConfig]], type[EvalConfig]]:
    return _register(EVAL_CONFIGS, "eval", name)


def eval_handler(config_cls: type[EvalConfig]) -> Callable[[Callable], Callable]:
    def decorator(fn: Callable) -> Callable:
        EVAL_HANDLERS[config_cls] = fn
        return fn

    return decorator


def register_exporter(fmt: str) -> Callable[[Callable], Callable]:
    return _register(EXPORTERS, "export format", fmt)


@dataclass
class StageContext:
    """What the pipeline hands a stage besides the model and its config."""

    calibration: Callable[[], torch.Tensor]  # (n_samples, seq_len) token ids, computed on first call
    state_dir: Path  # private to this stage; survives an interrupted run for --resume
    resume: bool
    fingerprint: str  # model + calibration data + this stage's config: resume refuses when it changed
    bars: Bars = QUIET
    device: torch.device = torch.device("cpu")


@dataclass
class EvalContext:
    """What the pipeline hands an eval: the eval text and where baseline artifacts live."""

    text: Text
    ids: Callable[[], torch.Tensor]  # the eval text as one 1-D token stream
    role: str  # "baseline" or "candidate"
    store: Path  # the baseline's artifact directory: written by the baseline, read by candidates
    bars: Bars = QUIET
    device: torch.device = torch.device("cpu")


@dataclass
class EvalResult:
    metrics: dict[str, float]  # flat numbers that gates and tables use
    details: dict[str, Any] = field(default_factory=dict)  # tables/series for reports and plots
    protocol: dict[str, Any] = field(default_factory=dict)  # everything needed to reproduce the numbers
