"""Structured pruning: remove attention heads, MLP channels and whole decoder layers into a smaller dense model.

Sample recipe stage:

    - method: structured
      mlp_channels: 0.25     # fraction of each layer's MLP intermediate channels removed
      heads: 3               # query heads removed per layer, in whole GQA groups (SmolLM2: 3 per KV head)
      layers: 4              # whole decoder layers removed
      layer_importance: angular   # angular (one pass) | kl (greedy, by the model's output)
      kl_samples: 4               # kl: calibration samples it scores on
      kl_repeat: false            # kl: each sample's first half twice, so layers that copy from context count

Importance comes from one pass of the calibration engine over the unmodified model
(Minitron, Muralidharan et al. 2024, §2.2, activation-based importance):

- an MLP channel i: Σ over samples of the L2 norm over the sequence of its
  activation act(gate_i(x)) · up_i(x), the input of down_proj;
- an attention head h: the same aggregate of its attention output (o_proj's input
  slice of head h); a GQA group's importance is the sum over its query heads, and
  groups are removed whole (a KV head with all of the query heads that read it);
- a decoder layer: the angular distance between its input and output,
  arccos(cos(x_in, x_out)) / π averaged over every calibration token (Gromov et al.
  2024, Eq. 7; ShortGPT's block influence 1 - cos, Men et al. 2024, is its cosine
  form); the layers that change their input least go first. With ``layer_importance: kl``
  the layers go greedily instead, each round the one whose removal moves the model's
  next-token distribution least from the unpruned model's (``depth_kl.py``; about
  layers x removed forward passes over ``kl_samples`` samples: for small models).

Width is ranked per layer on the original model, depth on the original model too
(angular: one-shot; kl: greedy, each round on the model without the layers already chosen,
all before anything is removed). The result has a config that says its new sizes
(``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads``,
``head_dim``, ``num_hidden_layers``), so any transformers install loads the saved
checkpoint. Llama-family attention and gated MLPs only. The stage keeps no state
between layers: ``--resume`` recomputes its pass (it modifies nothing until the end).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import nn

from lmpress.anatomy import decoder_layers
from lmpress.calib.engine import CalibrationMethod, run_calibration
from lmpress.calib.session import LayerSession
from lmpress.errors import LmpressInputError
from lmpress.placement import on_device
from lmpress.prune.depth_kl import greedy_kl_layer_drop
from lmpress.registry import StageConfig, StageContext, register_stage

ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


class StructuredConfig(StageConfig):
    method: Literal["structured"] = "structured"
    calibrates_layerwise: ClassVar[bool] = True
    reshapes_model: ClassVar[bool] = True
    mlp_channels: float = Field(0.0, ge=0, lt=1, description="fraction of MLP intermediate channels removed")
    heads: int = Field(0, ge=0, description="query heads removed per layer (whole GQA groups)")
    layers: int = Field(0, ge=0, description="whole decoder layers removed")
    batch_size: int = Field(4, ge=1, description="calibration samples per forward pass")
    layer_importance: Literal["angular", "kl"] = Field(
        "angular", description="angular: one pass, each layer's own change; kl: greedy, on the output (small models)"
    )
    kl_samples: int = Field(4, ge=1, description="calibration samples the kl criterion scores on")
    kl_repeat: bool = Field(
        False, description="kl scores on each sample's first half followed by that half again (copying counts)"
    )

    def order_refusal(self, earlier: Sequence[StageConfig]) -> str | None:
        """Removing MLP channels after R4 would cut blocks of the rotation down_proj's input runs through."""
        for index, stage in enumerate(earlier):
            if self.mlp_channels and getattr(stage, "rotate_down_proj", False):
                return (
                    f"structured removes MLP channels after stages[{index}] rotate mixed them (rotate_down_proj): "
                    "put structured before rotate"
                )
        return None

    def check(self, model: nn.Module) -> None:
        config = model.config
        needed = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "num_hidden_layers")
        layer = decoder_layers(model)[0]
        present = {name for name, _ in layer.named_modules()}
        if any(getattr(config, key, None) is None for key in needed) or not set(ATTENTION + MLP) <= present:
            raise LmpressInputError(
                f"stage structured: {config.model_type} models are not supported "
                "(Llama-family attention with q/k/v/o_proj and a gated MLP only)"
            )
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        group = heads // kv
        if self.heads >= heads:
            raise LmpressInputError(
                f"stage structured: heads: {self.heads} removes every one of the {heads} attention heads a layer "
                f"has; at most {heads - group}"
            )
        if self.heads % group:
            raise LmpressInputError(
                f"stage structured: heads: {self.heads} breaks a GQA group ({kv} KV heads each shared by {group} "
                f"query heads): remove a multiple of {group}"
            )
        if self.layers >= config.num_hidden_layers:
            raise LmpressInputError(
                f"stage structured: layers: {self.layers} removes every one of the model's "
                f"{config.num_hidden_layers} decoder layers; at most {config.num_hidden_layers - 1}"
            )
        if round(config.intermediate_size * (1 - self.mlp_channels)) < 1:
            raise LmpressInputError(f"stage structured: mlp_channels: {self.mlp_channels} removes every MLP channel")

    def reshape_skeleton(self, model: nn.Module) -> None:
        """The last ``layers`` layers removed, each kept layer's first channels and KV groups kept: the sizes the
        stage leaves, whichever ones the calibration data picks (for the memory forecast)."""
        n, mc = len(decoder_layers(model)), model.config

        def first(kind: str, i: int) -> torch.Tensor:  # the lowest index scores highest
            return -torch.arange(mc.intermediate_size if kind == "channels" else mc.num_key_value_heads).float()

        shrink_model(model, list(range(n - self.layers, n)), *self.kept(mc), first)

    def kept(self, mc: Any) -> tuple[int, int]:
        """(MLP channels, KV groups) each kept layer keeps."""
        group = mc.num_attention_heads // mc.num_key_value_heads
        return round(mc.intermediate_size * (1 - self.mlp_channels)), mc.num_key_value_heads - self.heads // group


def _sequence_l2(x: torch.Tensor) -> torch.Tensor:
    """Σ over samples of the L2 norm over the sequence, per feature: x (batch, seq, features) -> (features,)."""
    return x.float().norm(dim=1).sum(0)


class ImportanceMethod(CalibrationMethod):
    """Gathers channel, head and layer importance; modifies nothing."""

    name = "importance"

    def __init__(self, n_layers: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.channels: list[torch.Tensor | None] = [None] * n_layers
        self.head_outputs: list[torch.Tensor | None] = [None] * n_layers
        self.angle_sum = [0.0] * n_layers
        self.tokens = [0] * n_layers

    def prepare_layer(self, session: LayerSession) -> None:
        index = session.index

        head_dim = self.head_dim

        def on_input(name: str, batch: int, args: tuple, kwargs: dict) -> None:
            x = args[0] if args else kwargs["input"]
            if name == "self_attn.o_proj":
                store = self.head_outputs  # per head: Σ over tokens of the L2 norm of its output
                value = x.float().reshape(*x.shape[:-1], -1, head_dim).norm(dim=-1).sum((0, 1))
            else:
                store, value = self.channels, _sequence_l2(x)
            store[index] = value if store[index] is None else store[index] + value

        session.forward(["self_attn.o_proj", "mlp.down_proj"], on_input)

    def on_output(self, session: LayerSession, batch: int, inputs: torch.Tensor, outputs: torch.Tensor) -> None:
        cos = torch.nn.functional.cosine_similarity(inputs.float(), outputs.float(), dim=-1)
        self.angle_sum[session.index] += (torch.arccos(cos.clamp(-1, 1)) / math.pi).sum().item()
        self.tokens[session.index] += cos.numel()

    def angular_distance(self) -> list[float]:
        return [s / max(n, 1) for s, n in zip(self.angle_sum, self.tokens, strict=True)]


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    linear = nn.Linear(
        weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype, device=weight.device
    )
    linear.weight.data.copy_(weight)
    if bias is not None:
        linear.bias.data.copy_(bias)
    return linear


def _rows(linear: nn.Linear, keep: torch.Tensor) -> nn.Linear:
    return _linear(linear.weight.data[keep], None if linear.bias is None else linear.bias.data[keep])


def _columns(linear: nn.Linear, keep: torch.Tensor) -> nn.Linear:
    return _linear(linear.weight.data[:, keep], None if linear.bias is None else linear.bias.data)


def prune_mlp_channels(mlp: nn.Module, keep: torch.Tensor) -> None:
    """Keep intermediate channels ``keep`` (sorted indices) of a gated MLP: rows of gate/up, columns of down."""
    mlp.gate_proj = _rows(mlp.gate_proj, keep)
    mlp.up_proj = _rows(mlp.up_proj, keep)
    mlp.down_proj = _columns(mlp.down_proj, keep)
    if hasattr(mlp, "intermediate_size"):
        mlp.intermediate_size = len(keep)


def prune_kv_groups(attention: nn.Module, keep_groups: torch.Tensor, group: int, head_dim: int) -> None:
    """Keep KV heads ``keep_groups`` (sorted) with the ``group`` query heads that read each."""
    q_heads = (keep_groups[:, None] * group + torch.arange(group)).flatten()
    q_rows = (q_heads[:, None] * head_dim + torch.arange(head_dim)).flatten()
    kv_rows = (keep_groups[:, None] * head_dim + torch.arange(head_dim)).flatten()
    attention.q_proj = _rows(attention.q_proj, q_rows)
    attention.k_proj = _rows(attention.k_proj, kv_rows)
    attention.v_proj = _rows(attention.v_proj, kv_rows)
    attention.o_proj = _columns(attention.o_proj, q_rows)


def remove_layers(model: nn.Module, drop: list[int]) -> None:
    """Remove decoder layers ``drop`` and renumber the rest (their KV-cache slots follow their position)."""
    layers = decoder_layers(model)
    kept = [layer for i, layer in enumerate(layers) if i not in set(drop)]
    for position, layer in enumerate(kept):
        attention = getattr(layer, "self_attn", None)
        if attention is not None and hasattr(attention, "layer_idx"):
            attention.layer_idx = position
        if hasattr(layer, "layer_idx"):
            layer.layer_idx = position
    layers.__init__(kept)
    config = model.config
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, list) and len(layer_types) == len(kept) + len(drop):
        config.layer_types = [t for i, t in enumerate(layer_types) if i not in set(drop)]
    config.num_hidden_layers = len(kept)


def shrink_model(
    model: nn.Module, drop: list[int], channels: int, kv_kept: int, scores: Callable[[str, int], torch.Tensor]
) -> None:
    """Remove decoder layers ``drop`` and keep, in every other layer ``i``, the ``channels`` MLP channels and the
    ``kv_kept`` KV groups (with the query heads that read them) scoring highest in ``scores("channels", i)`` and
    ``scores("groups", i)``; the config follows."""
    mc = model.config
    layers = decoder_layers(model)
    heads, kv = mc.num_attention_heads, mc.num_key_value_heads
    group, head_dim = heads // kv, getattr(mc, "head_dim", None) or mc.hidden_size // heads
    for i, layer in enumerate(layers):
        if i in drop:
            continue
        if channels < mc.intermediate_size:
            prune_mlp_channels(layer.mlp, torch.topk(scores("channels", i), channels).indices.sort().values)
        if kv_kept < kv:
            keep = torch.topk(scores("groups", i), kv_kept).indices.sort().values
            prune_kv_groups(layer.self_attn, keep, group, head_dim)
    if drop:
        remove_layers(model, drop)
    mc.intermediate_size = channels
    if kv_kept < kv:
        mc.head_dim, mc.num_attention_heads, mc.num_key_value_heads = head_dim, kv_kept * group, kv_kept


def parameter_bytes(model: nn.Module) -> tuple[int, int]:
    """(weights, bytes) of ``model``, tied tensors counted once. A quantized linear counts its
    in x out weights, and the bytes of what it holds (packed codes, scales, zeros, g_idx)."""
    from lmpress.weights.qlinear import QuantizedLinear

    params = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, QuantizedLinear))
    params += sum(p.numel() for p in _distinct(model.parameters()))
    size = sum(t.numel() * t.element_size() for t in _distinct(model.state_dict().values()))
    return params, size


def _distinct(tensors) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for tensor in tensors:
        seen.setdefault(tensor.data_ptr(), tensor)
    return list(seen.values())


def repeated_halves(samples: torch.Tensor) -> torch.Tensor:
    """Each row's first half, then that half again: where the text repeats, a model predicts it by copying from
    its context (induction heads, Olsson et al. 2022), so a layer whose removal breaks copying costs KL there."""
    half = samples[:, : samples.shape[1] // 2]
    return torch.cat([half, half], dim=1)


@register_stage("structured", StructuredConfig)
@torch.no_grad()
def run_structured(model: nn.Module, config: StructuredConfig, ctx: StageContext) -> dict:
    config.check(model)
    mc = model.config
    params_before, bytes_before = parameter_bytes(model)
    layers = decoder_layers(model)
    heads, kv = mc.num_attention_heads, mc.num_key_value_heads
    group, head_dim = heads // kv, getattr(mc, "head_dim", None) or mc.hidden_size // heads
    importance = ImportanceMethod(len(layers), head_dim)
    fresh = dataclasses.replace(ctx, resume=False)  # the pass changes nothing: rerun it whole
    run_calibration(model, [importance], lambda name: None, fresh, batch_size=config.batch_size)

    distance = importance.angular_distance()
    kl_trace: list[float] = []
    if config.layer_importance == "kl" and config.layers:
        with on_device(ctx.device, model):
            samples = ctx.calibration()[: config.kl_samples].to(ctx.device)
            if config.kl_repeat:
                samples = repeated_halves(samples)
            drop, kl_trace = greedy_kl_layer_drop(model, samples, config.layers, ctx.bars)
    else:
        drop = sorted(sorted(range(len(layers)), key=lambda i: distance[i])[: config.layers])
    channels, kv_kept = config.kept(mc)

    def scores(kind: str, i: int) -> torch.Tensor:
        if kind == "channels":
            return importance.channels[i].cpu()
        # query heads h = g * group + j read KV head g: a group's importance is the sum over its heads
        return importance.head_outputs[i].cpu().reshape(kv, group).sum(-1)

    shrink_model(model, drop, channels, kv_kept, scores)
    params_after, bytes_after = parameter_bytes(model)
    return {
        "removed_layers": drop,
        "layer_importance": config.layer_importance,
        "angular_distance": [round(d, 5) for d in distance],
        **(
            {"kl_after_each_removal": [round(k, 5) for k in kl_trace], "kl_repeat": config.kl_repeat}
            if kl_trace
            else {}
        ),
        "intermediate_size": channels,
        "num_attention_heads": mc.num_attention_heads,
        "num_key_value_heads": mc.num_key_value_heads,
        "num_hidden_layers": mc.num_hidden_layers,
        "parameters_before": params_before,
        "parameters_after": params_after,
        "bytes_before": bytes_before,
        "bytes_after": bytes_after,
    }
