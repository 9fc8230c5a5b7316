"""Attention: rotary embeddings, the attention functions over a KV cache, and the attention modules of each family.

``Attention`` is grouped-query attention over fused q/k/v (Llama, Mistral, Qwen, Phi-3, Gemma, Mixtral, gpt-oss),
with Gemma's scaling and soft-capping, Qwen3's and Gemma 3's q/k norms and gpt-oss's sinks: a learned logit per
head in the softmax's denominator, which takes some of each query's attention and gives it to no key.
``LatentAttention`` is DeepSeek-V2/V3's multi-head latent attention.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from lmpress.runtime.kernels import cpu_attention, cpu_kv_attention
from lmpress.runtime.kernels.cpu_probe import KV_STORED_DTYPES, NOT_PROBED, kv_attention_levels
from lmpress.runtime.kernels.cuda import triton_decode_attention
from lmpress.runtime.kernels.fwht import triton_installed
from lmpress.runtime.kv_cache import KVCache, StaticSlots
from lmpress.runtime.linears import Build, copy_norm, fuse_linears

FEW_QUERIES = 16  # up to this many new tokens (a decode step, a speculative round) attend by few_query_attention


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves (the transformers convention): ``x * cos + rotate_half(x) * sin``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def pairs_as_halves(x: torch.Tensor) -> torch.Tensor:
    """The dimensions of ``x`` rotated as interleaved pairs ``(x0, x1), (x2, x3)...`` (DeepSeek's rope) reordered
    evens then odds, so that rotating halves (``apply_rope``) rotates each pair by its own frequency. What
    transformers' DeepSeek-V3 returns in this order too; DeepSeek-V2 returns the pairs interleaved, which permutes
    queries and keys alike and leaves every attention score as it is."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def _with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax of ``scores`` ``(batch, kv_heads, group, n, length)``, float32, where each query head's sink
    (``sinks`` ``(heads,)``) is one more logit in the denominator that no value goes with."""
    if sinks is None:
        return scores.softmax(dim=-1)
    batch, kv_heads, group, n, _ = scores.shape
    sink = sinks.float().view(1, kv_heads, group, 1, 1).expand(batch, kv_heads, group, n, 1)
    return torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]


def few_query_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a few queries per row ``(batch, heads, n, head_dim)`` over the cache, as two matmuls.

    The queries sharing a KV head (GQA) are stacked as rows of one matmul against that head's keys,
    so keys and values are read once and never repeated. On the CPU this beats
    ``scaled_dot_product_attention``'s kernel for a single query (~40 us per call on SmolLM2),
    and for a speculative round's 2-16 queries SDPA's GQA path, which copies each KV head per query
    head (SmolLM2's FP32 forward over 3 tokens: 28.9 -> 26.2 ms, bench/dense_matmul.py run before and after).
    Values may be narrower than keys (DeepSeek's latent attention).
    """
    batch, heads, n, head_dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    grouped = q.reshape(batch, kv_heads, group * n, head_dim)
    scores = (grouped @ keys.transpose(-1, -2)).float() * (scale or head_dim**-0.5)  # softmax in float32
    scores = scores.view(batch, kv_heads, group, n, -1)
    if softcap is not None:  # Gemma 2: scores bent into (-softcap, softcap) before the mask
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:  # (batch, 1, n, length): the same slots for every head
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    probs = _with_sinks(scores, sinks).reshape(batch, kv_heads, group * n, -1)
    out = probs.to(values.dtype) @ values
    return out.reshape(batch, heads, n, values.shape[-1])


def pointwise_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
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
    out = (_with_sinks(scores, sinks)[..., None] * values).sum(-2)
    return out.to(q.dtype).reshape(batch, heads, n, values.shape[-1])


def cache_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    cache: KVCache | StaticSlots,
    layer: int,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    slots_kernel: SlotsKernel | None = None,
) -> torch.Tensor:
    """The new tokens' keys and values ``k``, ``v`` ``(batch, kv_heads, n, width)`` written into ``cache``'s layer
    ``layer``, then queries ``q`` ``(batch, heads, n, head_dim)`` attending over every cached token."""
    if isinstance(cache, StaticSlots):  # the fixed-shape step torch.compile captures (and CUDA graphs replay)
        cache.write(layer, k, v)
        return slots_attention(q, mask, cache, layer, scale, softcap, sinks, slots_kernel)
    keys, values = cache.update(layer, k, v)
    return attend(q, keys, values, mask, scale, softcap, sinks)


def slots_attention(
    q: torch.Tensor,
    mask: torch.Tensor | None,
    cache: StaticSlots,
    layer: int,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    slots_kernel: SlotsKernel | None = None,
) -> torch.Tensor:
    """The compiled static step's attention over every slot of layer ``layer``: one of lmpress's ops over the layer
    as stored, reading only the filled slots, where the layer has one (``slots_kernel``) and the softmax is plain (on
    the CPU ``cpu_kv_attention``'s over float32 entries, int8, FP8 or INT4 codes, or AVX-512's ``cpu_attention``
    over float32 entries for head widths the first does not take; in CUDA builds the Triton split-K kernel,
    ``triton_attention.py``), else pointwise over the slots dequantized."""
    scale = scale or q.shape[-1] ** -0.5
    kernel = slots_kernel if softcap is None and sinks is None and mask is not None else None
    if kernel is not None and kernel.triton:
        stored = cache.stored(layer)
        if few_rows(q, stored.keys):  # float entries, int8, FP8 or INT4 codes, the filled slots only
            k, k_scales, v, v_scales, recent = stored
            return triton_decode_attention(q, k, k_scales, v, v_scales, mask, cache.pos, scale, recent)
    elif kernel is not None and q.device.type == "cpu" and kernel.codes:
        k, k_scales, v, v_scales, recent = cache.stored(layer)
        isa = kernel.level(k.dtype)
        # pos goes to every cache although only grouped keys read it: with recent and pos both None, the op's
        # call in Inductor's C++ wrapper crashed the compiled step (torch 2.13, tests/runtime/test_text.py)
        return cpu_kv_attention.kv_slots_attention(q, k, v, mask, scale, k_scales, v_scales, isa, recent, cache.pos)
    keys, values = cache.read(layer, q.dtype)
    if kernel is not None and not kernel.triton and q.device.type == "cpu":  # head widths the other cannot take
        return cpu_attention.slots_attention(q, keys, values, mask, scale)
    return pointwise_attention(q, keys, values, mask, scale, softcap, sinks)


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Queries ``(batch, heads, n, head_dim)`` attending over a growing cache's keys and values: two matmuls for a
    few queries or where SDPA lacks the model's softmax (soft-capping, sinks), SDPA otherwise."""
    if q.shape[2] <= FEW_QUERIES or softcap is not None or sinks is not None:
        return few_query_attention(q, keys, values, mask, scale, softcap, sinks)
    gqa = q.shape[1] != keys.shape[1]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa, scale=scale)


class SlotsKernel(NamedTuple):
    """Which of lmpress's attention ops a layer can take in the compiled step: on the CPU, AVX-512's over float32
    caches (``cpu_attention``), AVX2's or AVX-512's over float32 caches and int8 / FP8 codes (``cpu_kv_attention``:
    the faster of the two where both fit, 1.4-1.9x at 1-4k slots on a Xeon); in CUDA (and Triton) builds, the
    Triton kernel over float entries and int8 / FP8 codes (``triton_attention.py``)."""

    floats: bool
    codes: bool
    triton: bool = False
    levels: tuple[int, ...] = NOT_PROBED  # cpu_kv_attention's level per stored type (cpu_probe.KV_STORED)

    def level(self, stored: torch.dtype) -> int:
        """``cpu_kv_attention``'s level for a cache stored as ``stored`` (torch.uint8: INT4 codes)."""
        return self.levels[KV_STORED_DTYPES.index(stored)]


TRITON_MAX_ROWS = 64  # query rows per KV head (grouped heads x new tokens) the Triton kernel takes: decode steps
# and speculative rounds; a static prefill's rows go pointwise


def few_rows(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether the step's query rows per KV head fit the Triton kernel (``TRITON_MAX_ROWS``)."""
    return q.shape[2] * (q.shape[1] // keys.shape[1]) <= TRITON_MAX_ROWS


def slots_kernel_fits(
    build: Build, head_dim: int, value_dim: int, kv_heads: int = 1, rows: int = 1
) -> SlotsKernel | None:
    """The attention ops a layer built by ``build`` can attend by in the compiled step (None: none); on the CPU,
    ``cpu_kv_attention``'s instruction set level per stored type as this host's probe chooses it for ``kv_heads``
    KV heads and ``rows`` query rows per KV head (``cpu_probe.kv_attention_levels``)."""
    if build.kernels in ("cuda", "triton") and triton_installed():
        from lmpress.runtime.kernels import triton_attention

        return SlotsKernel(False, False, True) if triton_attention.fits(head_dim, value_dim) else None
    if build.kernels != "cpu":
        return None
    floats = cpu_attention.fits(head_dim, value_dim, build.dtype)
    codes = cpu_kv_attention.fits(head_dim, value_dim, build.dtype)
    if not (floats or codes):
        return None
    return SlotsKernel(floats, codes, levels=kv_attention_levels(kv_heads, rows, head_dim) if codes else NOT_PROBED)


class Attention(nn.Module):
    def __init__(self, args, hf_attn: nn.Module, window: int | None, build: Build) -> None:
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
        self.q_norm = copy_norm(hf_attn.q_norm, args.norm_eps, build, offset) if args.qk_norm else None
        self.k_norm = copy_norm(hf_attn.k_norm, args.norm_eps, build, offset) if args.qk_norm else None
        sinks = getattr(hf_attn, "sinks", None)  # gpt-oss
        self.sinks = None if sinks is None else nn.Parameter(sinks.detach().float().clone(), requires_grad=False)
        rows = self.n_heads // self.n_kv_heads  # a decode step's query rows per KV head
        self.slots_kernel = slots_kernel_fits(build, self.head_dim, self.head_dim, self.n_kv_heads, rows)

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
        if cache.rotation is not None:  # a quantized cache's Hadamard turn of queries and keys (KVQuant.rotate)
            qk = qk @ cache.rotation
        q, k = qk[:, : self.n_heads], qk[:, self.n_heads :]
        v = v.transpose(1, 2)
        out = cache_attention(q, k, v, mask, cache, layer, self.scale, self.softcap, self.sinks, self.slots_kernel)
        return self.wo(out.transpose(1, 2).reshape(batch, n_new, self.n_heads * self.head_dim))


def latent_attention_scale(config) -> float:
    """DeepSeek's softmax scale: ``(nope + rope head dim) ** -0.5``, times ``mscale ** 2`` where its RoPE is scaled
    (YaRN's ``0.1 * mscale_all_dim * ln(factor) + 1``, as transformers' ``yarn_apply_mscale``)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = getattr(config, "rope_parameters", None) or {}
    factor, mscale_all_dim = params.get("factor", 1.0), params.get("mscale_all_dim", 0)
    if params.get("rope_type", "default") != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale = scale * mscale * mscale
    return scale


class LatentAttention(nn.Module):
    """DeepSeek-V2/V3's multi-head latent attention.

    Queries come from ``q_b_proj(q_a_layernorm(q_a_proj(x)))`` (``q_proj(x)`` where ``q_lora_rank`` is null);
    ``kv_a_proj_with_mqa(x)`` gives one compressed latent per token and one rotary key shared by every head; the
    normed latent expands by ``kv_b_proj`` into each head's no-rope key and its value. Only the rope parts of
    queries and keys are rotated (as interleaved pairs where ``rope_interleave``, and always in V2).

    The cache holds each head's full key (no-rope and rope parts) and value, as any attention's: attention then
    runs by the same functions as every family's, over keys ``nope + rope`` wide and values ``v_head_dim`` wide.
    Caching the latent instead (``kv_lora_rank + rope`` per token, ~70x less for DeepSeek-V3) needs kv_b_proj
    folded into the queries and the output, which packed kernels do not do.
    """

    def __init__(self, args, hf_attn: nn.Module, window: int | None, build: Build, interleaved: bool) -> None:
        super().__init__()
        self.n_heads = self.n_kv_heads = args.n_heads
        self.window, self.scale, self.interleaved = window, args.attn_scale, interleaved
        self.nope, self.rope, self.v_dim = hf_attn.qk_nope_head_dim, hf_attn.qk_rope_head_dim, hf_attn.v_head_dim
        self.rank = hf_attn.kv_lora_rank
        low_rank_q = hf_attn.q_lora_rank is not None
        first_q = hf_attn.q_a_proj if low_rank_q else hf_attn.q_proj
        self.q_size = first_q.out_features
        self.wa = fuse_linears([first_q, hf_attn.kv_a_proj_with_mqa], build)  # both read x
        self.q_norm = copy_norm(hf_attn.q_a_layernorm, args.norm_eps, build) if low_rank_q else None
        self.wq_b = fuse_linears([hf_attn.q_b_proj], build) if low_rank_q else None
        self.kv_norm = copy_norm(hf_attn.kv_a_layernorm, args.norm_eps, build)
        self.wkv_b = fuse_linears([hf_attn.kv_b_proj], build)
        self.wo = fuse_linears([hf_attn.o_proj], build)
        self.slots_kernel = slots_kernel_fits(build, self.nope + self.rope, self.v_dim)

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
        heads = self.n_heads
        q, latent, k_rot = self.wa(x).split([self.q_size, self.rank, self.rope], dim=-1)
        if self.wq_b is not None:
            q = self.wq_b(self.q_norm(q))
        q = q.view(batch, n_new, heads, self.nope + self.rope).transpose(1, 2)
        kv = self.wkv_b(self.kv_norm(latent)).view(batch, n_new, heads, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)
        k_rot = k_rot.view(batch, 1, n_new, self.rope)
        if self.interleaved:
            q_rot, k_rot = pairs_as_halves(q_rot), pairs_as_halves(k_rot)
        q = torch.cat((q_nope, apply_rope(q_rot, cos, sin)), dim=-1)
        k_rot = apply_rope(k_rot, cos, sin).expand(batch, heads, n_new, self.rope)
        k = torch.cat((k_nope, k_rot), dim=-1)
        out = cache_attention(q, k, v, mask, cache, layer, self.scale, slots_kernel=self.slots_kernel)
        return self.wo(out.transpose(1, 2).reshape(batch, n_new, heads * self.v_dim))
