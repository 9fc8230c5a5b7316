"""A minimal Llama decoder in the style of pytorch-labs' gpt-fast (``model.py`` + ``generate.py``), written here as
the yardstick ``bench/runtime_gpu.py`` times lmpress's decode against in the same process (issue 51 part 4).

What makes gpt-fast fast is kept: a fixed-size KV cache sized to the run, fused q/k/v, one
``scaled_dot_product_attention`` over the whole cache with a mask, and ``decode_one_token`` (forward + argmax)
compiled with ``mode="reduce-overhead", fullgraph=True`` (CUDA graphs). W4 layers are gpt-fast's
``WeightOnlyInt4Linear``: torch's tinygemm (``_weight_int4pack_mm``) over ``_convert_weight_to_int4pack``'s layout,
fed the same codes and scale-and-zero tensor lmpress's ``TinyGemmLinear`` runs (on the CPU, the kernels' CPU twins).
RoPE is applied as transformers' Llama applies it (halves rotated), so the weights load as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class KVCache(nn.Module):
    def __init__(self, batch: int, heads: int, length: int, head_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(batch, heads, length, head_dim, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(batch, heads, length, head_dim, dtype=dtype))

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k_cache[:, :, input_pos] = k
        self.v_cache[:, :, input_pos] = v
        return self.k_cache, self.v_cache


class WeightOnlyInt4Linear(nn.Module):
    """gpt-fast's int4 linear: tinygemm over nibble pairs repacked for the tensor cores."""

    def __init__(self, pairs: torch.Tensor, scale_and_zero: torch.Tensor, group: int, device: torch.device) -> None:
        super().__init__()
        from lmpress.runtime.kernels.tinygemm import inner_k_tiles, unpaired

        self.out_features, self.in_features, self.group = pairs.shape[0], pairs.shape[1] * 2, group
        if device.type == "cuda":
            packed = torch.ops.aten._convert_weight_to_int4pack(pairs.to(device), inner_k_tiles(self.in_features))
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpaired(pairs), 1)
        self.register_buffer("weight", packed)
        self.register_buffer("scales_and_zeros", scale_and_zero.to(device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        mm = torch.ops.aten._weight_int4pack_mm if x.is_cuda else torch.ops.aten._weight_int4pack_mm_for_cpu
        return mm(flat, self.weight, self.group, self.scales_and_zeros).reshape(*x.shape[:-1], self.out_features)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, wqkv: nn.Module, wo: nn.Module, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.wqkv, self.wo = wqkv, wo
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.kv_cache: KVCache | None = None

    def forward(self, x, cos, sin, mask, input_pos):
        batch, n, _ = x.shape
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(batch, n, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, n, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = self.kv_cache.update(input_pos, k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(batch, n, q_size))


class FeedForward(nn.Module):
    def __init__(self, w1: nn.Module, w3: nn.Module, w2: nn.Module) -> None:
        super().__init__()
        self.w1, self.w3, self.w2 = w1, w3, w2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(weight.detach().clone(), requires_grad=False), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class Block(nn.Module):
    def __init__(self, attention: Attention, feed_forward: FeedForward, attention_norm, ffn_norm) -> None:
        super().__init__()
        self.attention, self.feed_forward = attention, feed_forward
        self.attention_norm, self.ffn_norm = attention_norm, ffn_norm

    def forward(self, x, cos, sin, mask, input_pos):
        h = x + self.attention(self.attention_norm(x), cos, sin, mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, embedding: torch.Tensor, layers: list[Block], norm: RMSNorm, output: nn.Module, config) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding.from_pretrained(embedding.detach().clone(), freeze=True)
        self.layers, self.norm, self.output, self.config = nn.ModuleList(layers), norm, output, config
        self.max_seq_length = -1

    def setup_caches(self, batch: int, length: int) -> None:
        """gpt-fast's ``setup_caches``: a cache of ``length`` slots per layer, RoPE tables and the causal mask."""
        c, device, dtype = self.config, self.tok_embeddings.weight.device, self.tok_embeddings.weight.dtype
        head_dim = c.hidden_size // c.num_attention_heads
        for block in self.layers:
            block.attention.kv_cache = KVCache(batch, c.num_key_value_heads, length, head_dim, dtype).to(device)
        theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta") or c.rope_theta  # transformers 5, 4
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        angles = torch.arange(length, dtype=torch.float)[:, None] * inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos().to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("sin", angles.sin().to(device=device, dtype=dtype), persistent=False)
        causal = torch.tril(torch.ones(length, length, dtype=torch.bool, device=device))
        self.register_buffer("causal_mask", causal, persistent=False)
        self.max_seq_length = length

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        mask = self.causal_mask[None, None, input_pos]
        cos, sin = self.cos[input_pos][None, None], self.sin[input_pos][None, None]
        x = self.tok_embeddings(idx)
        for block in self.layers:
            x = block(x, cos, sin, mask, input_pos)
        return self.output(self.norm(x))


def decode_one_token(model: Transformer, x: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    """gpt-fast's step (greedy): one token in, the next token out."""
    logits = model(x, input_pos)
    return torch.argmax(logits[:, -1], dim=-1, keepdim=True)


def _linear(modules: list[nn.Module], device: torch.device) -> nn.Module:
    """One linear over ``modules``' outputs side by side: bf16 ``nn.Linear``s concatenated, or lmpress
    ``QuantizedLinear``s as one ``WeightOnlyInt4Linear`` over their codes (same group width)."""
    from lmpress.runtime.kernels.tinygemm import tinygemm_linear
    from lmpress.weights.qlinear import QuantizedLinear

    if all(isinstance(m, QuantizedLinear) for m in modules):
        packed = [tinygemm_linear(m) for m in modules]
        if any(p.perm is not None for p in packed) or len({p.group for p in packed}) > 1:
            raise ValueError("the reference takes RTN codes in one group width (no act-order)")
        pairs = torch.cat([p.pairs for p in packed], 0)
        scale_and_zero = torch.cat([p.scale_and_zero for p in packed], 1)
        return WeightOnlyInt4Linear(pairs, scale_and_zero, packed[0].group, device)
    weight = torch.cat([m.weight.detach() for m in modules], 0)
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=device, dtype=torch.bfloat16)
    linear.weight.requires_grad_(False).copy_(weight)
    return linear


@torch.no_grad()
def reference_from_hf(hf: nn.Module, device: torch.device) -> Transformer:
    """The reference for a transformers Llama whose decoder linears are ``nn.Linear`` (bf16) or lmpress
    ``QuantizedLinear`` (W4, run as gpt-fast's int4 linear); the head stays as it is (bf16)."""
    c = hf.config
    head_dim = c.hidden_size // c.num_attention_heads
    layers = []
    for layer in hf.model.layers:
        a, m = layer.self_attn, layer.mlp
        attention = Attention(
            _linear([a.q_proj, a.k_proj, a.v_proj], device),
            _linear([a.o_proj], device),
            c.num_attention_heads,
            c.num_key_value_heads,
            head_dim,
        )
        ffn = FeedForward(_linear([m.gate_proj], device), _linear([m.up_proj], device), _linear([m.down_proj], device))
        norms = [RMSNorm(n.weight, c.rms_norm_eps) for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        layers.append(Block(attention, ffn, *norms))
    norm = RMSNorm(hf.model.norm.weight, c.rms_norm_eps)
    model = Transformer(hf.model.embed_tokens.weight, layers, norm, _linear([hf.lm_head], device), c)
    return model.to(device=device).eval()
