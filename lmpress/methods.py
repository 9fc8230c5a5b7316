"""Imports every technique, eval and export module so their registries are filled.

Add a new module here when you add a stage method, an eval or an export format.
"""

from lmpress.evals import kld, lmeval, longctx, perplexity  # noqa: F401
from lmpress.export import awq, compressed_tensors, gguf, hf, onnx  # noqa: F401
from lmpress.export import gptq as gptq_export  # noqa: F401
from lmpress.quantize import awq as awq_quantize  # noqa: F401
from lmpress.quantize import gptq, rtn  # noqa: F401
