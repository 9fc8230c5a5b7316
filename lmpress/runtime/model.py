"""A compact decoder for the Llama family (Llama, Mistral, Qwen2, Qwen3, SmolLM), Phi-3, Gemma 2 / 3 (text) and the
mixtures of experts Mixtral, Qwen2-MoE and Qwen3-MoE, built from a transformers model.

Phi-3's linears come fused (qkv_proj, gate_up_proj) and run as they are. Gemma's quirks are applied, each
where transformers applies it: embeddings scaled by sqrt(hidden), RMSNorms scaling by (1 + weight), sandwich
norms (post-attention, pre- and post-feedforward), GeGLU (tanh GELU), attention scaled by
``query_pre_attn_scalar`` and soft-capped, final logits soft-capped, sliding-window layers, and Gemma 3's
q/k norms with one RoPE base per layer type (local and global).

``Transformer.from_hf(hf_model)`` takes the weights of an in-memory transformers
model whose linears are ``nn.Linear`` or lmpress ``QuantizedLinear``: q/k/v and
gate/up are fused into one matmul each (quantized layers too, when their schemes
match), quantized layers run the device's kernels (torch's packed CPU kernels,
``kernels/cpu.py``; Triton on CUDA, ``kernels/cuda.py``) and everything else runs in
``dtype``. ``Transformer.sharing(hf_model)`` instead runs the model's own layers, copying
nothing (what the evals decode with). The KV cache lives outside the model
(``cache.py``), so a target and its draft each keep their own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from lmpress.errors import LmpressInputError
from lmpress.runtime.kernels import DEFAULT_CPU_ACTIVATIONS, linear_kernel
from lmpress.runtime.kv_cache import KVCache, StaticSlots, static_slots_mask
from lmpress.runtime.mapped_embedding import MappedEmbedding
from lmpress.weights.float8 import Fp8Linear
from lmpress.weights.qlinear import QuantizedLinear, trivial_g_idx

SUPPORTED_MODEL_TYPES = (
    "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "mixtral", "qwen2_moe", "qwen3_moe",
)  # fmt: skip
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
GEMMA_TYPES = ("gemma2", "gemma3_text")
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    norm_eps: float
    max_seq_len: int
    windows: tuple[int | None, ...]  # sliding window of each layer, None: full attention
    qk_norm: bool
    kinds: tuple[str, ...] = ()  # each layer's type where RoPE differs by type (Gemma 3), else empty
    norm_offset: float = 0.0  # Gemma's norms scale by (1 + weight)
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden)
    attn_scale: float | None = None  # query scaling, None: head_dim ** -0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    sandwich: bool = False  # Gemma: post-attention and pre/post-feedforward norms
    activation: str = "silu"

    @classmethod
    def from_config(cls, config) -> ModelArgs:
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise LmpressInputError(
                f"the runtime does not support model type {config.model_type!r} (supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        if activation not in ACTIVATIONS:
            raise LmpressInputError(
                f"the runtime does not support activation {activation!r} of {config.model_type} "
                f"(supported: {', '.join(ACTIVATIONS)})"
            )
        if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
            raise LmpressInputError(
                f"the runtime does not support partial rotary embeddings ({config.model_type} with "
                f"partial_rotary_factor {config.partial_rotary_factor})"
            )
        gemma = config.model_type in GEMMA_TYPES
        kinds = tuple(getattr(config, "layer_types", None) or ()) if _rope_by_kind(config) else ()
        return cls(
            vocab_size=config.vocab_size,
            dim=config.hidden_size,
            n_layers=config.num_hidden_layers,
            n_heads=config.num_attention_heads,
            n_kv_heads=config.num_key_value_heads or config.num_attention_heads,
            head_dim=head_dim,
            norm_eps=config.rms_norm_eps,
            max_seq_len=config.max_position_embeddings,
            windows=_layer_windows(config),
            qk_norm=config.model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            kinds=kinds,
            norm_offset=1.0 if gemma else 0.0,
            embed_scale=config.hidden_size**0.5 if gemma else None,
            attn_scale=config.query_pre_attn_scalar**-0.5 if gemma else None,
            attn_softcap=getattr(config, "attn_logit_softcapping", None) if gemma else None,
            final_softcap=getattr(config, "final_logit_softcapping", None) if gemma else None,
            sandwich=gemma,
            activation=activation,
        )


def _rope_by_kind(config) -> bool:
    """Whether ``rope_parameters`` holds one entry per layer type (Gemma 3: local and global layers)."""
    params = getattr(config, "rope_parameters", None) or {}
    kinds = getattr(config, "layer_types", None) or ()
    return bool(kinds) and all(isinstance(params.get(kind), dict) for kind in set(kinds))


def _layer_windows(config) -> tuple[int | None, ...]:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    return (window,) * config.num_hidden_layers


def rope_inverse_frequencies(config, kind: str | None = None) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies and cos/sin scale under the config's scaling (transformers' own formulas);
    ``kind``: the layer type whose parameters to use where they differ by type (Gemma 3)."""
    params = getattr(config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": config.rope_theta}
    if kind is not None:
        params = params[kind]
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in STATIC_ROPE_TYPES:
        raise LmpressInputError(
            f"the runtime does not support rope_type {rope_type!r} (supported: {', '.join(STATIC_ROPE_TYPES)})"
        )
    if rope_type == "default":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    # Imported here: it costs ~23 MB of resident memory (measured), and default RoPE needs none of it.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, **({"layer_type": kind} if kind else {}))
    return inv_freq.float(), float(scale)


@dataclass(frozen=True)
class Build:
    """How the runtime model is built: the dtype of its activations and dense weights, and its kernels."""

    dtype: torch.dtype
    kernels: str = "cpu"  # kernels.FAMILIES: "cpu", "cuda" (select.py's pick per layer), "triton", "reference"
    map_embedding: bool = False  # use the embedding table as given (memory-mapped) where it has ``dtype``
    cpu_activations: str = DEFAULT_CPU_ACTIVATIONS  # weight-only layers on the CPU: "int8" or "bf16" activations

    @property
    def shares_layers(self) -> bool:
        """Whether the model's own linear layers run as they are, unfused and uncopied ("reference" kernels)."""
        return self.kernels == "reference"

    @property
    def dense_linear(self) -> type[nn.Linear]:
        """The module class of float linear layers (their weights copied into it)."""
        if self.kernels == "cpu":
            from lmpress.runtime.kernels.cpu import DenseLinear

            return DenseLinear
        return nn.Linear

    @property
    def quantized_linear(self) -> Callable[[QuantizedLinear, torch.dtype], nn.Module]:
        return linear_kernel(self.kernels, self.cpu_activations)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, fused: bool = False) -> None:
        super().__init__()
        self.eps, self.fused = eps, fused
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            from lmpress.runtime.kernels.cuda import triton_rms_norm

            return triton_rms_norm(x, self.weight, self.eps)
        # One fused op. In float32 it equals transformers' x * rsqrt(mean(x^2) + eps) * weight bit for bit;
        # in half precision it scales before the final rounding where transformers rounds first (1 ulp apart).
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves (the transformers convention): ``x * cos + rotate_half(x) * sin``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


FEW_QUERIES = 16  # up to this many new tokens (a decode step, a speculative round) attend by few_query_attention


def few_query_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of a few queries per row ``(batch, heads, n, head_dim)`` over the cache, as two matmuls.

    The queries sharing a KV head (GQA) are stacked as rows of one matmul against that head's keys,
    so keys and values are read once and never repeated. On the CPU this beats
    ``scaled_dot_product_attention``'s kernel for a single query (~40 us per call on SmolLM2),
    and for a speculative round's 2-16 queries SDPA's GQA path, which copies each KV head per query
    head (SmolLM2's FP32 forward over 3 tokens: 28.9 -> 26.2 ms, bench/dense_matmul.py run before and after).
    """
    batch, heads, n, head_dim = q.shape
    kv_heads = keys.shape[1]
    grouped = q.reshape(batch, kv_heads, heads // kv_heads * n, head_dim)
    scores = (grouped @ keys.transpose(-1, -2)).float() * (scale or head_dim**-0.5)  # softmax in float32
    if softcap is not None:  # Gemma 2: scores bent into (-softcap, softcap) before the mask
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:  # (batch, 1, n, length): the same slots for every head
        scores = scores.view(batch, kv_heads, heads // kv_heads, n, -1).masked_fill(~mask[:, :, None], float("-inf"))
    out = scores.view(batch, kv_heads, heads // kv_heads * n, -1).softmax(dim=-1).to(values.dtype) @ values
    return out.reshape(batch, heads, n, head_dim)


def pointwise_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``few_query_attention`` written as broadcast products and sums, for the compiled static step.

    Inductor fuses these into one loop nest with the softmax; the two matmuls of
    ``few_query_attention`` stay library calls of ~20 us each on 2 CPU threads, a sixth of
    SmolLM2's compiled W4 step (``bench/runtime.py``). Eager, it would materialize the broadcast
    products, so the growing-cache path keeps ``few_query_attention``.
    """
    batch, heads, n, head_dim = q.shape
    kv_heads = keys.shape[1]
    grouped = q.reshape(batch, kv_heads, heads // kv_heads, n, 1, head_dim).float()
    keys, values = keys[:, :, None, None].float(), values[:, :, None, None].float()
    scores = (grouped * keys).sum(-1) * (scale or head_dim**-0.5)  # (batch, kv_heads, group, n, length)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:  # (batch, 1, n, length)
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    out = (scores.softmax(dim=-1)[..., None] * values).sum(-2)
    return out.to(q.dtype).reshape(batch, heads, n, head_dim)


class FusedLinear(nn.Module):
    """Several linears over one input, as one output ``cat(outputs, -1)``: one matmul where they fuse."""

    def __init__(self, parts: list[nn.Module], sizes: list[int]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.sizes = sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.parts) == 1:
            return self.parts[0](x)
        return torch.cat([part(x) for part in self.parts], dim=-1)


def fuse_linears(layers: list[nn.Module], build: Build) -> FusedLinear:
    """One module computing every layer of ``layers`` on the same input, outputs concatenated."""
    sizes = [layer.out_features for layer in layers]
    if build.shares_layers:
        return FusedLinear([_runtime_linear(layer, build) for layer in layers], sizes)
    if all(type(layer) is nn.Linear for layer in layers):
        return FusedLinear([_concat_dense(layers, build)], sizes)
    if all(isinstance(layer, QuantizedLinear) for layer in layers) and _quantized_fusable(layers):
        return FusedLinear([build.quantized_linear(_concat_quantized(layers), build.dtype)], sizes)
    return FusedLinear([_runtime_linear(layer, build) for layer in layers], sizes)


def _runtime_linear(layer: nn.Module, build: Build) -> nn.Module:
    if isinstance(layer, (QuantizedLinear, Fp8Linear)):
        return build.quantized_linear(layer, build.dtype)
    if type(layer) is nn.Linear:
        if build.shares_layers and layer.weight.dtype == build.dtype:
            return layer
        return _concat_dense([layer], build)
    if runs_itself(layer):
        return layer
    raise LmpressInputError(
        f"the runtime cannot run a {type(layer).__name__} layer (nn.Linear, QuantizedLinear or Fp8Linear)"
    )


def runs_itself(layer: nn.Module) -> bool:
    """Whether ``layer`` is a quantized linear the runtime runs through its own forward, shared:
    bitsandbytes' ``Linear8bitLt`` / ``Linear4bit``. Their ``weight`` holds codes (int8, packed 4-bit),
    never the float weight, so copying it into a dense layer would run unscaled codes."""
    return isinstance(layer, nn.Linear) and type(layer).__module__.startswith("bitsandbytes.")


def _concat_dense(layers: list[nn.Linear], build: Build) -> nn.Linear:
    biased = any(layer.bias is not None for layer in layers)
    out_features = sum(la.out_features for la in layers)
    fused = build.dense_linear(layers[0].in_features, out_features, bias=biased, dtype=build.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([layer.weight.detach() for layer in layers]))
        if biased:
            fused.bias.copy_(torch.cat([_bias_or_zeros(layer) for layer in layers]))
    return fused.requires_grad_(False)


def _bias_or_zeros(layer: nn.Module) -> torch.Tensor:
    if layer.bias is None:
        return torch.zeros(layer.out_features)
    return layer.bias.detach().float()


def _quantized_fusable(layers: list[QuantizedLinear]) -> bool:
    first = layers[0]
    return all(
        layer.scheme == first.scheme
        and layer.in_features == first.in_features
        and layer.scales.dtype == first.scales.dtype
        and trivial_g_idx(layer.g_idx, layer.in_features, layer.scheme)
        for layer in layers
    )


def _concat_quantized(layers: list[QuantizedLinear]) -> QuantizedLinear:
    """Stack the layers' rows: codes are packed along the input axis, so rows concatenate as they are."""
    first = layers[0]
    biased = any(layer.bias is not None for layer in layers)
    out_features = sum(layer.out_features for layer in layers)
    fused = QuantizedLinear(first.in_features, out_features, first.scheme, biased, first.scales.dtype)
    fused.qweight.copy_(torch.cat([layer.qweight for layer in layers]))
    fused.scales.copy_(torch.cat([layer.scales for layer in layers]))
    fused.zeros.copy_(torch.cat([layer.zeros for layer in layers]))
    if biased:
        with torch.no_grad():
            fused.bias.copy_(torch.cat([_bias_or_zeros(layer) for layer in layers]))
    return fused


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, hf_attn: nn.Module, window: int | None, build: Build) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.window = window
        self.scale, self.softcap = args.attn_scale, args.attn_softcap
        fused = getattr(hf_attn, "qkv_proj", None)  # Phi-3: q, k, v rows in one linear already
        self.wqkv = fuse_linears(
            [fused] if fused is not None else [hf_attn.q_proj, hf_attn.k_proj, hf_attn.v_proj], build
        )
        self.wo = fuse_linears([hf_attn.o_proj], build)
        offset = args.norm_offset
        self.q_norm = _copy_norm(hf_attn.q_norm, args.norm_eps, build, offset) if args.qk_norm else None
        self.k_norm = _copy_norm(hf_attn.k_norm, args.norm_eps, build, offset) if args.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | StaticSlots,
        layer: int,
    ) -> torch.Tensor:
        batch, n_new, _ = x.shape
        heads = self.n_heads + self.n_kv_heads
        qkv = self.wqkv(x)
        qk = qkv[..., : heads * self.head_dim].view(batch, n_new, heads, self.head_dim)
        v = qkv[..., heads * self.head_dim :].view(batch, n_new, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :, : self.n_heads]), self.k_norm(qk[:, :, self.n_heads :])), dim=2)
        qk = apply_rope(qk.transpose(1, 2), cos, sin)  # queries and keys rotated in one go
        q, k = qk[:, : self.n_heads], qk[:, self.n_heads :]
        keys, values = cache.update(layer, k, v.transpose(1, 2))
        if isinstance(cache, StaticSlots):  # the fixed-shape step torch.compile captures
            out = pointwise_attention(q, keys, values, mask, self.scale, self.softcap)
        elif n_new <= FEW_QUERIES or self.softcap is not None:  # SDPA cannot soft-cap
            out = few_query_attention(q, keys, values, mask, self.scale, self.softcap)
        else:
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, enable_gqa=self.n_heads != self.n_kv_heads, scale=self.scale
            )
        return self.wo(out.transpose(1, 2).reshape(batch, n_new, self.n_heads * self.head_dim))


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


class MoEFeedForward(nn.Module):
    """A routed mixture of gated experts (Mixtral, Qwen2-MoE, Qwen3-MoE): softmax over the router's logits in
    float32, the top k experts per token (their weights renormalized where the model does), each expert's output
    weighted and summed; Qwen2-MoE adds a shared expert behind a sigmoid gate."""

    def __init__(self, hf_mlp: nn.Module, config, build: Build) -> None:
        super().__init__()
        from lmpress.calib.moe import UnfusedExperts

        experts = hf_mlp.experts
        # Sharing the model's layers (the evals' decoding), fused float experts run as they are: copy nothing.
        self.own_block = hf_mlp if build.shares_layers and not isinstance(experts, UnfusedExperts) else None
        if self.own_block is not None:
            return
        if not isinstance(experts, UnfusedExperts):  # float experts still fused (E, 2I, H): one linear each
            experts = UnfusedExperts.from_fused(experts, "mlp.experts")
        self.experts = nn.ModuleList(FeedForward(expert, build) for expert in experts)
        self.router = nn.Parameter(hf_mlp.gate.weight.detach().to(build.dtype), requires_grad=False)
        self.top_k = config.num_experts_per_tok
        self.normalize = config.model_type == "mixtral" or bool(getattr(config, "norm_topk_prob", False))
        shared = getattr(hf_mlp, "shared_expert", None)
        self.shared = FeedForward(shared, build) if shared is not None else None
        self.shared_gate = fuse_linears([hf_mlp.shared_expert_gate], build) if shared is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.own_block is not None:
            return self.own_block(x)
        flat = x.reshape(-1, x.shape[-1])
        probs = F.linear(flat, self.router).float().softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == e)
            if rows.numel():
                y = expert(flat[rows]) * weights[rows, slot, None].to(flat.dtype)
                out.index_add_(0, rows, y)
        if self.shared is not None:
            out = out + torch.sigmoid(self.shared_gate(flat)) * self.shared(flat)
        return out.reshape(x.shape)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, hf_layer: nn.Module, window: int | None, build: Build, config=None) -> None:
        super().__init__()
        self.attention = Attention(args, hf_layer.self_attn, window, build)
        if hasattr(hf_layer.mlp, "experts"):
            self.feed_forward = MoEFeedForward(hf_layer.mlp, config, build)
        else:
            self.feed_forward = FeedForward(hf_layer.mlp, build, args.activation)
        offset = args.norm_offset
        self.attention_norm = _copy_norm(hf_layer.input_layernorm, args.norm_eps, build, offset)
        # Gemma's sandwich: post_attention_layernorm normalizes the attention's output, and the MLP
        # has a norm on each side; elsewhere post_attention_layernorm is the MLP's input norm.
        self.post_attention_norm = self.post_ffn_norm = None
        if args.sandwich:
            self.post_attention_norm = _copy_norm(hf_layer.post_attention_layernorm, args.norm_eps, build, offset)
            self.ffn_norm = _copy_norm(hf_layer.pre_feedforward_layernorm, args.norm_eps, build, offset)
            self.post_ffn_norm = _copy_norm(hf_layer.post_feedforward_layernorm, args.norm_eps, build, offset)
        else:
            self.ffn_norm = _copy_norm(hf_layer.post_attention_layernorm, args.norm_eps, build, offset)


def _copy_norm(hf_norm: nn.Module, eps: float, build: Build, offset: float = 0.0) -> RMSNorm:
    """The runtime's RMSNorm for ``hf_norm``; ``offset`` 1 for norms scaling by (1 + weight) (Gemma's)."""
    eps = getattr(hf_norm, "variance_epsilon", getattr(hf_norm, "eps", eps))
    norm = RMSNorm(hf_norm.weight.shape[0], eps, build.dtype, fused=build.kernels in ("cuda", "triton"))
    with torch.no_grad():
        norm.weight.copy_(hf_norm.weight.float() + offset)
    return norm


class Transformer(nn.Module):
    """Token ids + a ``KVCache`` in, logits out; the cache advances by the tokens read."""

    def __init__(self, args: ModelArgs, hf_model: nn.Module, build: Build) -> None:
        super().__init__()
        self.args, self.dtype, self.kernels = args, build.dtype, build.kernels
        dtype, base = build.dtype, hf_model.model
        # Copied unless sharing or mapped: a view into a transformers model would keep its whole loaded
        # checkpoint (mmapped) resident; lmpress's own mapping (checkpoint.py) drops what it has read.
        embedding = base.embed_tokens.weight.detach().to(dtype, copy=not (build.shares_layers or build.map_embedding))
        self.tok_embeddings = nn.Embedding.from_pretrained(embedding, freeze=True)
        self.layers = nn.ModuleList(
            Block(args, layer, args.windows[i], build, hf_model.config) for i, layer in enumerate(base.layers)
        )
        self.norm = _copy_norm(base.norm, args.norm_eps, build, args.norm_offset)
        self.output = _output_layer(hf_model, self.tok_embeddings, build)
        mapped = build.map_embedding and embedding.data_ptr() == base.embed_tokens.weight.data_ptr()
        if mapped and getattr(self.output, "weight", None) is not self.tok_embeddings.weight:
            self.tok_embeddings = MappedEmbedding(embedding)  # untied: a step needs only its tokens' rows
        self.output_tokens: torch.Tensor | None = None  # token id of each output row, where not all (a draft's)
        # One cos/sin table per RoPE setting: rope_cos/rope_sin, and rope_cos_1... for Gemma 3's other layer type.
        self.rope_of_kind = {kind: i for i, kind in enumerate(dict.fromkeys(args.kinds))}
        for kind, i in self.rope_of_kind.items() or {None: 0}.items():
            inv_freq, rope_scale = rope_inverse_frequencies(hf_model.config, kind)
            angles = torch.arange(args.max_seq_len, dtype=torch.float)[:, None] * inv_freq[None, :]
            angles = torch.cat((angles, angles), dim=-1)
            suffix = f"_{i}" if i else ""
            self.register_buffer("rope_cos" + suffix, (angles.cos() * rope_scale).to(dtype), persistent=False)
            self.register_buffer("rope_sin" + suffix, (angles.sin() * rope_scale).to(dtype), persistent=False)

    @classmethod
    @torch.no_grad()
    def from_hf(
        cls,
        hf_model: nn.Module,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        kernels: str | None = None,
        cpu_activations: str = DEFAULT_CPU_ACTIVATIONS,
    ) -> Transformer:
        """The runtime model for ``hf_model`` (a transformers causal LM) on ``device``.

        ``dtype`` defaults to the model's own; ``kernels`` to the device's: lmpress's and torch's packed
        kernels on the CPU (weight-only layers' activations as ``cpu_activations``: "int8" or "bf16"), ``"cuda"``
        on a GPU (per layer, the kernel ``kernels/select.py`` picks;
        ``"triton"`` on the CPU runs Triton's interpreter, for tests). Weights are repacked on the
        CPU, then moved (a GPU-only layout, tinygemm's, is packed as the module moves).
        """
        args = ModelArgs.from_config(hf_model.config)
        dtype = dtype or hf_model.model.embed_tokens.weight.dtype
        device = torch.device(device)
        kernels = kernels or ("cuda" if device.type == "cuda" else "cpu")
        return cls(args, hf_model, Build(dtype, kernels, cpu_activations=cpu_activations)).eval().to(device)

    @classmethod
    def sharing(cls, hf_model: nn.Module) -> Transformer | None:
        """A runtime view of ``hf_model`` running its own linear layers (no weight copied), or None where the
        runtime does not support its architecture. Decoding on it gives the model's own numerics."""
        from transformers import PreTrainedModel

        if not isinstance(hf_model, PreTrainedModel):
            return None
        try:
            return cls.from_hf(hf_model, device=next(hf_model.parameters()).device, kernels="reference")
        except LmpressInputError:
            return None

    @property
    def device(self) -> torch.device:
        return self.rope_cos.device

    def new_cache(self, batch: int, max_len: int, pad: torch.Tensor | None = None) -> KVCache:
        """A cache for ``batch`` rows of at most ``max_len`` tokens (at most the model's context)."""
        if max_len > self.args.max_seq_len:
            raise LmpressInputError(f"{max_len} tokens exceed the model's context of {self.args.max_seq_len}")
        args = self.args
        return KVCache(args.n_layers, batch, max_len, args.n_kv_heads, args.head_dim, self.dtype, pad, self.device)

    def forward(self, tokens: torch.Tensor, cache: KVCache, last_only: bool = False) -> torch.Tensor:
        """Logits ``(batch, n_new, vocab)`` for ``tokens`` ``(batch, n_new)`` read after the cache's contents;
        with ``last_only``, ``(batch, 1, vocab)`` for the last position only (a prefill needs no more)."""
        tokens, n_new = tokens.to(self.device), tokens.shape[1]
        if cache.length + n_new > cache.max_len:
            raise LmpressInputError(f"{cache.length + n_new} tokens exceed the cache of {cache.max_len}")
        positions = cache.positions(n_new)
        masks = {window: cache.attention_mask(n_new, window) for window in set(self.args.windows)}
        logits = self._run(tokens, positions, masks, cache, last_only)
        cache.advance(n_new)
        return logits

    def forward_static(
        self, tokens: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor], pad: torch.Tensor, pos: torch.Tensor
    ) -> torch.Tensor:
        """Logits ``(batch, n, vocab)`` for ``tokens`` ``(batch, n)`` written at slots ``pos`` ``(n,)`` of a
        cache's ``k``/``v`` with row padding ``pad``. Every shape is fixed by the cache's size and ``n``, so
        this is the step ``torch.compile`` (and CUDA graphs) can capture once; the caller advances the cache."""
        max_len = k[0].shape[2]
        masks = {window: static_slots_mask(pad, pos, max_len, window) for window in set(self.args.windows)}
        positions = (pos[None, :] - pad[:, None]).clamp(min=0)
        return self._run(tokens, positions, masks, StaticSlots(k, v, pos))

    def _run(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        masks: dict,
        cache: KVCache | StaticSlots,
        last_only: bool = False,
    ) -> torch.Tensor:
        ropes = [
            (
                getattr(self, f"rope_cos{suffix}")[positions][:, None],
                getattr(self, f"rope_sin{suffix}")[positions][:, None],
            )
            for suffix in [""] + [f"_{i}" for i in range(1, len(self.rope_of_kind))]
        ]
        x = self.tok_embeddings(tokens)
        if self.args.embed_scale is not None:  # Gemma: the scale rounded to the activations' dtype, as transformers
            x = x * torch.tensor(self.args.embed_scale, dtype=x.dtype)
        for i, block in enumerate(self.layers):
            cos, sin = ropes[self.rope_of_kind[self.args.kinds[i]] if self.args.kinds else 0]
            h = block.attention(block.attention_norm(x), cos, sin, masks[block.attention.window], cache, i)
            x = x + (block.post_attention_norm(h) if block.post_attention_norm is not None else h)
            h = block.feed_forward(block.ffn_norm(x))
            x = x + (block.post_ffn_norm(h) if block.post_ffn_norm is not None else h)
        if last_only:
            x = x[:, -1:]
        logits = self.output(self.norm(x))
        if self.args.final_softcap is not None:  # Gemma 2: logits bent into (-cap, cap)
            logits = torch.tanh(logits / self.args.final_softcap) * self.args.final_softcap
        return logits


def _output_layer(hf_model: nn.Module, embeddings: nn.Embedding, build: Build) -> nn.Module:
    head = hf_model.get_output_embeddings()
    if type(head) is nn.Linear and head.weight is hf_model.model.embed_tokens.weight:
        tied = build.dense_linear(embeddings.embedding_dim, embeddings.num_embeddings, bias=False, dtype=build.dtype)
        tied.weight = embeddings.weight  # tied embeddings: one tensor, read by both
        return tied.requires_grad_(False)
    return _runtime_linear(head, build)
