"""The Python API: the same pieces the CLI uses, on in-memory models.

(``quantize_model``, not ``quantize``: ``lmpress.quantize`` is the subpackage.)
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from torch import nn

from lmpress.data import calibration_samples, load_text, tokenize
from lmpress.errors import LmpressInputError
from lmpress.placement import resolve_device
from lmpress.progress import QUIET, Bars
from lmpress.recipe import DataSpec, _validate
from lmpress.registry import StageContext, known_stages, stage_config, stage_handler_for


def quantize_model(
    model: nn.Module,
    tokenizer: Any = None,
    method: str = "rtn",
    data: DataSpec | dict | None = None,
    state_dir: str | Path | None = None,
    bars: Bars = QUIET,
    device: str = "cpu",
    **settings: Any,
) -> dict:
    """Run one stage (``rtn``, ``gptq``, ``awq``, ...) on ``model`` in place; returns its summary.

    ``settings`` are the stage's recipe keys (``bits=4, group_size=64``); calibrated
    methods need ``tokenizer`` and take their text from ``data`` (a recipe ``data:`` section);
    ``device`` (cpu | cuda | auto) is where one-shot methods compute, as a recipe's ``model.device``.
    """
    if method not in known_stages():
        raise LmpressInputError(f"unknown method {method!r} (known: {', '.join(known_stages())})")
    config = _validate(stage_config(method), {"method": method, **settings}, "quantize_model()", ())
    spec = data if isinstance(data, DataSpec) else DataSpec(**(data or {}))
    target_device = resolve_device(device, "device")

    def calibration():
        if tokenizer is None:
            raise LmpressInputError(f"method {method!r} needs calibration data: pass tokenizer=")
        ids = tokenize(tokenizer, load_text(spec.source, default_split="train"))
        return calibration_samples(ids, spec.samples, spec.seq_len, spec.seed)

    config.check(model)
    with tempfile.TemporaryDirectory() as scratch:
        ctx = StageContext(
            calibration=calibration,
            state_dir=Path(state_dir or scratch),
            resume=False,
            fingerprint="api",
            bars=bars,
            device=target_device,
        )
        ctx.state_dir.mkdir(parents=True, exist_ok=True)
        return stage_handler_for(config)(model, config, ctx)
