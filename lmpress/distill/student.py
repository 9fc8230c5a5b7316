"""The student: what trains, and how it goes back to the form every exporter reads.

A compressed model trains in place (recovery):

- each ``QuantizedLinear`` becomes a :class:`FakeQuantLinear`: a float latent weight,
  started at the dequantized weight, quantized on the layer's own grid in every forward
  with straight-through rounding (Bengio et al. 2013), its group scales learnable too
  (LSQ, Esser et al. 2020: ``∂ŵ/∂s = ⌊w/s⌉ − w/s`` inside the range). :func:`freeze_student`
  rounds it back into a ``QuantizedLinear`` of the same scheme, zero points and ``g_idx``:
  its dequantized weight is exactly what the last forward used;
- each ``Fp4Linear`` likewise becomes a :class:`FakeQuantFp4Linear`: E2M1 rounding, and block
  scales rounded to the format's encoding (E4M3 under NVFP4's global scale; powers of two),
  both straight-through; W4A4 layers quantize their inputs per block as ``Fp4Linear`` does;
- a pruned layer keeps its mask: entries that are exactly zero in a float linear of a
  decoder layer (an N:M pattern in a quantized one) are zeroed again after every
  optimizer step, so 2:4 stays 2:4.

A smaller student made from the teacher (fewer layers, narrower MLPs) is the
structured-pruning stage's output, trained like any float model.
"""

from __future__ import annotations

import torch
from torch import nn

from lmpress.anatomy import decoder_layers
from lmpress.calib.hooks import set_submodule
from lmpress.prune.masks import nm_pattern
from lmpress.weights.fp4 import (
    E2M1_MAX,
    FP4_BLOCK,
    Fp4Linear,
    Fp4Weight,
    decode_e8m0,
    encode_e8m0,
    fake_quantize_e2m1,
    fake_quantize_fp4_activations,
    round_to_e2m1,
    round_to_e4m3,
)
from lmpress.weights.online_rotation import carry_input_rotation
from lmpress.weights.qlinear import QuantizedLinear
from lmpress.weights.scheme import QuantizedWeight, round_ste

# A float layer with at least this fraction of exact zeros is taken as pruned (a trained dense
# layer has essentially none); smaller fractions are left free to move.
PRUNED_FRACTION = 0.05


class FakeQuantLinear(nn.Module):
    """A quantized linear in training: ``y = x @ ((clamp(⌊w/s⌉ + z) − z) · s).T + b``."""

    def __init__(self, layer: QuantizedLinear, learn_scales: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features, self.scheme = layer.in_features, layer.out_features, layer.scheme
        self.scale_dtype = layer.scales.dtype
        self.weight = nn.Parameter(layer.dequantized_weight(torch.float32))
        self.scales = nn.Parameter(layer.scales.float().clone(), requires_grad=learn_scales)
        self.register_buffer("zeros", layer.zeros.float().clone())
        self.register_buffer("g_idx", None if layer.g_idx is None else layer.g_idx.clone())
        self.bias = None if layer.bias is None else nn.Parameter(layer.bias.detach().float().clone())
        self.register_buffer("mask", None)  # True = pruned (kept at zero)
        if nm_pattern(self.weight.data) is not None:
            self.mask = self.weight.data == 0

    def _groups(self) -> torch.Tensor:
        if self.g_idx is not None:
            return self.g_idx.long()
        width = self.scheme.group_width(self.in_features)
        return torch.arange(self.in_features, device=self.weight.device) // width

    def _scale_zero(self) -> tuple[torch.Tensor, torch.Tensor]:
        groups = self._groups()
        # the scales the export will store (e.g. float16) are the ones trained against
        scales = self.scales + (self.scales.to(self.scale_dtype).float() - self.scales).detach()
        return scales[:, groups], self.zeros[:, groups]

    def quantized_weight(self) -> torch.Tensor:
        scale, zero = self._scale_zero()
        q = torch.clamp(round_ste(self.weight / scale) + zero, 0, self.scheme.maxq)
        return (q - zero) * scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return nn.functional.linear(x, self.quantized_weight().to(x.dtype), bias)

    @torch.no_grad()
    def freeze(self) -> QuantizedLinear:
        scale, zero = self._scale_zero()
        codes = torch.clamp(torch.round(self.weight / scale) + zero, 0, self.scheme.maxq)
        qw = QuantizedWeight(
            qweight=codes.to(torch.uint8),
            scales=self.scales.detach().to(self.scale_dtype),
            zeros=self.zeros.clone(),
            scheme=self.scheme,
            g_idx=self.g_idx,
        )
        return QuantizedLinear.from_quantized_weight(qw, None if self.bias is None else self.bias.detach())


def straight_through(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """``rounded`` forward (exactly: ``x − x`` is 0 however far ``x`` has moved from it), the identity backward."""
    return rounded.detach() + (x - x.detach())


class FakeQuantFp4Linear(nn.Module):
    """An FP4 linear in training: ``y = A(x) (e2m1(w / s) · s)ᵀ + b`` per block, ``s`` stored in the format's
    encoding (an E4M3 value over NVFP4's global scale, or a power of two) and ``A`` the layer's activation
    quantization (W4A4), every rounding straight-through."""

    def __init__(self, layer: Fp4Linear, learn_scales: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features, self.scheme, self.fmt = (
            layer.in_features, layer.out_features, layer.scheme, layer.fmt,
        )  # fmt: skip
        fp4 = layer.unpack()
        self.weight = nn.Parameter(fp4.dequantize(torch.float32))
        self.scales = nn.Parameter(fp4.effective_scales().float().clone(), requires_grad=learn_scales)
        self.register_buffer("global_scale", fp4.global_scale)
        self.register_buffer("input_global_scale", fp4.input_global_scale)
        self.bias = None if layer.bias is None else nn.Parameter(layer.bias.detach().float().clone())

    @torch.no_grad()
    def stored_scales(self) -> torch.Tensor:
        """The scales as the format stores them (E4M3 values, or powers of two), never zero."""
        if self.global_scale is None:
            return decode_e8m0(encode_e8m0(self.scales.clamp(min=2.0**-126)))
        stored = round_to_e4m3(self.scales * self.global_scale)
        return torch.where(stored > 0, stored, torch.full_like(stored, 0.125))  # E4M3's eps, as the observers do

    def _blocks(self, w: torch.Tensor) -> torch.Tensor:
        return w.reshape(self.out_features, -1, FP4_BLOCK[self.fmt])

    def _effective_scales(self) -> torch.Tensor:
        stored = self.stored_scales()
        return stored if self.global_scale is None else stored / self.global_scale

    def quantized_weight(self) -> torch.Tensor:
        scales = straight_through(self.scales, self._effective_scales())[..., None]
        t = (self._blocks(self.weight) / scales).clamp(-E2M1_MAX, E2M1_MAX)
        return (straight_through(t, fake_quantize_e2m1(t)) * scales).reshape(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scheme.activations == "fp4":
            x = straight_through(x, fake_quantize_fp4_activations(x, self.fmt, self.input_global_scale))
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return nn.functional.linear(x, self.quantized_weight().to(x.dtype), bias)

    @torch.no_grad()
    def freeze(self) -> Fp4Linear:
        effective = self._effective_scales()
        codes = round_to_e2m1((self._blocks(self.weight) / effective[..., None]).clamp(-E2M1_MAX, E2M1_MAX))
        fp4 = Fp4Weight(
            codes=codes.reshape(self.out_features, self.in_features),
            scales=self.stored_scales(),
            scheme=self.scheme,
            global_scale=self.global_scale,
            input_global_scale=self.input_global_scale,
        )
        return Fp4Linear.from_weight(fp4, None if self.bias is None else self.bias.detach())


def _replace(model: nn.Module, kind: type, make) -> int:
    found = [(name, module) for name, module in model.named_modules() if isinstance(module, kind)]
    for name, module in found:
        replacement = make(module)
        carry_input_rotation(module, replacement)  # R4: the student's layer turns its input as the model's did
        set_submodule(model, name, replacement)
    return len(found)


def prepare_student(
    model: nn.Module, learn_scales: bool = True, train_embeddings: bool = False, learn_weights: bool = True
) -> dict[str, int]:
    """Make ``model`` trainable in place: quantized layers fake-quantize, pruned layers get fixed masks.

    Embeddings (and a head tied to them) train only when ``train_embeddings``; the weights of the
    linear layers (latent weights of quantized ones) only when ``learn_weights``, else what trains is
    the quantization scales, norms and biases. Returns counts for the report.
    """
    quantized = _replace(model, QuantizedLinear, lambda layer: FakeQuantLinear(layer, learn_scales))
    quantized += _replace(model, Fp4Linear, lambda layer: FakeQuantFp4Linear(layer, learn_scales))
    masked = 0
    for layer in decoder_layers(model):
        for module in layer.modules():
            if isinstance(module, nn.Linear):
                zeros = module.weight.data == 0
                if float(zeros.float().mean()) >= PRUNED_FRACTION:
                    module.register_buffer("prune_mask", zeros)
                    masked += 1
            elif isinstance(module, FakeQuantLinear) and module.mask is not None:
                masked += 1
    for name, p in model.named_parameters():
        p.requires_grad_(learn_scales or not name.endswith(".scales"))
    if not learn_weights:
        for module in model.modules():
            if isinstance(module, nn.Linear | FakeQuantLinear | FakeQuantFp4Linear):
                module.weight.requires_grad_(False)
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        if module is not None and not train_embeddings:
            module.weight.requires_grad_(False)
    return {"fake_quantized_layers": quantized, "masked_layers": masked}


def norm_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The weights (and biases) of the normalization layers (RMSNorm, LayerNorm): their own learning rate."""
    return {p for module in model.modules() if type(module).__name__.endswith("Norm") for p in module.parameters()}


@torch.no_grad()
def apply_masks(model: nn.Module) -> None:
    """Zero every pruned entry again (after an optimizer step)."""
    for module in model.modules():
        mask = getattr(module, "prune_mask", None) if isinstance(module, nn.Linear) else getattr(module, "mask", None)
        if mask is not None:
            module.weight.data.masked_fill_(mask, 0.0)


def freeze_student(model: nn.Module) -> int:
    """Turn every FakeQuantLinear back into a QuantizedLinear (FakeQuantFp4Linear: Fp4Linear), drop the masks and
    gradients; returns the count."""
    count = _replace(model, FakeQuantLinear | FakeQuantFp4Linear, lambda layer: layer.freeze())
    for module in model.modules():
        if isinstance(module, nn.Linear) and hasattr(module, "prune_mask"):
            del module.prune_mask
    for p in model.parameters():
        p.requires_grad_(False)
        p.grad = None
    return count
