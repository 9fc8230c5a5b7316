"""Put a quantized weight into the model in place of a float nn.Linear."""

from __future__ import annotations

from torch import nn

from lmpress.weights.float8 import Fp8Linear, Fp8Weight
from lmpress.weights.fp4 import Fp4Linear, Fp4Weight
from lmpress.weights.online_rotation import carry_input_rotation
from lmpress.weights.qlinear import QuantizedLinear, quantized_linear_from
from lmpress.weights.scheme import QuantizedWeight


def apply_quantized_weight(
    model: nn.Module, name: str, qweight: QuantizedWeight | Fp8Weight | Fp4Weight
) -> QuantizedLinear | Fp8Linear | Fp4Linear:
    """Swap the linear layer ``name`` (relative to ``model``) for a QuantizedLinear holding ``qweight``.

    The replacement keeps the bias, the device and the place in the module tree, so
    the model's forward keeps working; it holds the packed codes that exporters write.
    Applying again to an already quantized layer replaces its weight; an online input rotation (R4) carries
    over. An ``Fp8Weight`` (an FP8 checkpoint's layer, read back) becomes an ``Fp8Linear``, an ``Fp4Weight`` an
    ``Fp4Linear``.
    """
    if not name:
        raise ValueError("apply_quantized_weight needs the name of a submodule, not the model itself")
    parent_name, _, child_name = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    old = original = getattr(parent, child_name)
    if isinstance(old, (QuantizedLinear, Fp4Linear)):
        device = next(old.buffers()).device
        linear = nn.Linear(old.in_features, old.out_features, bias=old.bias is not None, device=device)
        if old.bias is not None:
            linear.bias.data.copy_(old.bias.data)
        old = linear
    if not isinstance(old, nn.Linear):
        raise TypeError(f"{name} is a {type(old).__name__}, not an nn.Linear")
    if isinstance(qweight, Fp8Weight):
        bias = None if old.bias is None else old.bias.data
        replacement = Fp8Linear.from_weight(qweight, bias).to(old.weight.device)
    elif isinstance(qweight, Fp4Weight):
        bias = None if old.bias is None else old.bias.data
        replacement = Fp4Linear.from_weight(qweight, bias).to(old.weight.device)
    else:
        replacement = quantized_linear_from(old, qweight)
    replacement.train(old.training)
    carry_input_rotation(original, replacement)  # R4: the replacement turns its input as the linear did
    setattr(parent, child_name, replacement)
    return replacement
