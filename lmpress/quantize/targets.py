"""Which linear layers a weight-quantization stage touches, and with which scheme.

Shared by every weight quantizer (RTN, GPTQ, AWQ): ``ignore`` patterns and
per-module ``overrides`` are Python regular expressions that must match the whole
module name (``lm_head``, ``model.layers.0.mlp.down_proj``, ``.*down_proj``).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator
from torch import nn

from lmpress.errors import LmpressInputError
from lmpress.quantize.scheme import SUPPORTED_GROUP_SIZES, QuantScheme
from lmpress.registry import StageConfig, StrictConfig

Bits = Literal[2, 3, 4, 8]
GroupSize = Literal[-1, 32, 64, 128]


def _check_patterns(patterns: list[str]) -> list[str]:
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"{pattern!r} is not a valid regular expression ({e})") from e
    return patterns


class SchemeOverride(StrictConfig):
    bits: Bits | None = None
    group_size: GroupSize | None = None
    symmetric: bool | None = None


class WeightQuantConfig(StageConfig):
    """Keys every weight quantizer accepts."""

    bits: Bits = 4
    group_size: GroupSize = 128
    symmetric: bool = True
    ignore: list[str] = ["lm_head"]
    overrides: dict[str, SchemeOverride] = {}

    _ignore_ok = field_validator("ignore")(classmethod(lambda cls, v: _check_patterns(v)))

    @field_validator("overrides")
    @classmethod
    def _overrides_ok(cls, v: dict[str, SchemeOverride]) -> dict[str, SchemeOverride]:
        _check_patterns(list(v))
        return v

    def scheme_for(self, name: str) -> QuantScheme | None:
        """The scheme for module ``name``, or None when it is ignored. The first matching override wins."""
        if any(re.fullmatch(p, name) for p in self.ignore):
            return None
        scheme = {"bits": self.bits, "group_size": self.group_size, "symmetric": self.symmetric}
        for pattern, override in self.overrides.items():
            if re.fullmatch(pattern, name):
                scheme.update(override.model_dump(exclude_none=True))
                break
        return QuantScheme(**scheme)

    def planned_schemes(self) -> list[tuple[str, QuantScheme]]:
        """The stage's scheme and each override's, with the YAML path (relative to the stage) that sets it."""
        base = {"bits": self.bits, "group_size": self.group_size, "symmetric": self.symmetric}
        schemes = [("", QuantScheme(**base))]
        for pattern, override in self.overrides.items():
            schemes.append((f".overrides[{pattern!r}]", QuantScheme(**(base | override.model_dump(exclude_none=True)))))
        return schemes

    def targets(self, model: nn.Module) -> dict[str, tuple[nn.Linear, QuantScheme]]:
        """Every nn.Linear of ``model`` this stage quantizes, with its scheme."""
        found = {}
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                scheme = self.scheme_for(name)
                if scheme is not None:
                    found[name] = (module, scheme)
        return found

    def check(self, model: nn.Module) -> None:
        bad = {}
        for name, (module, scheme) in self.targets(model).items():
            if not scheme.fits(module.in_features):
                bad[name] = (module.in_features, scheme.group_size)
        if bad:
            name, (width, group) = next(iter(bad.items()))
            workable = sorted({g for g in SUPPORTED_GROUP_SIZES if all(g == -1 or w % g == 0 for w, _ in bad.values())})
            raise LmpressInputError(
                f"stage {self.method}: group_size {group} does not divide the input width of {len(bad)} "
                f"layer(s), e.g. {name} ({width}); group sizes that fit them: {workable}, "
                "or give those layers an override"
            )


# The keys of GPTQRounding that only mean something with GPTQ rounding (``rounding: gptq``).
GPTQ_ONLY_KEYS = ("damp_percent", "block_size", "act_order", "static_groups", "mse", "true_sequential")


class GPTQRounding(WeightQuantConfig):
    """The GPTQ keys, shared by ``method: gptq`` and AWQ's ``rounding: gptq``."""

    damp_percent: float = Field(0.01, gt=0, le=1)
    block_size: int = Field(128, ge=1, le=4096)
    act_order: bool = False
    static_groups: bool = False
    mse: bool = False
    true_sequential: bool = True
    batch_size: int = Field(4, ge=1, description="calibration samples per forward pass")
