"""Where a model's parts are, by architecture family: the layer-wise engine, the quantizers and the exporters
find decoder layers, their linear layers, norms, embeddings and head here, without tracing the graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from lmpress.errors import LmpressInputError


@dataclass(frozen=True)
class Anatomy:
    """Where things are in one architecture family, as module paths.

    ``sequential``: the linear layers of one decoder layer, grouped in dependency
    order (a group's inputs depend only on earlier groups).
    ``scaling_pairs``: (module whose output feeds the linears, the linears); the
    module is a norm or a linear whose output channels can absorb per-channel
    scales (AWQ, SmoothQuant).
    ``blocks``: submodules of a decoder layer whose output depends only on what
    they are called with (attention without a KV cache, the MLP); the engine
    replays a finished block's outputs instead of recomputing them.
    ``fed_only_by``: (linear, the linears its input is computed from, whose
    outputs go nowhere else): the engine replays the linear's recorded input and
    skips those producers once they are finished.
    ``attention``: the attention module; while its output projection's input is
    replayed, the engine skips its attention kernel as well.
    """

    layers: str
    embed: str
    final_norm: str
    lm_head: str
    sequential: tuple[tuple[str, ...], ...]
    scaling_pairs: tuple[tuple[str, tuple[str, ...]], ...]
    # Modules outside the decoder layers that the first layer's inputs pass through.
    pre_layer_modules: tuple[str, ...] = ()
    blocks: tuple[str, ...] = ()
    fed_only_by: tuple[tuple[str, tuple[str, ...]], ...] = ()
    attention: str | None = None
    norm_kind: str = "rms"
    # What a norm's weight adds to its output scale: Gemma's RMSNorm multiplies by (1 + weight).
    norm_offset: float = 0.0
    # (linear, part, parts): of a fused linear (Phi-3's qkv_proj, gate_up_proj), only output rows
    # part of ``parts`` equal slices feed the next linear of its scaling pair.
    fused_rows: tuple[tuple[str, int, int], ...] = ()
    families: tuple[str, ...] = field(default=())

    @property
    def has_experts(self) -> bool:
        """Whether the family's layers hold per-expert linears (``experts.*``) once unfused (a MoE family)."""
        return any(".experts.*." in f".{name}" for group in self.sequential for name in group)

    def rows_feeding(self, prev: str) -> tuple[int, int] | None:
        """(part, parts) where ``prev`` is a fused linear of which only one slice of rows feeds its pair."""
        for name, part, parts in self.fused_rows:
            if name == prev:
                return part, parts
        return None


_LLAMA = Anatomy(
    layers="model.layers",
    embed="model.embed_tokens",
    final_norm="model.norm",
    lm_head="lm_head",
    sequential=(
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("self_attn.o_proj",),
        ("mlp.gate_proj", "mlp.up_proj"),
        ("mlp.down_proj",),
    ),
    scaling_pairs=(
        ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        ("self_attn.v_proj", ("self_attn.o_proj",)),
        ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        ("mlp.up_proj", ("mlp.down_proj",)),
    ),
    pre_layer_modules=("model.embed_tokens", "model.rotary_emb"),
    blocks=("self_attn", "mlp"),
    fed_only_by=(
        ("self_attn.o_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        ("mlp.down_proj", ("mlp.gate_proj", "mlp.up_proj")),
    ),
    attention="self_attn",
    families=("llama", "mistral", "qwen2", "qwen3"),
)

_OPT = Anatomy(
    layers="model.decoder.layers",
    embed="model.decoder.embed_tokens",
    final_norm="model.decoder.final_layer_norm",
    lm_head="lm_head",
    sequential=(
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("self_attn.out_proj",),
        ("fc1",),
        ("fc2",),
    ),
    scaling_pairs=(
        ("self_attn_layer_norm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        ("self_attn.v_proj", ("self_attn.out_proj",)),
        ("final_layer_norm", ("fc1",)),
        ("fc1", ("fc2",)),
    ),
    pre_layer_modules=("model.decoder.embed_tokens", "model.decoder.embed_positions"),
    blocks=("self_attn",),
    fed_only_by=(
        ("self_attn.out_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        ("fc2", ("fc1",)),
    ),
    attention="self_attn",
    norm_kind="layer",
    families=("opt",),
)

# Mixture-of-experts families: per-expert linears exist once lmpress.moe.unfuse_experts
# has split the fused expert parameters; ``*`` in a name matches the expert index.
_MOE_ATTENTION = _LLAMA.sequential[:2]
_MIXTRAL = Anatomy(
    layers="model.layers",
    embed="model.embed_tokens",
    final_norm="model.norm",
    lm_head="lm_head",
    sequential=_MOE_ATTENTION
    + (
        (
            "mlp.experts.*.gate_proj",
            "mlp.experts.*.up_proj",
            "mlp.shared_expert.gate_proj",
            "mlp.shared_expert.up_proj",
            "mlp.shared_expert_gate",
        ),
        ("mlp.experts.*.down_proj", "mlp.shared_expert.down_proj"),
    )
    + _LLAMA.sequential[2:],
    scaling_pairs=_LLAMA.scaling_pairs[:2],
    pre_layer_modules=("model.embed_tokens", "model.rotary_emb"),
    blocks=("self_attn", "mlp"),
    # Not down_proj: calibration runs every expert on every token, which is not the routed input.
    fed_only_by=_LLAMA.fed_only_by[:1],
    attention="self_attn",
    families=("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"),
)

# DeepSeek-V2 / V3: multi-head latent attention. q (q_a_proj, its norm, q_b_proj; q_proj where q_lora_rank is
# null) and the kv latent (kv_a_proj_with_mqa, its norm, kv_b_proj) are low-rank pairs: the b projections read
# what the a projections wrote, so they are a later group. The first ``first_k_dense_replace`` layers have a dense
# MLP, the rest shared experts beside the routed ones; the router (``mlp.gate``) is a parameter, kept in float.
# The post-attention norm also feeds the router, so it takes no scales in the MoE layers (no dense MLP there).
_MLA_ATTENTION = (
    ("self_attn.q_proj", "self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"),
    ("self_attn.q_b_proj", "self_attn.kv_b_proj"),
    ("self_attn.o_proj",),
)
_DEEPSEEK = Anatomy(
    layers="model.layers",
    embed="model.embed_tokens",
    final_norm="model.norm",
    lm_head="lm_head",
    sequential=_MLA_ATTENTION
    + (
        (
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.experts.*.gate_proj",
            "mlp.experts.*.up_proj",
            "mlp.shared_experts.gate_proj",
            "mlp.shared_experts.up_proj",
        ),
        ("mlp.down_proj", "mlp.experts.*.down_proj", "mlp.shared_experts.down_proj"),
    ),
    scaling_pairs=(
        ("input_layernorm", ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa")),
        ("input_layernorm", ("self_attn.q_proj", "self_attn.kv_a_proj_with_mqa")),
        ("self_attn.q_a_layernorm", ("self_attn.q_b_proj",)),
        ("self_attn.kv_a_layernorm", ("self_attn.kv_b_proj",)),
        ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        ("mlp.up_proj", ("mlp.down_proj",)),
        ("mlp.shared_experts.up_proj", ("mlp.shared_experts.down_proj",)),
    ),
    pre_layer_modules=("model.embed_tokens", "model.rotary_emb"),
    blocks=("self_attn", "mlp"),
    fed_only_by=(
        (
            "self_attn.o_proj",
            ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj"),
        ),
        ("self_attn.o_proj", ("self_attn.q_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj")),
        ("mlp.down_proj", ("mlp.gate_proj", "mlp.up_proj")),
    ),
    attention="self_attn",
    families=("deepseek_v2", "deepseek_v3"),
)

# Phi-3 (and Phi-4, same model_type): q/k/v and gate/up are each one fused linear. Only the up half of
# gate_up_proj feeds down_proj; qkv_proj's v third feeds o_proj where the heads are not grouped (else
# the pair's widths differ and AWQ / SmoothQuant skip it).
_PHI3 = Anatomy(
    layers="model.layers",
    embed="model.embed_tokens",
    final_norm="model.norm",
    lm_head="lm_head",
    sequential=(("self_attn.qkv_proj",), ("self_attn.o_proj",), ("mlp.gate_up_proj",), ("mlp.down_proj",)),
    scaling_pairs=(
        ("input_layernorm", ("self_attn.qkv_proj",)),
        ("self_attn.qkv_proj", ("self_attn.o_proj",)),
        ("post_attention_layernorm", ("mlp.gate_up_proj",)),
        ("mlp.gate_up_proj", ("mlp.down_proj",)),
    ),
    pre_layer_modules=("model.embed_tokens", "model.rotary_emb"),
    blocks=("self_attn", "mlp"),
    fed_only_by=(("self_attn.o_proj", ("self_attn.qkv_proj",)), ("mlp.down_proj", ("mlp.gate_up_proj",))),
    attention="self_attn",
    fused_rows=(("self_attn.qkv_proj", 2, 3), ("mlp.gate_up_proj", 1, 2)),
    families=("phi3",),
)

# Gemma 2 / Gemma 3 (text): sandwich norms. post_attention_layernorm normalizes the attention's output,
# so the MLP's inputs come from pre_feedforward_layernorm; every norm scales by (1 + weight).
_GEMMA = Anatomy(
    layers="model.layers",
    embed="model.embed_tokens",
    final_norm="model.norm",
    lm_head="lm_head",
    sequential=_LLAMA.sequential,
    scaling_pairs=(
        ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        ("self_attn.v_proj", ("self_attn.o_proj",)),
        ("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        ("mlp.up_proj", ("mlp.down_proj",)),
    ),
    pre_layer_modules=("model.embed_tokens", "model.rotary_emb"),
    blocks=("self_attn", "mlp"),
    fed_only_by=_LLAMA.fed_only_by,
    attention="self_attn",
    norm_offset=1.0,
    families=("gemma2", "gemma3_text"),
)

ANATOMIES: dict[str, Anatomy] = {
    family: a for a in (_LLAMA, _OPT, _MIXTRAL, _PHI3, _GEMMA, _DEEPSEEK) for family in a.families
}


# Families people bring whose anatomy lmpress lacks, with what it would have to learn (named in the refusal).
MISSING: dict[str, str] = {}


def unsupported(model_type: object) -> str:
    """The one-line refusal of an architecture without an anatomy."""
    missing = f"; lmpress lacks its {MISSING[model_type]}" if model_type in MISSING else ""
    return f"architecture {model_type!r} is not supported{missing} (lmpress supports: {', '.join(sorted(ANATOMIES))})"


def get_anatomy(model: nn.Module) -> Anatomy:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in ANATOMIES:
        raise LmpressInputError(unsupported(model_type))
    return ANATOMIES[model_type]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.get_submodule(get_anatomy(model).layers)


def layer_linears(layer: nn.Module) -> dict[str, nn.Linear]:
    """Every nn.Linear inside one decoder layer, by its path relative to the layer."""
    return {name: m for name, m in layer.named_modules() if isinstance(m, nn.Linear)}


def context_length(model: nn.Module) -> int:
    config = model.config
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        if getattr(config, key, None):
            return int(getattr(config, key))
    raise LmpressInputError(f"cannot tell the context length of {config.model_type!r} models")
