"""Which linear layers a pruning stage touches, with which sparsity and pattern.

Shared by magnitude, Wanda and SparseGPT. ``sparsity`` is the fraction of weights
set to zero; ``pattern`` is ``unstructured`` or ``N:M`` (N weights kept in every M
consecutive weights of a row along the input axis: ``2:4``, ``4:8``).
``overrides`` give modules matching a regex (the whole module name) their own
sparsity or pattern, the first match winning; ``ignore`` leaves modules dense.
Only the linears of decoder layers are pruned.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pydantic import Field, field_validator, model_validator
from torch import nn

from lmpress.anatomy import decoder_layers, get_anatomy, layer_linears
from lmpress.errors import LmpressInputError
from lmpress.registry import LayerPatterns, PatternKeyed, StageConfig, StrictConfig
from lmpress.weights.scheme import QuantScheme

_PATTERN = re.compile(r"^(unstructured|(\d+):(\d+))$")


@dataclass(frozen=True)
class PruneTarget:
    """How one linear is pruned: ``n`` of every ``m`` weights kept, or a fraction ``sparsity`` zeroed."""

    sparsity: float
    n: int | None = None
    m: int | None = None
    scheme: QuantScheme | None = None  # quantized in the same pass (SparseGPT + GPTQ rounding)

    @property
    def structured_nm(self) -> bool:
        return self.m is not None


def _check_pattern(pattern: str) -> str:
    match = _PATTERN.match(pattern)
    if match is None:
        raise ValueError(f"pattern {pattern!r} is neither 'unstructured' nor N:M (such as '2:4', '4:8')")
    if match.group(2) is not None:
        n, m = int(match.group(2)), int(match.group(3))
        if not 0 < n < m:
            raise ValueError(f"pattern {pattern}: N:M keeps N of every M weights, so 0 < N < M (as in 2:4)")
    return pattern


class PruneOverride(StrictConfig):
    sparsity: float | None = Field(None, ge=0, lt=1)
    pattern: str | None = None

    _pattern_ok = field_validator("pattern")(classmethod(lambda cls, v: v if v is None else _check_pattern(v)))


class PruneConfig(StageConfig):
    """Keys every unstructured / N:M pruning method accepts."""

    sparsity: float = Field(0.5, ge=0, lt=1, description="fraction of weights set to zero (unstructured)")
    pattern: str = "unstructured"
    ignore: LayerPatterns = []
    overrides: PatternKeyed[PruneOverride] = {}

    _pattern_ok = field_validator("pattern")(classmethod(lambda cls, v: _check_pattern(v)))

    @model_validator(mode="after")
    def _sparsity_or_pattern(self) -> PruneConfig:
        if self.pattern != "unstructured" and "sparsity" in self.model_fields_set:
            raise ValueError(f"sparsity does not apply to pattern {self.pattern} (N:M fixes it at 1 - N/M)")
        return self

    def target_for(self, name: str) -> PruneTarget | None:
        """How module ``name`` is pruned, or None when it is ignored. The first matching override wins."""
        if any(re.fullmatch(p, name) for p in self.ignore):
            return None
        sparsity, pattern = self.sparsity, self.pattern
        for regex, override in self.overrides.items():
            if re.fullmatch(regex, name):
                sparsity = sparsity if override.sparsity is None else override.sparsity
                pattern = pattern if override.pattern is None else override.pattern
                break
        if pattern == "unstructured":
            return PruneTarget(sparsity) if sparsity > 0 else None
        n, m = (int(v) for v in pattern.split(":"))
        return PruneTarget(1 - n / m, n, m)

    def targets(self, model: nn.Module) -> dict[str, tuple[nn.Linear, PruneTarget]]:
        """Every linear of the decoder layers this stage prunes, with how."""
        prefix = get_anatomy(model).layers
        found = {}
        for index, layer in enumerate(decoder_layers(model)):
            for name, module in layer_linears(layer).items():
                full = f"{prefix}.{index}.{name}"
                target = self.target_for(full)
                if target is not None:
                    found[full] = (module, target)
        return found

    def check(self, model: nn.Module) -> None:
        for name, (module, target) in self.targets(model).items():
            if target.structured_nm and module.in_features % target.m:
                raise LmpressInputError(
                    f"stage {self.method}: pattern {target.n}:{target.m}: M={target.m} does not divide the input "
                    f"width of {name} ({module.in_features}); pick an M that divides it, or ignore that layer"
                )
