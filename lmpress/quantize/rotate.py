"""Rotations (QuaRot, Ashkboos et al. 2024, arXiv:2404.00456): Hadamard rotations fused into the weights.

A rotated model computes the same function as before (in exact arithmetic), but its weights and the activations
between them have far fewer outliers, which is what lets 4-bit weights, and later 4-bit activations, keep the
model's quality. Run it before any quantizing stage, preferably a calibrated one (on SmolLM2, GPTQ W4 g64 gains
from it, weight-only RTN loses: docs/methods/rotations.md):

    - method: rotate
      seed: 0             # the random signs of the randomized Hadamard matrices
      random: true        # false: plain (Sylvester / Paley) Hadamard matrices
      rotate_heads: true  # R2: a Hadamard matrix per attention head between v_proj and o_proj
      rotate_down_proj: false  # R4: down_proj's input turned at run time (for 4-bit activations)
    - method: gptq
      bits: 4
      group_size: 64

What the stage does, in place, one decoder layer at a time (float64 per weight, stored in the weight's dtype):

1. Folds every RMSNorm's scale into the linears it feeds and sets the norm's scale to 1 (QuaRot section 4,
   "computational invariance": RMSNorm(x Q) = RMSNorm(x) Q only for a scale of 1).
2. R1: rotates the residual stream by ``Q`` (QuaRot's randomized Hadamard, or a plain one): the embedding
   rows ``E -> E Q``; every linear that reads the stream (q/k/v, gate/up, lm_head) ``W -> W Q``; every linear
   that writes it (o_proj, down_proj) ``W -> Q^T W``, its bias ``b -> Q^T b``. A head tied to the embedding is
   untied when the final norm's scale makes it differ (``config.tie_word_embeddings`` set to false).
3. R2 (``rotate_heads``): per attention head a Hadamard matrix ``H`` of order head_dim between v_proj's output
   rows (``W_v -> H^T W_v`` per KV head) and o_proj's input columns (``W_o -> W_o H`` per query head); the
   attention weights mix tokens, not channels, so each head's output is rotated by the same ``H``.

4. R4 (``rotate_down_proj``): down_proj's input, ``act(gate) * up``, which no weight can absorb a rotation
   through, is turned at run time by a block-diagonal Hadamard matrix ``V`` (blocks of ``down_proj_block``, by
   default the largest power of two dividing the MLP width) and its weight takes ``W -> W V``
   (``lmpress/weights/online_rotation.py``; compressed-tensors' ``transform_config``, as vLLM reads it).

5. ``learn`` (SpinQuant, arXiv:2405.16406): R1 and each layer's R2 start from the Hadamard matrices above and are
   trained on the calibration samples for the activations the quantizing stage will use, then fused as in 2-3
   (``lmpress/quantize/learned_rotations.py``).

R3, the rotation of queries and keys before a quantized KV cache, is the cache's own (``kv_cache: {rotate: true}``).
Families other than dense Llama, Mistral, Qwen2 and Qwen3 are refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from pydantic import Field
from torch import nn

from lmpress.anatomy import Anatomy, decoder_layers, get_anatomy, layer_linears
from lmpress.errors import LmpressInputError
from lmpress.quantize.learned_rotations import LearnRotationsConfig, learn_rotations, learning_bytes, per_head
from lmpress.registry import StageConfig, StageContext, register_stage
from lmpress.weights.hadamard import hadamard_matrix, hadamard_order_refusal, random_hadamard
from lmpress.weights.online_rotation import (
    attach_input_rotation,
    block_refusal,
    largest_power_of_two_block,
    rotate_weight_input,
)

# Families whose decoder layers are pre-norm RMSNorm blocks of plain linears around one residual stream.
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
# Why the others with an anatomy are refused (named in the one-line error).
NOT_SUPPORTED = {
    "opt": "its LayerNorm subtracts the mean, which does not commute with a rotation",
    "gemma2": "its sandwich norms scale the attention and MLP outputs before the residual add",
    "gemma3_text": "its sandwich norms scale the attention and MLP outputs before the residual add",
    "phi3": "its fused qkv_proj and gate_up_proj are not rotated yet",
    "mixtral": "mixture-of-experts routers and experts are not rotated yet",
    "qwen2_moe": "mixture-of-experts routers and experts are not rotated yet",
    "qwen3_moe": "mixture-of-experts routers and experts are not rotated yet",
    "gpt_oss": "mixture-of-experts routers and experts are not rotated yet",
    "deepseek_v2": "multi-head latent attention and mixture-of-experts blocks are not rotated yet",
    "deepseek_v3": "multi-head latent attention and mixture-of-experts blocks are not rotated yet",
}
# Stages after which a rotation still gives the same function on float, dense weights.
FLOAT_STAGES = ("rotate", "structured", "distill")
# Rows of an embedding or head rotated at once (bounds the float64 working copy).
ROW_CHUNK = 8192


class RotateConfig(StageConfig):
    method: Literal["rotate"] = "rotate"
    reads_whole_model: ClassVar[bool] = True
    learning_label: ClassVar[str] = "rotation learning"
    seed: int = Field(0, ge=0, description="seed of the random signs (random: true)")
    random: bool = Field(True, description="randomized Hadamard matrices (QuaRot) rather than plain ones")
    residual: bool = Field(True, description="R1: the residual stream, the norms' scales folded into the linears")
    rotate_heads: bool = Field(True, description="R2: a Hadamard matrix per head between v_proj and o_proj")
    rotate_down_proj: bool = Field(
        False, description="R4: down_proj's input turned at run time by a block Hadamard, its inverse in the weight"
    )
    down_proj_block: int | None = Field(
        None, description="R4's block (a power of two dividing the MLP width); default: the largest such"
    )
    input_block: int | None = Field(
        None,
        description="every decoder linear's input turned online in blocks of this power of two (the FP4 block: "
        "16 for NVFP4, 32 for MXFP4), its inverse fused into the weight",
    )
    learn: LearnRotationsConfig | None = Field(
        None, description="train R1 and R2 from the Hadamard start on the calibration samples (SpinQuant)"
    )

    def check(self, model: nn.Module) -> None:
        """Refuse, before any weight is touched, a family or a width no rotation here fits (``model`` may be a
        skeleton on the meta device)."""
        residual_parts(model)
        hidden, head_dim = rotation_orders(model)
        refusal = hadamard_order_refusal(hidden) if self.residual else None
        if refusal:
            raise LmpressInputError(f"stage rotate: hidden_size {hidden} of {_model_type(model)!r}: {refusal}")
        refusal = hadamard_order_refusal(head_dim) if self.rotate_heads else None
        if refusal:
            raise LmpressInputError(
                f"stage rotate: head_dim {head_dim} of {_model_type(model)!r}: {refusal}; or set rotate_heads: false"
            )

        if self.learn is not None and (not self.residual or self.input_block is not None):
            raise LmpressInputError(
                "stage rotate: learn trains R1, the residual stream's rotation: it needs residual: true and no "
                "input_block"
            )
        if self.input_block is not None:
            if self.rotate_down_proj:
                raise LmpressInputError("stage rotate: input_block turns down_proj's input too: drop rotate_down_proj")
            for name, linear in layer_linears(decoder_layers(model)[0]).items():
                refusal = block_refusal(int(linear.in_features), self.input_block)
                if refusal:
                    raise LmpressInputError(f"stage rotate: input_block: {name}: {refusal}")
        if self.rotate_down_proj:
            width = down_proj_width(model)
            refusal = block_refusal(width, self.down_block(width))
            if refusal:
                raise LmpressInputError(f"stage rotate: down_proj_block: {refusal}")

    def learning_bytes(self, shape, seq_len: int, packed: int = 0) -> int:
        return 0 if self.learn is None else learning_bytes(shape, self.learn.batch_size * seq_len)

    @property
    def unties_tied_head(self) -> bool:
        return self.residual  # R1 folds the final norm's scale into the head (rotate_residual_ends)

    def down_block(self, width: int) -> int:
        return self.down_proj_block or largest_power_of_two_block(width)

    def order_refusal(self, earlier: Sequence[StageConfig]) -> str | None:
        """Why this stage cannot follow ``earlier`` (the recipe's stages before it), or None."""
        for index, stage in enumerate(earlier):
            if stage.method not in FLOAT_STAGES:
                return (
                    f"rotate comes after stages[{index}] ({stage.method}), which quantizes or sparsifies the "
                    "weights, and rotating them would make them dense float weights again: put rotate first"
                )
        return None


@dataclass(frozen=True)
class ResidualParts:
    """What reads and writes the residual stream, by module path relative to a decoder layer."""

    reads: tuple[tuple[str, tuple[str, ...]], ...]  # (RMSNorm, the linears its output feeds)
    writes: tuple[str, ...]  # the linears whose output is added to the stream
    values: str  # v_proj
    output: str  # o_proj


def _model_type(model: nn.Module) -> str:
    return str(getattr(model.config, "model_type", None))


def _parts_of(anatomy: Anatomy) -> ResidualParts:
    attention = f"{anatomy.attention}."
    reads = tuple((src, dst) for src, dst in anatomy.scaling_pairs if "norm" in src)
    (values, (output,)) = next((src, dst) for src, dst in anatomy.scaling_pairs if src.startswith(attention))
    # the linears whose input comes only from the block's own linears are the blocks' outputs (o_proj, down_proj)
    return ResidualParts(reads, tuple(name for name, _ in anatomy.fed_only_by), values, output)


def residual_parts(model: nn.Module) -> ResidualParts:
    """The residual stream's readers and writers in ``model``; LmpressInputError for a family or a layer the
    rotation's algebra does not hold for."""
    anatomy = get_anatomy(model)  # refuses families lmpress has no anatomy for
    model_type = _model_type(model)
    if model_type not in SUPPORTED:
        raise LmpressInputError(
            f"stage rotate: {model_type!r} models cannot be rotated: {NOT_SUPPORTED.get(model_type, 'not handled')}"
            f" (rotate supports: {', '.join(SUPPORTED)})"
        )
    parts = _parts_of(anatomy)
    known = {name for _, readers in parts.reads for name in readers} | set(parts.writes)
    norms = [anatomy.final_norm] + [
        f"{anatomy.layers}.{i}.{norm}" for i in range(len(decoder_layers(model))) for norm, _ in parts.reads
    ]
    for name in norms:
        kind = type(model.get_submodule(name)).__name__
        if not kind.endswith("RMSNorm"):
            raise LmpressInputError(f"stage rotate: {name} of {model_type!r} is a {kind}, not an RMSNorm")
    for index, layer in enumerate(decoder_layers(model)):
        for name, module in layer.named_modules():
            if name in known and (type(module) is not nn.Linear or not module.weight.is_floating_point()):
                raise LmpressInputError(
                    f"stage rotate: {anatomy.layers}.{index}.{name} is a {type(module).__name__}, not a float "
                    "nn.Linear: rotate runs on the float model, before quantizing stages"
                )
        stray = sorted(set(layer_linears(layer)) - known)
        if stray:
            raise LmpressInputError(
                f"stage rotate: {anatomy.layers}.{index}.{stray[0]} of {model_type!r} neither reads nor writes the "
                "residual stream as rotate knows it; this layout is not rotated"
            )
    return parts


def down_proj_width(model: nn.Module) -> int:
    """The input width of the MLP's output projection (R4's order)."""
    parts = residual_parts(model)
    down = next(name for name in parts.writes if name != parts.output)
    return int(decoder_layers(model)[0].get_submodule(down).in_features)


def rotation_orders(model: nn.Module) -> tuple[int, int]:
    """(hidden size, head dim): the orders of R1 and R2."""
    config = model.config
    hidden = int(config.hidden_size)
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    return hidden, int(head_dim)


Transform = Callable[[torch.Tensor], torch.Tensor]


def _rewrite(param: torch.Tensor, transform: Transform, device: torch.device, chunk: int | None = None) -> None:
    """``param <- transform(param)``, computed in float64 on ``device`` and stored in ``param``'s dtype and place;
    with ``chunk``, ``chunk`` rows at a time (a transform that acts on each row alone)."""
    data = param.data
    step = chunk or data.shape[0]
    for start in range(0, data.shape[0], step):
        rows = data[start : start + step]
        rows.copy_(transform(rows.to(device=device, dtype=torch.float64)))


def _per_head_rows(w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``H^T`` applied to each head's block of rows (a 2-D weight) or entries (a bias)."""
    if w.dim() == 1:
        return per_head(w, h)
    return (h.T @ w.reshape(-1, h.shape[0], w.shape[1])).reshape(w.shape)


def _norm_scale(norm: nn.Module, offset: float, device: torch.device) -> torch.Tensor:
    return norm.weight.detach().to(device=device, dtype=torch.float64) + offset


def _set_unit_scale(norm: nn.Module, offset: float) -> None:
    norm.weight.data.fill_(1.0 - offset)  # the norm's factor (offset + weight) becomes 1


def rotate_layer(
    layer: nn.Module,
    parts: ResidualParts,
    q: torch.Tensor,
    h: torch.Tensor | None,
    offset: float,
    device: torch.device,
) -> None:
    """Fold the layer's norms and apply R1 (``q``) and, where ``h`` is given, R2 to one decoder layer."""
    for norm_name, readers in parts.reads:
        norm = layer.get_submodule(norm_name)
        scale = _norm_scale(norm, offset, device)
        for name in readers:
            linear = layer.get_submodule(name)
            if name == parts.values and h is not None:
                _rewrite(linear.weight, lambda w, s=scale: _per_head_rows((w * s) @ q, h), device)
                if linear.bias is not None:
                    _rewrite(linear.bias, lambda b: _per_head_rows(b, h), device)
            else:
                # a reader's output is unchanged: x Q (W diag(s) Q)^T = x diag(s) W^T (QuaRot eq. 2), bias kept
                _rewrite(linear.weight, lambda w, s=scale: (w * s) @ q, device)
        _set_unit_scale(norm, offset)
    for name in parts.writes:
        linear = layer.get_submodule(name)
        if name == parts.output and h is not None:
            _rewrite(linear.weight, lambda w: q.T @ per_head(w, h), device)
        else:
            _rewrite(linear.weight, lambda w: q.T @ w, device)
        if linear.bias is not None:
            _rewrite(linear.bias, lambda b: q.T @ b, device)


def _untie(model: nn.Module, head: nn.Module) -> None:
    """Give the head its own weight (a copy of the embedding's) and record it in the config."""
    head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=head.weight.requires_grad)
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.tie_word_embeddings = False


@register_stage("rotate", RotateConfig)
@torch.no_grad()
def run_rotate(model: nn.Module, config: RotateConfig, ctx: StageContext) -> dict:
    config.check(model)
    parts = residual_parts(model)
    anatomy = get_anatomy(model)
    hidden, head_dim = rotation_orders(model)
    device = ctx.device

    def rotation(n: int) -> torch.Tensor:
        return (random_hadamard(n, config.seed) if config.random else hadamard_matrix(n)).to(device)

    h = rotation(head_dim) if config.rotate_heads else None
    q = rotation(hidden) if config.residual else None
    layers = decoder_layers(model)
    heads = [h] * len(layers)
    down = next(name for name in parts.writes if name != parts.output)
    block = config.down_block(down_proj_width(model)) if config.rotate_down_proj else None
    learned = None
    if config.learn is not None and q is not None:
        untie = fold_norms(model, parts, device)
        learned = learn_rotations(model, parts, ctx.calibration(), q, h, block, config.learn, ctx.bars)
        q, heads = learned.residual, learned.heads or heads
        rotate_residual_ends(model, q, device)
    else:
        untie = rotate_residual_ends(model, q, device) if q is not None else False
    for layer, head in ctx.bars.track(zip(layers, heads, strict=True), "rotate: layers", total=len(layers)):
        if q is not None:
            rotate_layer(layer, parts, q, head, anatomy.norm_offset, device)
        elif head is not None:
            rotate_heads(layer, parts, head, device)
        online = {down: block} if block is not None else {}
        if config.input_block is not None:
            online = dict.fromkeys(layer_linears(layer), config.input_block)
        for name, size in online.items():  # R4 and the like: W -> W V here, x -> x V at run time
            linear = layer.get_submodule(name)
            _rewrite(linear.weight, lambda w, size=size: rotate_weight_input(w, size), device)
            attach_input_rotation(linear, size)
    return {
        "rotated_layers": len(layers),
        "hidden_hadamard": hidden if config.residual else None,
        "head_hadamard": head_dim if config.rotate_heads else None,
        "random": config.random,
        "seed": config.seed if config.random else None,
        "untied_head": untie,
        "down_proj_hadamard_block": block,
        "input_hadamard_block": config.input_block,
    } | ({} if learned is None else {"learned_steps": len(learned.losses), "learned_loss": learned.loss_summary()})


def fold_norms(model: nn.Module, parts: ResidualParts, device: torch.device) -> bool:
    """Fold every RMSNorm's scale into the linears it feeds (step 1 alone: R1 = I); returns whether the head was
    untied from the embedding."""
    eye = torch.eye(rotation_orders(model)[0], dtype=torch.float64, device=device)
    untie = rotate_residual_ends(model, eye, device)
    for layer in decoder_layers(model):
        rotate_layer(layer, parts, eye, None, get_anatomy(model).norm_offset, device)
    return untie


def rotate_residual_ends(model: nn.Module, q: torch.Tensor, device: torch.device) -> bool:
    """R1 at the stream's ends: the embedding ``E -> E Q``, the head ``W -> W diag(s) Q`` with the final norm's
    scale ``s`` folded (untied from the embedding where ``s`` is not 1; returns whether it was)."""
    anatomy = get_anatomy(model)
    offset = anatomy.norm_offset
    embed = model.get_submodule(anatomy.embed)
    head = model.get_submodule(anatomy.lm_head)
    final_norm = model.get_submodule(anatomy.final_norm)
    final_scale = _norm_scale(final_norm, offset, device)
    # a tied head stays tied when the final norm's scale is already 1: E Q serves both
    untie = head.weight is embed.weight and not bool((final_scale == 1).all())
    if untie:
        _untie(model, head)
    _rewrite(embed.weight, lambda e: e @ q, device, ROW_CHUNK)
    if head.weight is not embed.weight:
        _rewrite(head.weight, lambda w: (w * final_scale) @ q, device, ROW_CHUNK)
    _set_unit_scale(final_norm, offset)
    return untie


def rotate_heads(layer: nn.Module, parts: ResidualParts, h: torch.Tensor, device: torch.device) -> None:
    """R2 alone (the residual stream left as it is): v_proj's rows and o_proj's columns per head."""
    values, output = layer.get_submodule(parts.values), layer.get_submodule(parts.output)
    _rewrite(values.weight, lambda w: _per_head_rows(w, h), device)
    if values.bias is not None:
        _rewrite(values.bias, lambda b: _per_head_rows(b, h), device)
    _rewrite(output.weight, lambda w: per_head(w, h), device)
