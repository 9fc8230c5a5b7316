"""A compact decoder for the Llama family (Llama, Mistral, Qwen2, Qwen3, SmolLM), Phi-3, Gemma 2 / 3 (text), the
mixtures of experts Mixtral, Qwen2-MoE and Qwen3-MoE, DeepSeek-V2 / V3 and gpt-oss, built from a transformers model.

Phi-3's linears come fused (qkv_proj, gate_up_proj) and run as they are. Gemma's quirks are applied, each
where transformers applies it: embeddings scaled by sqrt(hidden), RMSNorms scaling by (1 + weight), sandwich
norms (post-attention, pre- and post-feedforward), GeGLU (tanh GELU), attention scaled by
``query_pre_attn_scalar`` and soft-capped, final logits soft-capped, sliding-window layers, and Gemma 3's
q/k norms with one RoPE base per layer type (local and global). DeepSeek's multi-head latent attention and its
routers are in ``attention.py`` and ``feed_forward.py``; gpt-oss's attention sinks, biases, alternating
sliding / full layers, YaRN rope, top-k-then-softmax router and clamped SwiGLU experts likewise.

``Transformer.from_hf(hf_model)`` takes the weights of an in-memory transformers
model whose linears are ``nn.Linear`` or lmpress ``QuantizedLinear``: q/k/v and
gate/up are fused into one matmul each (quantized layers too, when their schemes
match), quantized layers run the device's kernels (torch's packed CPU kernels,
``kernels/cpu.py``; Triton on CUDA, ``kernels/cuda.py``) and everything else runs in
``dtype``. ``Transformer.sharing(hf_model)`` instead runs the model's own layers, copying
nothing (what the evals decode with). The KV cache lives outside the model
(``kv_cache.py``), so a target and its draft each keep their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lmpress.errors import LmpressInputError
from lmpress.runtime.attention import Attention, LatentAttention, latent_attention_scale
from lmpress.runtime.feed_forward import ACTIVATIONS, FeedForward, MoEFeedForward
from lmpress.runtime.kernels import DEFAULT_CPU_ACTIVATIONS
from lmpress.runtime.kernels.cpu_fp4 import Fp4A8Linear
from lmpress.runtime.kernels.cpu_int import Int8ActivationLinear, gather_into_huge_pages
from lmpress.runtime.kernels.dense import linear_over
from lmpress.runtime.kv_cache import KVCache, StaticSlots, static_slots_mask
from lmpress.runtime.linears import Build, copy_norm, runtime_linear
from lmpress.runtime.mapped_embedding import MappedEmbedding
from lmpress.weights.kv_quant import KVQuant, key_rotation

SUPPORTED_MODEL_TYPES = (
    "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "mixtral", "qwen2_moe", "qwen3_moe",
    "deepseek_v2", "deepseek_v3", "gpt_oss",
)  # fmt: skip
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "gpt_oss")
LATENT_TYPES = ("deepseek_v2", "deepseek_v3")  # multi-head latent attention
GEMMA_TYPES = ("gemma2", "gemma3_text")
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
    v_head_dim: int | None = None  # where values are narrower than keys (DeepSeek's latent attention)
    latent: bool = False  # DeepSeek's multi-head latent attention
    rope_interleave: bool = False  # DeepSeek: rope rotates interleaved pairs

    @property
    def value_dim(self) -> int:
        return self.v_head_dim or self.head_dim

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
        latent = config.model_type in LATENT_TYPES
        if latent:  # every head its own key and value from the latent; keys nope + rope wide
            head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        kinds = tuple(getattr(config, "layer_types", None) or ()) if _rope_by_kind(config) else ()
        return cls(
            vocab_size=config.vocab_size,
            dim=config.hidden_size,
            n_layers=config.num_hidden_layers,
            n_heads=config.num_attention_heads,
            n_kv_heads=config.num_attention_heads
            if latent
            else config.num_key_value_heads or config.num_attention_heads,
            head_dim=head_dim,
            norm_eps=config.rms_norm_eps,
            max_seq_len=config.max_position_embeddings,
            windows=_layer_windows(config),
            qk_norm=config.model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            kinds=kinds,
            norm_offset=1.0 if gemma else 0.0,
            embed_scale=config.hidden_size**0.5 if gemma else None,
            attn_scale=config.query_pre_attn_scalar**-0.5
            if gemma
            else latent_attention_scale(config)
            if latent
            else None,
            attn_softcap=getattr(config, "attn_logit_softcapping", None) if gemma else None,
            final_softcap=getattr(config, "final_logit_softcapping", None) if gemma else None,
            sandwich=gemma,
            activation=activation,
            v_head_dim=config.v_head_dim if latent else None,
            latent=latent,
            # V2 rotates complex pairs; V3 pairs where rope_interleave (its default), else halves
            rope_interleave=latent and getattr(config, "rope_interleave", True),
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


class Block(nn.Module):
    def __init__(self, args: ModelArgs, hf_layer: nn.Module, window: int | None, build: Build, config=None) -> None:
        super().__init__()
        if args.latent:
            self.attention = LatentAttention(args, hf_layer.self_attn, window, build, args.rope_interleave)
        else:
            self.attention = Attention(args, hf_layer.self_attn, window, build)
        if hasattr(hf_layer.mlp, "experts"):
            self.feed_forward = MoEFeedForward(hf_layer.mlp, config, build)
        else:
            self.feed_forward = FeedForward(hf_layer.mlp, build, args.activation)
        offset = args.norm_offset
        self.attention_norm = copy_norm(hf_layer.input_layernorm, args.norm_eps, build, offset)
        # Gemma's sandwich: post_attention_layernorm normalizes the attention's output, and the MLP
        # has a norm on each side; elsewhere post_attention_layernorm is the MLP's input norm.
        self.post_attention_norm = self.post_ffn_norm = None
        if args.sandwich:
            self.post_attention_norm = copy_norm(hf_layer.post_attention_layernorm, args.norm_eps, build, offset)
            self.ffn_norm = copy_norm(hf_layer.pre_feedforward_layernorm, args.norm_eps, build, offset)
            self.post_ffn_norm = copy_norm(hf_layer.post_feedforward_layernorm, args.norm_eps, build, offset)
        else:
            self.ffn_norm = copy_norm(hf_layer.post_attention_layernorm, args.norm_eps, build, offset)


class Transformer(nn.Module):
    """Token ids + a ``KVCache`` in, logits out; the cache advances by the tokens read."""

    def __init__(self, args: ModelArgs, hf_model: nn.Module, build: Build) -> None:
        super().__init__()
        self.args, self.dtype, self.kernels = args, build.dtype, build.kernels
        dtype, base = build.dtype, hf_model.model
        # Copied unless sharing or mapped: a view into a transformers model would keep its whole loaded
        # checkpoint (mmapped) resident; lmpress's own mapping (checkpoint.py) drops what it has read.
        stored = base.embed_tokens.weight.detach()  # kept half precision where the build keeps it (dense_dtype)
        embedding = stored.to(build.dense_dtype(stored), copy=not (build.shares_layers or build.map_embedding))
        self.tok_embeddings = nn.Embedding.from_pretrained(embedding, freeze=True)
        self.layers = nn.ModuleList(
            Block(args, layer, args.windows[i], build, hf_model.config) for i, layer in enumerate(base.layers)
        )
        self.norm = copy_norm(base.norm, args.norm_eps, build, args.norm_offset)
        self.output = _output_layer(hf_model, self.tok_embeddings, build)
        mapped = build.map_embedding and embedding.data_ptr() == base.embed_tokens.weight.data_ptr()
        if mapped and getattr(self.output, "weight", None) is not self.tok_embeddings.weight:
            self.tok_embeddings = MappedEmbedding(embedding)  # untied: a step needs only its tokens' rows
        self.output_tokens: torch.Tensor | None = None  # token id of each output row, where not all (a draft's)
        self._kv_quant: KVQuant | None = None  # the cache ``new_cache`` makes: float, or quantized (kv_quant.py)
        self.kv_rotation: torch.Tensor | None = None  # KVQuant.rotate's matrix, on the model's device
        # One cos/sin table per RoPE setting: rope_cos/rope_sin, and rope_cos_1... for Gemma 3's other layer type.
        self.rope_of_kind = {kind: i for i, kind in enumerate(dict.fromkeys(args.kinds))}
        for kind, i in self.rope_of_kind.items() or {None: 0}.items():
            inv_freq, rope_scale = rope_inverse_frequencies(hf_model.config, kind)
            angles = torch.arange(args.max_seq_len, dtype=torch.float)[:, None] * inv_freq[None, :]
            angles = torch.cat((angles, angles), dim=-1)
            suffix = f"_{i}" if i else ""
            self.register_buffer("rope_cos" + suffix, (angles.cos() * rope_scale).to(dtype), persistent=False)
            self.register_buffer("rope_sin" + suffix, (angles.sin() * rope_scale).to(dtype), persistent=False)
        if build.kernels == "cpu":  # the layers' codes and scales in one block of huge pages, in the order a step reads
            gather_into_huge_pages(
                m for m in self.layers.modules() if isinstance(m, (Int8ActivationLinear, Fp4A8Linear))
            )

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
        runtime does not support its architecture. Decoding on it gives the model's own numerics, its KV cache
        quantized as ``lmpress.quantize.kv_attention.kv_quantized`` has the model's attention read it."""
        from transformers import PreTrainedModel

        from lmpress.quantize.kv_attention import kv_quant_of

        if not isinstance(hf_model, PreTrainedModel):
            return None
        try:
            runtime = cls.from_hf(hf_model, device=next(hf_model.parameters()).device, kernels="reference")
        except LmpressInputError:
            return None
        runtime.kv_quant = kv_quant_of(hf_model)
        return runtime

    @property
    def device(self) -> torch.device:
        return self.rope_cos.device

    @property
    def kv_quant(self) -> KVQuant | None:
        """How the caches ``new_cache`` makes are quantized (None: the model's dtype); set it after moving the
        model to its device."""
        return self._kv_quant

    @kv_quant.setter
    def kv_quant(self, kv: KVQuant | None) -> None:
        rotation = None
        if kv is not None and kv.rotate:
            if any(isinstance(block.attention, LatentAttention) for block in self.layers):
                raise LmpressInputError(
                    "kv_cache.rotate: latent attention (DeepSeek) caches no per-head keys to rotate"
                )
            rotation = key_rotation(self.args.head_dim, self.device, self.dtype)
        self._kv_quant, self.kv_rotation = kv, rotation

    def new_cache(self, batch: int, max_len: int, pad: torch.Tensor | None = None) -> KVCache:
        """A cache for ``batch`` rows of at most ``max_len`` tokens (at most the model's context), quantized as
        ``kv_quant`` says."""
        if max_len > self.args.max_seq_len:
            raise LmpressInputError(f"{max_len} tokens exceed the model's context of {self.args.max_seq_len}")
        args = self.args
        return KVCache(
            args.n_layers,
            batch,
            max_len,
            args.n_kv_heads,
            args.head_dim,
            self.dtype,
            pad,
            self.device,
            args.v_head_dim,
            self.kv_quant,
            self.kv_rotation,
        )

    def forward(self, tokens: torch.Tensor, cache: KVCache, last_only: bool = False) -> torch.Tensor:
        """Logits ``(batch, n_new, vocab)`` for ``tokens`` ``(batch, n_new)`` read after the cache's contents;
        with ``last_only``, ``(batch, 1, vocab)`` for the last position only (a prefill needs no more)."""
        return self.forward_with_features(tokens, cache, (), last_only)[0]

    def forward_with_features(
        self, tokens: torch.Tensor, cache: KVCache, feature_layers: tuple[int, ...], last_only: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward``'s logits and the residual stream entering each of ``feature_layers`` (``n_layers``: leaving
        the last) at every position read, side by side: ``(batch, n_new, len(feature_layers) * dim)`` (None for
        no layers). An EAGLE-3 draft head reads them (vLLM's aux hidden states, indexed the same way)."""
        tokens, n_new = tokens.to(self.device), tokens.shape[1]
        if cache.length + n_new > cache.max_len:
            raise LmpressInputError(f"{cache.length + n_new} tokens exceed the cache of {cache.max_len}")
        positions = cache.positions(n_new)
        masks = {window: cache.attention_mask(n_new, window) for window in set(self.args.windows)}
        logits, features = self._run(tokens, positions, masks, cache, last_only, feature_layers)
        cache.advance(n_new)
        return logits, features

    def forward_static(
        self,
        tokens: torch.Tensor,
        k: list[torch.Tensor],
        v: list[torch.Tensor],
        pad: torch.Tensor,
        pos: torch.Tensor,
        side: tuple[list[torch.Tensor], ...] = ([], [], []),
        feature_layers: tuple[int, ...] = (),
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits ``(batch, n, vocab)`` for ``tokens`` ``(batch, n)`` written at slots ``pos`` ``(n,)`` of a
        cache's ``k``/``v`` (and a quantized cache's ``side`` tensors, ``KVCache.side``) with row padding ``pad``;
        with ``feature_layers``, the features ``forward_with_features`` gives beside them.
        Every shape is fixed by the cache's size and ``n``, so this is the step ``torch.compile`` (and CUDA graphs)
        can capture once; the caller advances the cache."""
        max_len = v[0].shape[2]  # grouped keys may hold more slots (whole groups)
        masks = {window: static_slots_mask(pad, pos, max_len, window) for window in set(self.args.windows)}
        positions = (pos[None, :] - pad[:, None]).clamp(min=0)
        slots = StaticSlots(k, v, pos, side, self.kv_quant, self.kv_rotation)
        logits, features = self._run(tokens, positions, masks, slots, False, feature_layers)
        return (logits, features) if feature_layers else logits

    def _run(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        masks: dict,
        cache: KVCache | StaticSlots,
        last_only: bool = False,
        feature_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        ropes = [
            (
                getattr(self, f"rope_cos{suffix}")[positions][:, None],
                getattr(self, f"rope_sin{suffix}")[positions][:, None],
            )
            for suffix in [""] + [f"_{i}" for i in range(1, len(self.rope_of_kind))]
        ]
        x = self.tok_embeddings(tokens).to(self.dtype)  # a half-precision table's rows widened (exactly) to float32
        if self.args.embed_scale is not None:  # Gemma: the scale rounded to the activations' dtype, as transformers
            x = x * torch.tensor(self.args.embed_scale, dtype=x.dtype)
        features = []
        added = None  # the last sublayer's output, added to the residual stream x by the next norm (add_forward)
        for i, block in enumerate(self.layers):
            normed, x = block.attention_norm.add_forward(added, x)
            if i in feature_layers:
                features.append(x)
            cos, sin = ropes[self.rope_of_kind[self.args.kinds[i]] if self.args.kinds else 0]
            h = block.attention(normed, cos, sin, masks[block.attention.window], cache, i)
            h = block.post_attention_norm(h) if block.post_attention_norm is not None else h
            normed, x = block.ffn_norm.add_forward(h, x)
            h = block.feed_forward(normed)
            added = block.post_ffn_norm(h) if block.post_ffn_norm is not None else h
        final_features = len(self.layers) in feature_layers
        if last_only and not final_features:  # a prefill: the last position's norm and logits only
            x, added = x[:, -1:], None if added is None else added[:, -1:]
        normed, x = self.norm.add_forward(added, x)
        if final_features:
            features.append(x)
        if len(features) != len(feature_layers):
            raise LmpressInputError(f"feature layers {feature_layers}: the model has layers 0 to {len(self.layers)}")
        logits = self.output(normed[:, -1:] if last_only else normed)
        if self.args.final_softcap is not None:  # Gemma 2: logits bent into (-cap, cap)
            logits = torch.tanh(logits / self.args.final_softcap) * self.args.final_softcap
        return logits, torch.cat(features, -1) if features else None


def _output_layer(hf_model: nn.Module, embeddings: nn.Embedding, build: Build) -> nn.Module:
    head = hf_model.get_output_embeddings()
    if type(head) is nn.Linear and head.weight is hf_model.model.embed_tokens.weight:
        if embeddings.weight.dtype != build.dtype:  # a half-precision table in a float32 build (Build.dense_dtype)
            head = build.dense(embeddings.weight, None)
            embeddings.weight = head.weight  # the head's copy: one tensor, read by both
            return head
        return linear_over(build.dense_linear, embeddings.weight, None)  # tied: one tensor, read by both
    return runtime_linear(head, build)
