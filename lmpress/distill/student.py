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
- with ``learn_weights: false`` neither holds a latent weight: the layer's codes stay fixed and
  only the scales train, by the exact derivative of ``codes · s`` (EfficientQAT's end-to-end step);
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
    e2m1_values,
    encode_e8m0,
    fake_quantize_e2m1,
    fake_quantize_fp4_activations,
    round_to_e2m1,
    round_to_e4m3,
)
from lmpress.weights.online_rotation import carry_input_rotation
from lmpress.weights.qlinear import QuantizedLinear
from lmpress.weights.scheme import QuantizedWeight, round_ste, straight_through

# A float layer with at least this fraction of exact zeros is taken as pruned (a trained dense
# layer has essentially none); smaller fractions are left free to move.
PRUNED_FRACTION = 0.05


def int_codes(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    """``clamp(⌊w/s⌉ + z, 0, maxq)`` in a byte: the codes a latent weight rounds to (``scale``, ``zero`` per entry)."""
    return torch.clamp(torch.round(weight / scale) + zero, 0, maxq).to(torch.uint8)


class FakeQuantLinear(nn.Module):
    """A quantized linear in training: ``y = x @ ((clamp(⌊w/s⌉ + z) − z) · s).T + b`` with ``learn_weights`` (a
    latent float weight ``w``, LSQ), ``y = x @ ((q − z) · s).T + b`` with the layer's codes ``q`` fixed without
    (the scales' gradient then ``Σ (q − z)`` times the weight's: see ``Fp4BlocksLinear`` for why not LSQ's)."""

    def __init__(self, layer: QuantizedLinear, learn_scales: bool = True, learn_weights: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features, self.scheme = layer.in_features, layer.out_features, layer.scheme
        self.scale_dtype = layer.scales.dtype
        dequantized = layer.dequantized_weight(torch.float32)
        if learn_weights:
            self.weight = nn.Parameter(dequantized)
            self.register_buffer("codes", None)
        else:
            self.register_parameter("weight", None)
            self.register_buffer("codes", layer.codes())
        self.scales = nn.Parameter(layer.scales.float().clone(), requires_grad=learn_scales)
        self.register_buffer("zeros", layer.zeros.float().clone())
        self.register_buffer("g_idx", None if layer.g_idx is None else layer.g_idx.clone())
        self.bias = None if layer.bias is None else nn.Parameter(layer.bias.detach().float().clone())
        self.register_buffer("mask", None)  # True = pruned (kept at zero)
        if nm_pattern(dequantized) is not None:
            self.mask = dequantized == 0  # fixed codes keep their zeros by themselves

    def _groups(self) -> torch.Tensor:
        if self.g_idx is not None:
            return self.g_idx.long()
        width = self.scheme.group_width(self.in_features)
        return torch.arange(self.in_features, device=self.scales.device) // width

    def _stored_scales(self) -> torch.Tensor:
        # the scales the export will store (e.g. float16) are the ones trained against
        return straight_through(self.scales, self.scales.to(self.scale_dtype).float())

    def _scale_zero(self) -> tuple[torch.Tensor, torch.Tensor]:
        groups = self._groups()
        return self._stored_scales()[:, groups], self.zeros[:, groups]

    def quantized_weight(self) -> torch.Tensor:
        """The weight the forward multiplies by, as plain autograd over straight-through rounding (the reference
        ``IntGroupsLinear`` is tested against)."""
        scale, zero = self._scale_zero()
        if self.codes is not None:
            return (self.codes.float() - zero) * scale
        q = torch.clamp(round_ste(self.weight / scale) + zero, 0, self.scheme.maxq)
        return (q - zero) * scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = IntGroupsLinear.apply(
            x, self._stored_scales(), self.zeros, self._groups(), self.scheme.maxq, self.codes, self.weight
        )
        return y if self.bias is None else y + self.bias.to(y.dtype)

    @torch.no_grad()
    def freeze(self) -> QuantizedLinear:
        codes = self.codes
        if codes is None:
            scale, zero = self._scale_zero()
            codes = int_codes(self.weight, scale, zero, self.scheme.maxq)
        qw = QuantizedWeight(
            qweight=codes,
            scales=self.scales.detach().to(self.scale_dtype),
            zeros=self.zeros.clone(),
            scheme=self.scheme,
            g_idx=self.g_idx,
        )
        return QuantizedLinear.from_quantized_weight(qw, None if self.bias is None else self.bias.detach())


class IntGroupsLinear(torch.autograd.Function):
    """``x ((q − z) · s)ᵀ`` over integer codes ``q`` with a scale ``s`` and a zero point ``z`` per row and group
    (``groups``: each input column's group), the integer counterpart of :class:`Fp4BlocksLinear`.

    With a latent weight ``w``, ``q = clamp(⌊w/s⌉ + z, 0, maxq)``, rounding straight-through: for ``w`` the
    gradient ``1[0 <= ⌊w/s⌉ + z <= maxq]``, for ``s`` LSQ's ``Σ (q − z) − (w/s)·1[inside]`` (Esser et al. 2020,
    eq. 3). With the codes fixed (``weight`` None), ``s`` gets ``Σ (q − z)`` times the weight's gradient.

    Autograd over the same expression keeps weight-sized float32 tensors per layer until the backward pass (``q − z``
    and the product among them: four with a latent weight, two with fixed codes, counted with saved-tensor hooks on a
    layer whose input needs a gradient); this keeps the codes in a byte and rebuilds the product."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        groups: torch.Tensor,
        maxq: int,
        codes: torch.Tensor | None,
        weight: torch.Tensor | None,
    ) -> torch.Tensor:
        scale, zero = scales[:, groups], zeros[:, groups]
        if weight is not None:
            codes = int_codes(weight, scale, zero, maxq)
        ctx.save_for_backward(x, scales, zeros, groups, codes, weight)
        ctx.maxq = maxq
        return nn.functional.linear(x, ((codes.float() - zero) * scale).to(x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, scales, zeros, groups, codes, weight = ctx.saved_tensors
        scale, zero = scales[:, groups], zeros[:, groups]
        values = codes.float() - zero
        grad_x = grad_scales = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_x = grad @ (values * scale).to(grad.dtype)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[6]:
            flat = grad.reshape(-1, grad.shape[-1]).float()
            grad_w = flat.T @ x.reshape(-1, x.shape[-1]).float()
            step = values
            if weight is not None:
                t = weight / scale
                rounded = torch.round(t) + zero
                inside = (rounded >= 0) & (rounded <= ctx.maxq)
                step = torch.where(inside, values - t, values)
                grad_weight = grad_w * inside if ctx.needs_input_grad[6] else None
            if ctx.needs_input_grad[1]:
                grad_scales = torch.zeros_like(scales).index_add_(1, groups, grad_w * step)
        return grad_x, grad_scales, None, None, None, None, grad_weight


class Fp4BlocksLinear(torch.autograd.Function):
    """``x (e2m1 · s)ᵀ`` over blocks ``(out, in / block, block)`` of E2M1 codes and one scale ``s`` each.

    With latent weights ``w`` (``blocks``), the codes are ``e2m1(clamp(w / s))``, rounding straight-through: for
    ``w`` the gradient ``1[|w/s| <= 6]``, for ``s`` LSQ's ``Σ e2m1(w/s) − (w/s)·1[|w/s| <= 6]`` (Esser et al. 2020,
    eq. 3). With the codes fixed (``blocks`` None), ``s`` gets ``Σ e2m1`` times the weight's gradient, the exact
    derivative of ``e2m1 · s`` (EfficientQAT's end-to-end step, Chen et al. 2024). LSQ's gradient over a latent
    weight that sits on the grid (``w = e2m1 · s₀``) is ``Σ e2m1 · (s − s₀)/s``: zero at the start and of the
    wrong sign below ``s₀``, so fixed codes must not be trained through it.

    Autograd over the same expression keeps four weight-sized float32 tensors per layer until the backward pass
    (the quotient, its clamp's input, the product's operand, the product); this keeps each code in a byte and
    rebuilds the product from it."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor | None, blocks: torch.Tensor | None
    ) -> torch.Tensor:
        if blocks is not None:
            codes = round_to_e2m1((blocks / scales).clamp(-E2M1_MAX, E2M1_MAX))
        ctx.save_for_backward(x, scales, codes, blocks)
        weight = (e2m1_values(codes) * scales).reshape(codes.shape[0], -1)
        return nn.functional.linear(x, weight.to(x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, scales, codes, blocks = ctx.saved_tensors
        values = e2m1_values(codes)
        grad_x = grad_scales = grad_blocks = None
        if ctx.needs_input_grad[0]:
            grad_x = grad @ (values * scales).reshape(codes.shape[0], -1).to(grad.dtype)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[3]:
            flat = grad.reshape(-1, grad.shape[-1]).float()
            grad_weight = (flat.T @ x.reshape(-1, x.shape[-1]).float()).reshape(codes.shape)
            step = values
            if blocks is not None:
                t = blocks / scales
                inside = (t >= -E2M1_MAX) & (t <= E2M1_MAX)
                step = values - torch.where(inside, t, 0.0)
                grad_blocks = grad_weight * inside if ctx.needs_input_grad[3] else None
            if ctx.needs_input_grad[1]:
                grad_scales = (grad_weight * step).sum(-1, keepdim=True)
        return grad_x, grad_scales, None, grad_blocks


class FakeQuantFp4Linear(nn.Module):
    """An FP4 linear in training: ``y = A(x) (e2m1 · s)ᵀ + b`` per block, ``s`` stored in the format's encoding
    (an E4M3 value over NVFP4's global scale, or a power of two; straight-through) and ``A`` the layer's activation
    quantization (W4A4). With ``learn_weights`` the E2M1 values round a latent float weight straight-through;
    without, they are the layer's codes, fixed."""

    def __init__(self, layer: Fp4Linear, learn_scales: bool = True, learn_weights: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features, self.scheme, self.fmt = (
            layer.in_features, layer.out_features, layer.scheme, layer.fmt,
        )  # fmt: skip
        fp4 = layer.unpack()
        if learn_weights:
            self.weight = nn.Parameter(fp4.dequantize(torch.float32))
            self.register_buffer("codes", None)
        else:
            self.register_parameter("weight", None)
            self.register_buffer("codes", self._blocks(fp4.codes.clone()))
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

    def _scales_ste(self) -> torch.Tensor:
        return straight_through(self.scales, self._effective_scales())[..., None]

    def quantized_weight(self) -> torch.Tensor:
        """The weight the forward multiplies by, as plain autograd over straight-through rounding (the reference
        ``Fp4BlocksLinear`` is tested against)."""
        scales = self._scales_ste()
        if self.codes is not None:
            return (e2m1_values(self.codes) * scales).reshape(self.out_features, self.in_features)
        t = (self._blocks(self.weight) / scales).clamp(-E2M1_MAX, E2M1_MAX)
        return (straight_through(t, fake_quantize_e2m1(t)) * scales).reshape(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scheme.activations == "fp4":
            x = straight_through(x, fake_quantize_fp4_activations(x, self.fmt, self.input_global_scale))
        blocks = None if self.weight is None else self._blocks(self.weight)
        y = Fp4BlocksLinear.apply(x, self._scales_ste(), self.codes, blocks)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    @torch.no_grad()
    def freeze(self) -> Fp4Linear:
        codes = self.codes
        if codes is None:
            t = self._blocks(self.weight) / self._effective_scales()[..., None]
            codes = round_to_e2m1(t.clamp(-E2M1_MAX, E2M1_MAX))
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
    quantized = _replace(model, QuantizedLinear, lambda layer: FakeQuantLinear(layer, learn_scales, learn_weights))
    quantized += _replace(model, Fp4Linear, lambda layer: FakeQuantFp4Linear(layer, learn_scales, learn_weights))
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
    if not learn_weights:  # the quantized layers hold fixed codes: no weight
        for module in model.modules():
            if isinstance(module, nn.Linear):
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
        if mask is not None and module.weight is not None:
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
