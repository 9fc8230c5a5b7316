"""Per-expert linear layers for mixture-of-experts blocks whose experts are fused.

transformers 5 stores the experts of Mixtral, Qwen2/3-MoE and DeepSeek-V2/V3 as two 3-D
parameters, ``gate_up_proj`` ``(E, 2I, H)`` and ``down_proj`` ``(E, H, I)``; gpt-oss's are
transposed (``(E, H, 2I)``, ``(E, I, H)``), their gate and up columns interleaved, each with a
bias, and its activation a clamped SwiGLU (:class:`GptOssExpertMLP`). Weight quantizers
work on ``nn.Linear`` modules, so :func:`unfuse_experts` replaces each fused
experts module with :class:`UnfusedExperts`, a ``ModuleList`` of per-expert
``gate_proj`` / ``up_proj`` / ``down_proj`` linears (module names
``mlp.experts.{e}.gate_proj``...) computing the same function.

With ``calibrate_all`` set, every expert runs on every token so that calibration
statistics reach experts the router sends few or no tokens; the block's output is
still the routed mixture.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from lmpress.errors import LmpressInputError


def expert_of(name: str) -> tuple[str, int, str] | None:
    """``(block, e, linear)`` for a per-expert linear's name ``{block}.{e}.{linear}`` (``mlp.experts.3.down_proj``),
    or None for a name of another shape. Whether ``block`` is an experts block is the caller's to check: by the
    module where it has one (:class:`UnfusedExperts`), by :func:`is_experts_block_name` where it has only names."""
    expert, _, linear = name.rpartition(".")
    block, _, index = expert.rpartition(".")
    if not block or not index.isdigit():
        return None
    return block, int(index), linear


def is_experts_block_name(block: str) -> bool:
    """Whether ``block`` names a MoE block's experts as every supported family names it (``...experts``)."""
    return block.rpartition(".")[2] == "experts"


class ExpertMLP(nn.Module):
    """One gated expert: ``down(act(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int, act_fn: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, dtype=dtype)
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class GptOssExpertMLP(nn.Module):
    """One gpt-oss expert: ``down((clamp(up, -l, l) + 1) * g * sigmoid(alpha * g))``, ``g = clamp(gate, max=l)``;
    every projection has a bias."""

    def __init__(self, hidden: int, intermediate: int, alpha: float, limit: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=True, dtype=dtype)
        self.up_proj = nn.Linear(hidden, intermediate, bias=True, dtype=dtype)
        self.down_proj = nn.Linear(intermediate, hidden, bias=True, dtype=dtype)
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x).clamp(max=self.limit)
        up = self.up_proj(x).clamp(-self.limit, self.limit)
        return self.down_proj((up + 1) * gate * torch.sigmoid(gate * self.alpha))


class UnfusedExperts(nn.ModuleList):
    """Drop-in replacement for a fused experts module: ``forward(hidden, top_k_index, top_k_weights)``."""

    calibrate_all: bool = False

    @classmethod
    def from_fused(cls, fused: nn.Module, name: str) -> UnfusedExperts:
        if hasattr(fused, "gate_up_proj_bias"):
            return cls.from_gpt_oss(fused, name)
        gate_up, down = fused.gate_up_proj, fused.down_proj
        if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[1] != 2 * down.shape[2]:
            raise LmpressInputError(
                f"experts module {name}: gate_up_proj {tuple(gate_up.shape)} / down_proj {tuple(down.shape)} "
                "is not the (E, 2I, H) / (E, H, I) layout lmpress can split into per-expert linears"
            )
        n_experts, two_i, hidden = gate_up.shape
        inter = two_i // 2
        experts = cls()
        for e in range(n_experts):
            expert = ExpertMLP(hidden, inter, fused.act_fn, gate_up.dtype).to(gate_up.device)
            expert.gate_proj.weight.data.copy_(gate_up.data[e, :inter])
            expert.up_proj.weight.data.copy_(gate_up.data[e, inter:])
            expert.down_proj.weight.data.copy_(down.data[e])
            experts.append(expert)
        return experts

    @classmethod
    def from_gpt_oss(cls, fused: nn.Module, name: str) -> UnfusedExperts:
        gate_up, down = fused.gate_up_proj, fused.down_proj
        gate_up_bias, down_bias = fused.gate_up_proj_bias, fused.down_proj_bias
        if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[2] != 2 * down.shape[1]:
            raise LmpressInputError(
                f"experts module {name}: gate_up_proj {tuple(gate_up.shape)} / down_proj {tuple(down.shape)} "
                "is not gpt-oss's (E, H, 2I) / (E, I, H) layout that lmpress can split into per-expert linears"
            )
        n_experts, hidden, two_i = gate_up.shape
        experts = cls()
        for e in range(n_experts):
            expert = GptOssExpertMLP(hidden, two_i // 2, fused.alpha, fused.limit, gate_up.dtype).to(gate_up.device)
            expert.gate_proj.weight.data.copy_(gate_up.data[e, :, 0::2].T)
            expert.gate_proj.bias.data.copy_(gate_up_bias.data[e, 0::2])
            expert.up_proj.weight.data.copy_(gate_up.data[e, :, 1::2].T)
            expert.up_proj.bias.data.copy_(gate_up_bias.data[e, 1::2])
            expert.down_proj.weight.data.copy_(down.data[e].T)
            expert.down_proj.bias.data.copy_(down_bias.data[e])
            experts.append(expert)
        return experts

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e, expert in enumerate(self):
            token_idx, top_k_pos = torch.where(top_k_index == e)
            if self.calibrate_all:
                y = expert(hidden_states)[token_idx]
            elif token_idx.numel() == 0:
                continue
            else:
                y = expert(hidden_states[token_idx])
            y = y * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out


def is_fused_experts(module: nn.Module) -> bool:
    return isinstance(getattr(module, "gate_up_proj", None), nn.Parameter) and isinstance(
        getattr(module, "down_proj", None), nn.Parameter
    )


def unfuse_each(model: nn.Module) -> Iterator[str]:
    """Replace the fused experts modules of ``model`` by per-expert linears one at a time, yielding each one's name
    once it is replaced (a reader packs that block's experts before the next block's float copies are made)."""
    fused = [(name, m) for name, m in model.named_modules() if is_fused_experts(m)]
    for name, module in fused:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, UnfusedExperts.from_fused(module, name))
        yield name


def unfuse_experts(model: nn.Module) -> int:
    """Replace every fused experts module in ``model`` by per-expert linears; returns how many experts blocks the
    model then has (those loaded so from a checkpoint stored per expert too: ``expert_checkpoint``)."""
    for _ in unfuse_each(model):
        pass
    return sum(isinstance(m, UnfusedExperts) for m in model.modules())


def set_calibrate_all(module: nn.Module, on: bool) -> None:
    for m in module.modules():
        if isinstance(m, UnfusedExperts):
            m.calibrate_all = on


def fuse_gpt_oss_state(state: dict[str, torch.Tensor], prefix: str, n_experts: int) -> None:
    """Turn the per-expert tensors ``{prefix}{e}.{gate,up,down}_proj.{weight,bias}`` of unfused gpt-oss experts in
    ``state`` (dense, in place) back into the fused, transposed, interleaved tensors transformers' gpt-oss loads."""
    keys = [
        f"{prefix}{e}.{proj}.{kind}"
        for e in range(n_experts)
        for proj in ("gate_proj", "up_proj", "down_proj")
        for kind in ("weight", "bias")
    ]
    parts = {k.removeprefix(prefix): state.pop(k) for k in keys}
    gate = torch.stack([parts[f"{e}.gate_proj.weight"].T for e in range(n_experts)])
    up = torch.stack([parts[f"{e}.up_proj.weight"].T for e in range(n_experts)])
    gate_up = torch.stack((gate, up), dim=-1).flatten(-2)  # (E, H, 2I), gate and up columns interleaved
    gate_b = torch.stack([parts[f"{e}.gate_proj.bias"] for e in range(n_experts)])
    up_b = torch.stack([parts[f"{e}.up_proj.bias"] for e in range(n_experts)])
    state[f"{prefix}gate_up_proj"] = gate_up.contiguous()
    state[f"{prefix}gate_up_proj_bias"] = torch.stack((gate_b, up_b), dim=-1).flatten(-2).contiguous()
    state[f"{prefix}down_proj"] = torch.stack([parts[f"{e}.down_proj.weight"].T for e in range(n_experts)]).contiguous()
    state[f"{prefix}down_proj_bias"] = torch.stack([parts[f"{e}.down_proj.bias"] for e in range(n_experts)])


def is_gpt_oss_experts(module: nn.Module) -> bool:
    return isinstance(module, UnfusedExperts) and len(module) > 0 and isinstance(module[0], GptOssExpertMLP)
