"""lmpress: compress LLMs, export them, and gate them on quality against the baseline.

import lmpress
recipe = lmpress.load_recipe("recipes/quickstart.yaml")
result = lmpress.run(recipe, "runs/quickstart")          # result.exit_code, result.report
lmpress.quantize_model(model, tokenizer, method="rtn", bits=4, group_size=64)
shipped = lmpress.load_artifact("runs/quickstart/hf")   # any export lmpress writes, as a model
"""

__version__ = "0.1.0"

from lmpress.api import quantize_model  # noqa: E402
from lmpress.errors import LmpressInputError  # noqa: E402
from lmpress.evals.suite import run_suite as evaluate  # noqa: E402
from lmpress.model import load_model  # noqa: E402
from lmpress.model import load_model as load_artifact  # noqa: E402
from lmpress.pipeline import run_recipe as run  # noqa: E402
from lmpress.recipe import load_recipe, parse_recipe  # noqa: E402

__all__ = [
    "LmpressInputError",
    "evaluate",
    "load_artifact",
    "load_model",
    "load_recipe",
    "parse_recipe",
    "quantize_model",
    "run",
]
