"""lmpress: compress LLMs, export them, and gate them on quality against the baseline.

import lmpress
recipe = lmpress.load_recipe("recipes/quickstart.yaml")
result = lmpress.run(recipe, "runs/quickstart")          # result.exit_code, result.report
lmpress.quantize_model(model, tokenizer, method="rtn", bits=4, group_size=64)
shipped = lmpress.load_artifact("runs/quickstart/hf")   # any export lmpress writes, as a model

The names below are imported on first use, so ``import lmpress`` (and ``lmpress --help``)
pulls in neither torch nor any method.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> (module, attribute)
_EXPORTS = {
    "LmpressInputError": ("lmpress.errors", "LmpressInputError"),
    "evaluate": ("lmpress.evals.suite", "run_suite"),
    "load_artifact": ("lmpress.loader", "load_model"),
    "load_model": ("lmpress.loader", "load_model"),
    "load_recipe": ("lmpress.recipe", "load_recipe"),
    "parse_recipe": ("lmpress.recipe", "parse_recipe"),
    "quantize_model": ("lmpress.api", "quantize_model"),
    "run": ("lmpress.pipeline", "run_recipe"),
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lmpress' has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value
