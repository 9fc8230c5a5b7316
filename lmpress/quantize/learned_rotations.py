"""SpinQuant's learned rotations (Liu et al. 2024, arXiv:2405.16406): R1 and R2 trained on calibration text.

A random Hadamard matrix spreads outliers, but some rotations suit a quantizer far better than others (SpinQuant
section 3.1: up to 13 points of zero-shot accuracy between random rotations of one model at W4A4). SpinQuant
starts from a random Hadamard matrix and trains the rotation itself, keeping it orthogonal, to minimise the
cross-entropy of the network with its activations fake-quantized (its section 3.2; weights stay float while it
learns, GPTQ quantizes them after, its W16A4 recipe).

The rotation stage asks for it with ``learn`` (``lmpress.quantize.rotate``):

    - method: rotate
      rotate_down_proj: true     # R4 online, fixed (SpinQuant's R4 is a Hadamard matrix too)
      learn:
        activations: nvfp4       # the activations the quantizing stage will give the linears
        steps: 100
    - method: gptq
      fp4: nvfp4
      activations: fp4

Here, on the model with its norms' scales already folded into the linears (so the stream's rotation commutes
with every norm):

- ``R1 = Q0 C(A1)`` and each layer's ``R2 = H0 C(A2)``: ``Q0`` / ``H0`` the stage's random Hadamard matrices and
  ``C(A) = (I - A/2)^-1 (I + A/2)`` the Cayley transform of a skew-symmetric ``A = B - B^T``, orthogonal for any
  ``B`` (Li et al. 2020, arXiv:2002.01113, eq. 4; SpinQuant optimises on the same manifold with Cayley SGD),
  ``B`` trained by Adam from zero, so step 0 is the Hadamard start;
- no weight is rewritten while learning: the rotated model's linear sees ``quant(x R) (W R)^T = quant(x R) R^T W^T``,
  so each norm's output ``x`` (the readers' input) becomes ``quant(x R1) R1^T``, o_proj's input per head
  ``quant(z R2) R2^T``, down_proj's ``quant(x V) V`` (``V``, R4's block Hadamard, symmetric) or ``quant(x)``;
- ``quant`` rounds with a straight-through estimator (rounding's gradient taken as 1) and keeps its block or
  token scale's gradient, as SpinQuant's quantizer does: the rotation learns to lower each block's maximum.

The stage then fuses the learned ``R1`` and ``R2`` into the weights as it fuses Hadamard ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field
from torch import nn

from lmpress.anatomy import decoder_layers
from lmpress.errors import LmpressInputError
from lmpress.progress import Bars
from lmpress.registry import StrictConfig
from lmpress.weights.fp4 import E2M1_MAX, FP4_BLOCK, activation_block_scales, fake_quantize_e2m1, nvfp4_global_scale
from lmpress.weights.int8_linear import INT8_MAX
from lmpress.weights.online_rotation import blockwise_hadamard
from lmpress.weights.scheme import straight_through

LearnedActivations = Literal["nvfp4", "mxfp4", "int8"]
# What backpropagation through the hooked model keeps a token (the memory forecast), in float32 values: this many
# times the decoder linears' input and output widths, and this many rows of logits (the float model's and the
# quantized one's, their log-softmaxes and the gradient). SmolLM2-135M measured 6.84 MB a token (peak RSS over
# 256- and 512-token steps: 1.73 and 3.36 GiB), 4.6 times its widths besides 6 rows of logits.
ACTIVATION_COPIES = 5
LOGIT_COPIES = 6


class LearnRotationsConfig(StrictConfig):
    activations: LearnedActivations = Field(
        description="the activation quantization the rotations are trained for: nvfp4 / mxfp4 (per block, the "
        "W4A4 presets) or int8 (per token, W4A8)"
    )
    steps: int = Field(100, ge=1, description="optimizer steps")
    lr: float = Field(1e-4, gt=0, description="Adam's learning rate on the skew-symmetric generators")
    batch_size: int = Field(1, ge=1, description="calibration samples per step (cycled in order)")
    loss: Literal["kl", "ce"] = Field(
        "kl",
        description="kl: the quantized network's KL divergence from the float one's next-token distributions; ce: "
        "its cross-entropy on the samples (SpinQuant's)",
    )


@dataclass
class LearnedRotations:
    residual: torch.Tensor  # R1, float64 (hidden, hidden)
    heads: list[torch.Tensor] | None  # R2 of each decoder layer, float64 (head_dim, head_dim)
    losses: list[float]  # the quantized network's loss (config.loss) at each step

    def loss_summary(self) -> dict[str, float]:
        """The mean loss over the first and the last tenth of the steps."""
        tenth = max(1, len(self.losses) // 10)
        return {"first": sum(self.losses[:tenth]) / tenth, "last": sum(self.losses[-tenth:]) / tenth}


def cayley(generator: torch.Tensor) -> torch.Tensor:
    """``C(A) = (I - A/2)^-1 (I + A/2)`` of ``A = B - B^T``: orthogonal for any square ``B``."""
    skew = generator - generator.T
    eye = torch.eye(skew.shape[0], dtype=skew.dtype, device=skew.device)
    return torch.linalg.solve(eye - skew / 2, eye + skew / 2)


def quantize_activations_ste(x: torch.Tensor, kind: LearnedActivations) -> torch.Tensor:
    """The values per-call activation quantization leaves of ``x`` (``fake_quantize_fp4_activations``,
    ``fake_quantize_per_token``), differentiable: rounding passes the gradient straight through, the scales
    (a block's or token's maximum over the grid's) keep theirs."""
    if kind == "int8":
        scale = x.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(x.dtype).tiny) / INT8_MAX
        t = x / scale
        return straight_through(t, t.round()) * scale
    block = FP4_BLOCK[kind]
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = blocks.abs().amax(-1)
    gs = nvfp4_global_scale(x) if kind == "nvfp4" else None
    scale = straight_through(amax / E2M1_MAX, activation_block_scales(amax.detach(), kind, gs))[..., None]
    t = (blocks / scale).clamp(-E2M1_MAX, E2M1_MAX)
    return (straight_through(t, fake_quantize_e2m1(t)) * scale).reshape(x.shape)


def per_head(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Each head's block of ``x``'s last dimension times ``h`` (R2 on o_proj's input, or on its weight's columns)."""
    d = h.shape[0]
    return (x.reshape(*x.shape[:-1], -1, d) @ h).reshape(x.shape)


def rotated_quantization_hooks(
    model: nn.Module,
    parts,  # lmpress.quantize.rotate.ResidualParts
    rotations: Callable[[], tuple[torch.Tensor, list[torch.Tensor] | None] | None],
    down_block: int | None,
    kind: LearnedActivations,
) -> list:
    """Hooks that make ``model`` compute what its rotated, activation-quantized form will (module docstring);
    while ``rotations()`` is None they leave the float model as it is."""
    quant = quantize_activations_ste
    down = next(name for name in parts.writes if name != parts.output)
    handles = []
    for index, layer in enumerate(decoder_layers(model)):

        def readers_input(module, args, out):
            if rotations() is None:
                return None
            r1 = rotations()[0]
            return quant(out @ r1, kind) @ r1.T

        def output_input(module, args, index=index):
            if rotations() is None:
                return None
            heads = rotations()[1]
            if heads is None:
                return (quant(args[0], kind),)
            h = heads[index]
            return (per_head(quant(per_head(args[0], h), kind), h.T),)

        def down_input(module, args):
            if rotations() is None:
                return None
            if down_block is None:
                return (quant(args[0], kind),)
            return (blockwise_hadamard(quant(blockwise_hadamard(args[0], down_block), kind), down_block),)

        for norm, _ in parts.reads:
            handles.append(layer.get_submodule(norm).register_forward_hook(readers_input))
        handles.append(layer.get_submodule(parts.output).register_forward_pre_hook(output_input))
        handles.append(layer.get_submodule(down).register_forward_pre_hook(down_input))
    return handles


def learn_rotations(
    model: nn.Module,
    parts,  # lmpress.quantize.rotate.ResidualParts
    samples: torch.Tensor,
    residual: torch.Tensor,
    head: torch.Tensor | None,
    down_block: int | None,
    config: LearnRotationsConfig,
    bars: Bars,
) -> LearnedRotations:
    """Train R1 (from ``residual``) and, with ``head``, every layer's R2 (from ``head``) on ``samples`` (token ids,
    ``(n, seq_len)``) through ``model``, whose norms' scales must already be folded (scale 1). The model's own
    weights are not changed."""
    device = residual.device
    layers = len(decoder_layers(model))
    g1 = torch.zeros_like(residual, dtype=torch.float32, requires_grad=True)
    g2 = (
        [torch.zeros_like(head, dtype=torch.float32, requires_grad=True) for _ in range(layers)]
        if head is not None
        else []
    )
    q0, h0 = residual.float(), None if head is None else head.float()
    current: dict[str, tuple | None] = {"now": None}

    def rotations() -> tuple[torch.Tensor, list[torch.Tensor] | None] | None:
        return current["now"]

    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    handles = rotated_quantization_hooks(model, parts, rotations, down_block, config.activations)
    optimizer = torch.optim.Adam([g1, *g2], lr=config.lr)
    losses: list[float] = []
    advance = bars.counter("rotate: learning R1" + (" and R2" if g2 else ""), config.steps)
    try:
        with torch.enable_grad():
            for step in range(config.steps):
                rows = torch.arange(step * config.batch_size, (step + 1) * config.batch_size) % samples.shape[0]
                ids = samples[rows].to(device)
                current["now"] = None
                with torch.no_grad():
                    reference = model(input_ids=ids).logits[:, :-1].float() if config.loss == "kl" else None
                heads = [h0 @ cayley(g) for g in g2] if g2 else None
                current["now"] = (q0 @ cayley(g1), heads)
                loss = _loss(model(input_ids=ids).logits[:, :-1].float(), ids, reference)
                if not torch.isfinite(loss):
                    raise LmpressInputError(
                        f"stage rotate: learn: the quantized network's loss is {float(loss.detach())} at step {step} "
                        f"(calibration samples {rows.tolist()}): the model gives non-finite values on that text"
                    )
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                losses.append(float(loss.detach()))
                advance(f"rotate: learning R1{' and R2' if g2 else ''} (loss {losses[0]:.3f} -> {losses[-1]:.3f})")
    finally:
        for handle in handles:
            handle.remove()
        for p in frozen:
            p.requires_grad_(True)
        current.clear()
    with torch.no_grad():  # the final rotations in float64: orthogonal to float64's rounding, fused exactly
        learned = residual @ cayley(g1.detach().double())
        heads = [head @ cayley(g.detach().double()) for g in g2] if head is not None else None
    return LearnedRotations(learned, heads, losses)


def _loss(logits: torch.Tensor, ids: torch.Tensor, reference: torch.Tensor | None) -> torch.Tensor:
    """Cross-entropy on the next tokens, or (``reference``: the float model's logits) the mean KL divergence
    ``KL(p_float || p_quantized)`` per token."""
    logits = logits.reshape(-1, logits.shape[-1])
    if reference is None:
        return nn.functional.cross_entropy(logits, ids[:, 1:].reshape(-1))
    target = nn.functional.log_softmax(reference.reshape(-1, reference.shape[-1]), -1)
    return nn.functional.kl_div(nn.functional.log_softmax(logits, -1), target, log_target=True, reduction="batchmean")


def learning_bytes(shape, tokens: int) -> int:
    """Peak bytes of one learning step over ``tokens`` tokens beside the weights (``shape``:
    ``lmpress.memory_plan.ModelShape``)."""
    widths = sum(rows + cols for _, rows, cols in shape.linears)
    return tokens * 4 * (ACTIVATION_COPIES * widths + LOGIT_COPIES * shape.vocab)
