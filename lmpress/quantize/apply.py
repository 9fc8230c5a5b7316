"""Put a quantized weight into the model in place of a float nn.Linear weight."""

from __future__ import annotations

from torch import nn

from lmpress.quantize.scheme import QuantizedWeight


def apply_quantized_weight(model: nn.Module, name: str, qweight: QuantizedWeight) -> None:
    """Replace the weight of linear ``name`` with the values ``qweight`` stands for.

    The unpacked integer form is kept on the module as ``quantized_weight`` so
    exporters can write it without re-deriving scales.
    """
    linear = model.get_submodule(name)
    linear.weight.data.copy_(qweight.dequantize(linear.weight.dtype))
    linear.quantized_weight = qweight
