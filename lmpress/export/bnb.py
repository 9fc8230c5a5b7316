"""bitsandbytes checkpoints, as transformers saves and reloads them with its bitsandbytes integration.

The model holds bitsandbytes' own modules (``quantize/bnb.py``), whose state dicts are
the serialized form transformers expects: ``Linear8bitLt``: the int8 ``weight`` and its
row scales ``SCB``; ``Linear4bit``: the packed 4-bit ``weight`` with its quantization
state (``weight.absmax``, ``weight.quant_map``, with double quantization
``weight.nested_absmax`` / ``weight.nested_quant_map``, and
``weight.quant_state.bitsandbytes__nf4`` / ``__fp4``). ``config.json`` carries the stage's
``BitsAndBytesConfig`` as ``quantization_config``; ``AutoModelForCausalLM.from_pretrained``
rebuilds the same modules from it (``lmpress eval`` loads the export that way too).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from lmpress.errors import LmpressInputError
from lmpress.export.formats import refuse_fp4_layers
from lmpress.quantize.bnb import bnb_layers
from lmpress.registry import ExportFormat, register_format

FORMAT = "bitsandbytes"


def export_bitsandbytes(model: nn.Module, tokenizer: Any, out_dir: Path) -> None:
    refuse_fp4_layers(model, FORMAT)
    if not bnb_layers(model) or not getattr(model.config, "quantization_config", None):
        raise LmpressInputError(
            f"export {FORMAT}: the model has no bitsandbytes layers; add a llm_int8 or bnb_4bit stage before it"
        )
    model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


register_format(
    ExportFormat(
        name=FORMAT,
        write=export_bitsandbytes,
    )
)
