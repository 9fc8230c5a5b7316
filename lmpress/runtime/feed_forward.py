"""The feed-forward blocks: gated MLPs, gpt-oss's clamped expert, and routed mixtures of experts with each family's
router (Mixtral / Qwen-MoE, DeepSeek-V2, DeepSeek-V3, gpt-oss) and shared experts."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from lmpress.runtime.linears import Build, fuse_linears

ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class FeedForward(nn.Module):
    """Gated MLP: ``down(act(gate(x)) * up(x))`` with gate and up fused; act is SiLU (SwiGLU) or tanh GELU
    (Gemma's GeGLU)."""

    def __init__(self, hf_mlp: nn.Module, build: Build, activation: str = "silu") -> None:
        super().__init__()
        fused = getattr(hf_mlp, "gate_up_proj", None)  # Phi-3: gate rows then up rows in one linear
        self.w13 = fuse_linears([fused] if fused is not None else [hf_mlp.gate_proj, hf_mlp.up_proj], build)
        self.halves = [fused.out_features // 2] * 2 if fused is not None else self.w13.sizes
        self.w2 = fuse_linears([hf_mlp.down_proj], build)
        self.act = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).split(self.halves, dim=-1)
        return self.w2(self.act(gate) * up)


class ClampedFeedForward(nn.Module):
    """A gpt-oss expert (``calib.moe.GptOssExpertMLP``, every projection biased):
    ``down((clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g))`` with ``g = clamp(gate, max=limit)``."""

    def __init__(self, hf_expert: nn.Module, build: Build) -> None:
        super().__init__()
        self.w13 = fuse_linears([hf_expert.gate_proj, hf_expert.up_proj], build)
        self.w2 = fuse_linears([hf_expert.down_proj], build)
        self.alpha, self.limit = hf_expert.alpha, hf_expert.limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).split(self.w13.sizes, dim=-1)
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return self.w2((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))


def softmax_top_k(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral, Qwen-MoE: the top ``k`` of the softmax over every expert (float32), renormalized where asked."""
    weights, chosen = logits.float().softmax(dim=-1).topk(k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, chosen


def top_k_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss: the top ``k`` logits, then a softmax over those alone (in the logits' dtype, as transformers)."""
    top, chosen = logits.topk(k, dim=-1)
    return top.softmax(dim=-1), chosen


def _grouped_choice(choice: torch.Tensor, n_group: int, topk_group: int, group_score: str) -> torch.Tensor:
    """``choice`` ``(tokens, experts)`` with every expert outside each token's best ``topk_group`` groups set to
    -inf; a group scores its best expert (``"max"``) or the sum of its best two (``"top2"``)."""
    groups = choice.view(choice.shape[0], n_group, -1)
    scores = groups.max(dim=-1).values if group_score == "max" else groups.topk(2, dim=-1).values.sum(dim=-1)
    kept = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, scores.topk(topk_group, dim=-1).indices, True)
    return groups.masked_fill(~kept[..., None], float("-inf")).view_as(choice)


def deepseek_v3_route(
    logits: torch.Tensor, k: int, bias: torch.Tensor, n_group: int, topk_group: int, normalize: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3: sigmoid scores; the experts are chosen by score plus ``e_score_correction_bias`` among the
    best ``topk_group`` groups (a group scored by its best two), weighted by their scores without the bias,
    renormalized where ``norm_topk_prob``, times ``routed_scaling_factor``."""
    scores = logits.float().sigmoid()
    choice = _grouped_choice(scores + bias, n_group, topk_group, "top2")
    chosen = choice.topk(k, dim=-1).indices
    weights = scores.gather(1, chosen)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, chosen


def deepseek_v2_route(
    logits: torch.Tensor, k: int, method: str, n_group: int | None, topk_group: int | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2: softmax scores; the top ``k`` of all experts (``"greedy"``) or of the best ``topk_group``
    groups, a group scored by its best expert (``"group_limited_greedy"``); times ``routed_scaling_factor``."""
    scores = logits.float().softmax(dim=-1)
    if method == "group_limited_greedy":
        scores = _grouped_choice(scores, n_group, topk_group, "max").clamp(min=0.0)  # masked: 0, as transformers
    weights, chosen = scores.topk(k, dim=-1)
    return weights * scale, chosen


class Router(nn.Module):
    """A mixture's router: the logits ``x @ weight.T (+ bias)`` and the family's rule from logits to each token's
    experts and their weights."""

    def __init__(self, hf_mlp: nn.Module, config, build: Build) -> None:
        super().__init__()
        gate = hf_mlp.router if hasattr(hf_mlp, "router") else hf_mlp.gate  # gpt-oss: ``router``, with a bias
        self.family = config.model_type
        # DeepSeek routes in float32 (its router's weight is kept in float32 whatever the model's dtype)
        dtype = torch.float32 if self.family.startswith("deepseek") else build.dtype
        self.weight = nn.Parameter(gate.weight.detach().to(dtype), requires_grad=False)
        bias = getattr(gate, "bias", None)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        correction = getattr(gate, "e_score_correction_bias", None)
        self.correction = None if correction is None else correction.detach().float().clone()
        self.top_k = config.num_experts_per_tok
        self.normalize = self.family == "mixtral" or bool(getattr(config, "norm_topk_prob", False))
        self.config = config

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights (float) and expert indices, each ``(tokens, top_k)``, for tokens ``x`` ``(tokens, hidden)``."""
        logits = F.linear(x.to(self.weight.dtype), self.weight, self.bias)
        c = self.config
        if self.family == "gpt_oss":
            return top_k_softmax(logits, self.top_k)
        if self.family == "deepseek_v3":
            correction = self.correction.to(logits.device)
            return deepseek_v3_route(
                logits, self.top_k, correction, c.n_group, c.topk_group, self.normalize, c.routed_scaling_factor
            )
        if self.family == "deepseek_v2":
            return deepseek_v2_route(
                logits, self.top_k, c.topk_method, c.n_group, c.topk_group, c.routed_scaling_factor
            )
        return softmax_top_k(logits, self.top_k, self.normalize)


class MoEFeedForward(nn.Module):
    """A routed mixture of gated experts (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3, gpt-oss): the router picks
    each token's experts and weights, each expert's output is weighted and summed; Qwen2-MoE adds a shared expert
    behind a sigmoid gate, DeepSeek its shared experts ungated."""

    def __init__(self, hf_mlp: nn.Module, config, build: Build) -> None:
        super().__init__()
        from lmpress.calib.moe import GptOssExpertMLP, UnfusedExperts

        experts = hf_mlp.experts
        # Sharing the model's layers (the evals' decoding), fused float experts run as they are: copy nothing.
        self.own_block = hf_mlp if build.shares_layers and not isinstance(experts, UnfusedExperts) else None
        if self.own_block is not None:
            return
        if not isinstance(experts, UnfusedExperts):  # float experts still fused (E, 2I, H): one linear each
            experts = UnfusedExperts.from_fused(experts, "mlp.experts")
        self.experts = nn.ModuleList(
            ClampedFeedForward(expert, build) if isinstance(expert, GptOssExpertMLP) else FeedForward(expert, build)
            for expert in experts
        )
        self.router = Router(hf_mlp, config, build)
        shared = getattr(hf_mlp, "shared_expert", getattr(hf_mlp, "shared_experts", None))
        self.shared = FeedForward(shared, build) if shared is not None else None
        gate = getattr(hf_mlp, "shared_expert_gate", None)  # Qwen2-MoE's; DeepSeek's shared experts have none
        self.shared_gate = fuse_linears([gate], build) if gate is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.own_block is not None:
            out = self.own_block(x)
            return out[0] if isinstance(out, tuple) else out  # gpt-oss's block returns its router scores too
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = self.router(flat)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == e)
            if rows.numel():
                y = expert(flat[rows]) * weights[rows, slot, None].to(flat.dtype)
                out.index_add_(0, rows, y)
        if self.shared is not None:
            shared = self.shared(flat)
            out = out + (torch.sigmoid(self.shared_gate(flat)) * shared if self.shared_gate is not None else shared)
        return out.reshape(x.shape)
