"""Which linear layers a weight-quantization stage touches, and with which scheme.

Shared by every weight quantizer (RTN, GPTQ, AWQ): ``ignore`` patterns and
per-module ``overrides`` are Python regular expressions that must match the whole
module name (``lm_head``, ``model.layers.0.mlp.down_proj``, ``.*down_proj``).

``k_quant_scales: true`` (bits 4, group_size 32, symmetric; layers whose input width is a
multiple of 256) puts the group scales on llama.cpp's k-quant grid, so a GGUF export stores
those layers as ``Q4_K`` bit for bit (``kquant.py``); an override can turn it off for layers
of other widths (``".*(q|k|v|o|gate|up)_proj": {k_quant_scales: false}``).
"""

from __future__ import annotations

import re
from typing import ClassVar, Literal

from pydantic import Field, model_validator
from torch import nn

from lmpress.errors import LmpressInputError
from lmpress.registry import LayerPatterns, PatternKeyed, StageConfig, StrictConfig
from lmpress.weights.kquant import SUPER_BLOCK
from lmpress.weights.scheme import FP4_GROUP_SIZES, SUPPORTED_GROUP_SIZES, QuantScheme

Bits = Literal[2, 3, 4, 8]
GroupSize = Literal[-1, 16, 32, 64, 128]  # 16: NVFP4's blocks only
Fp4Grid = Literal["nvfp4", "mxfp4"]
# An override's ``fp4: int`` puts layers back on the integer grid under an FP4 stage.
Fp4Override = Literal["nvfp4", "mxfp4", "int"]


class SchemeOverride(StrictConfig):
    bits: Bits | None = None
    group_size: GroupSize | None = None
    symmetric: bool | None = None
    k_quant_scales: bool | None = None
    fp4: Fp4Override | None = None
    activations: Literal["fp4", "int8"] | None = None


def _fp4_defaults(settings: dict[str, object], group_given: bool) -> dict[str, object]:
    """``fp4: int`` -> the integer grid; an FP4 grid without a group size of its own takes its format's block."""
    if settings.get("fp4") == "int":
        settings = settings | {"fp4": None, "activations": None}
    if settings.get("fp4") and not group_given:
        settings = settings | {"group_size": FP4_GROUP_SIZES[settings["fp4"]]}
    return settings


class WeightQuantConfig(StageConfig):
    """Keys every weight quantizer accepts."""

    bits: Bits = 4
    group_size: GroupSize = 128
    symmetric: bool = True
    k_quant_scales: bool = Field(False, description="group scales on llama.cpp's k-quant grid (GGUF Q4_K)")
    fp4: Fp4Grid | None = Field(None, description="4-bit floats: nvfp4 (blocks of 16) or mxfp4 (blocks of 32)")
    activations: Literal["fp4", "int8"] | None = Field(
        None,
        description="fp4: W4A4 (FP4 weights), activations quantized per block; int8: integer weights (W4A8, W8A8) "
        "with activations quantized to int8 per token",
    )
    ignore: LayerPatterns = ["lm_head"]
    overrides: PatternKeyed[SchemeOverride] = {}

    @model_validator(mode="after")
    def _schemes_ok(self) -> WeightQuantConfig:
        for where, settings in self._scheme_settings():
            try:
                QuantScheme(**settings)
            except ValueError as e:
                raise ValueError(f"{where.removeprefix('.')}: {e}" if where else str(e)) from e
        return self

    def _base_settings(self) -> dict[str, object]:
        settings = {
            "bits": self.bits,
            "group_size": self.group_size,
            "symmetric": self.symmetric,
            "k_quant_scales": self.k_quant_scales,
            "fp4": self.fp4,
            "activations": self.activations,
        }
        return _fp4_defaults(settings, "group_size" in self.model_fields_set)

    def _override_settings(self, override: SchemeOverride) -> dict[str, object]:
        given = override.model_dump(exclude_none=True)
        return _fp4_defaults(self._base_settings() | given, "group_size" in given)

    def _scheme_settings(self) -> list[tuple[str, dict[str, object]]]:
        """The stage's scheme settings and each override's, with the YAML path (relative to the stage)."""
        settings = [("", self._base_settings())]
        for pattern, override in self.overrides.items():
            settings.append((f".overrides[{pattern!r}]", self._override_settings(override)))
        return settings

    def scheme_for(self, name: str) -> QuantScheme | None:
        """The scheme for module ``name``, or None when it is ignored. The first matching override wins."""
        if any(re.fullmatch(p, name) for p in self.ignore):
            return None
        for pattern, override in self.overrides.items():
            if re.fullmatch(pattern, name):
                return QuantScheme(**self._override_settings(override))
        return QuantScheme(**self._base_settings())

    def planned_schemes(self) -> list[tuple[str, QuantScheme]]:
        """The stage's scheme and each override's, with the YAML path (relative to the stage) that sets it."""
        return [(where, QuantScheme(**settings)) for where, settings in self._scheme_settings()]

    def targets(self, model: nn.Module) -> dict[str, tuple[nn.Linear, QuantScheme]]:
        """Every nn.Linear of ``model`` this stage quantizes, with its scheme."""
        found = {}
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                scheme = self.scheme_for(name)
                if scheme is not None:
                    found[name] = (module, scheme)
        return found

    def quantized_linears(self, model: nn.Module) -> dict[str, tuple[nn.Linear, QuantScheme]]:
        return self.targets(model)

    def check(self, model: nn.Module) -> None:
        targets = self.targets(model)
        bad = {}
        for name, (module, scheme) in targets.items():
            if module.in_features % scheme.group_width(module.in_features):
                bad[name] = (module.in_features, scheme.group_size)
        if bad:
            name, (width, group) = next(iter(bad.items()))
            workable = sorted({g for g in SUPPORTED_GROUP_SIZES if all(g == -1 or w % g == 0 for w, _ in bad.values())})
            raise LmpressInputError(
                f"stage {self.method}: group_size {group} does not divide the input width of {len(bad)} "
                f"layer(s), e.g. {name} ({width}); group sizes that fit them: {workable}, "
                "or give those layers an override"
            )
        narrow = [n for n, (m, s) in targets.items() if s.k_quant_scales and m.in_features % SUPER_BLOCK]
        if narrow:
            raise LmpressInputError(f"stage {self.method}: {kquant_width_refusal(narrow, targets)}")


def kquant_width_refusal(narrow: list[str], targets: dict[str, tuple[nn.Linear, QuantScheme]]) -> str:
    """Why ``narrow`` layers cannot take k-quant scales, with an override that turns them off where one
    regex over the layers' last names covers them and none of the layers that fit."""
    first = targets[narrow[0]][0].in_features
    message = (
        f"k_quant_scales needs in_features divisible by {SUPER_BLOCK} (Q4_K's super-blocks); {len(narrow)} "
        f"layer(s) are not, e.g. {narrow[0]} ({first}): set k_quant_scales: false for them in an override"
    )
    leaves = sorted({n.rpartition(".")[2] for n in narrow})
    pattern = f".*({'|'.join(leaves)})" if len(leaves) > 1 else f".*{leaves[0]}"
    if all(name in narrow for name in targets if re.fullmatch(pattern, name)):
        message += f", e.g. overrides: {{'{pattern}': {{k_quant_scales: false}}}}"
    return message


def needs_input_scale(scheme: QuantScheme) -> bool:
    """NVFP4 W4A4: the activations' static per-layer global scale comes from calibration."""
    return scheme.fp4 == "nvfp4" and scheme.activations == "fp4"


# The keys of GPTQRounding that only mean something with GPTQ rounding (``rounding: gptq``).
GPTQ_ONLY_KEYS = ("damp_percent", "block_size", "act_order", "static_groups", "mse", "true_sequential")


class GPTQRounding(WeightQuantConfig):
    """The GPTQ keys, shared by ``method: gptq`` and AWQ's ``rounding: gptq``."""

    calibrates_layerwise: ClassVar[bool] = True
    spreads_across_processes: ClassVar[bool] = True  # GPTQ, AWQ, SmoothQuant

    damp_percent: float = Field(0.01, gt=0, le=1)
    block_size: int = Field(128, ge=1, le=4096)
    act_order: bool = False
    static_groups: bool = False
    mse: bool = False
    true_sequential: bool = True
    batch_size: int = Field(4, ge=1, description="calibration samples per forward pass")

    gathers_hessians: ClassVar[bool] = True  # type: ignore[assignment]  # AWQ, SmoothQuant: their rounding's

    @model_validator(mode="after")
    def _kquant_needs_contiguous_groups(self) -> GPTQRounding:
        if self.act_order and not self.static_groups and any(s.fp4 for _, s in self.planned_schemes()):
            raise ValueError(
                "fp4 with act_order: true needs static_groups: true (FP4 blocks are contiguous columns), "
                "or act_order: false"
            )
        kquant = any(scheme.k_quant_scales for _, scheme in self.planned_schemes())
        if kquant and self.act_order and not self.static_groups:
            raise ValueError(
                "k_quant_scales with act_order: true needs static_groups: true (act-order groups of permuted "
                f"columns do not lie in Q4_K's {SUPER_BLOCK}-column super-blocks), or act_order: false"
            )
        return self
