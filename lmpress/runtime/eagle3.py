"""EAGLE-3 draft heads (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models
via Training-Time Test"): one decoder layer that drafts from the target's own hidden states.

At position ``t`` the head reads the target's residual stream entering three of its layers (low, middle and
high: vLLM's default layers ``2, L // 2, L - 3``), fused by ``fc`` into one vector, beside the embedding of
token ``t + 1``, and predicts token ``t + 2`` over a reduced draft vocabulary. Each further draft reads the
head's own output vector in place of the target's: the "training-time test" it is trained for
(``lmpress.distill.draft_head``). The layer is the one vLLM's ``Eagle3LlamaForCausalLM`` runs: its attention
reads ``[input_layernorm(embedding), hidden_norm(hidden)]`` (twice the hidden size wide) and the normed hidden
is the residual (``norm_before_residual``); its weights keep the names of the speculators format vLLM loads
(``lmpress.export.speculators``).

``Eagle3Drafter`` drafts for ``speculative_decode`` with a KV cache of its own: entries read from the target's
features are kept across rounds, the chain's own entries are overwritten by the next round.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from lmpress.errors import LmpressInputError
from lmpress.export.speculators import read_speculators, speculators_config, write_speculators
from lmpress.runtime.attention import apply_rope, few_query_attention
from lmpress.runtime.direct_graph import DirectCalls
from lmpress.runtime.generate import step_compiler, tensor_meta
from lmpress.runtime.linears import Build, runtime_linear
from lmpress.runtime.model import Transformer
from lmpress.runtime.sample import SamplingConfig, draw, next_token_probs
from lmpress.weights.qlinear import quantized_linear_from
from lmpress.weights.scheme import QuantScheme, quantize_weight_rtn

# The drafter's copy of a head on the CPU: 8-bit weights per output row, run by the runtime's int8 kernels. A float32
# head (one decoder layer and an 8,192-row output) reads half a W4 SmolLM2 step's bytes at each draft.
DRAFTING_SCHEME = QuantScheme(bits=8, group_size=-1, symmetric=True)
_DRAFTING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # head -> (its tensors' versions, its copy)
HEAD_LINEARS = ("fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (q, k, v) after rope -> output


def default_feature_layers(n_layers: int) -> tuple[int, int, int]:
    """vLLM's default EAGLE-3 layers for a target of ``n_layers`` (``get_eagle3_default_aux_hidden_state_layers``):
    the residual stream entering layers 2, the middle one and the third from last."""
    layers = (2, n_layers // 2, n_layers - 3)
    if len(set(layers)) < 3 or layers[-1] < 0:
        raise LmpressInputError(f"an EAGLE-3 head reads three distinct layers of its target: {n_layers} are too few")
    return layers


@dataclass(frozen=True)
class Eagle3Config:
    """The head's shape and the targets it was trained for."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    feature_layers: tuple[int, ...]
    target_hidden_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    targets: tuple[str, ...] = ()  # fingerprints of the exported targets it was trained for

    @classmethod
    def for_target(cls, target: Transformer, hf_config: object, draft_vocab_size: int) -> Eagle3Config:
        """A head shaped as one of ``target``'s layers (``hf_config``: its transformers config), reading vLLM's
        default layers."""
        check_target(target)
        args = target.args
        rope = getattr(hf_config, "rope_parameters", None) or {}
        rope_theta = getattr(hf_config, "rope_theta", None) or rope.get("rope_theta", 10000.0)
        if not 1 <= draft_vocab_size <= args.vocab_size:
            raise LmpressInputError(
                f"a draft vocabulary of {draft_vocab_size} tokens: the target has {args.vocab_size}, choose 1 to that"
            )
        return cls(
            hidden_size=args.dim,
            intermediate_size=hf_config.intermediate_size,
            num_attention_heads=args.n_heads,
            num_key_value_heads=args.n_kv_heads,
            head_dim=args.head_dim,
            vocab_size=args.vocab_size,
            draft_vocab_size=draft_vocab_size,
            feature_layers=default_feature_layers(args.n_layers),
            target_hidden_size=args.dim,
            rms_norm_eps=args.norm_eps,
            rope_theta=float(rope_theta),
            max_position_embeddings=args.max_seq_len,
        )

    def as_dict(self) -> dict:
        return asdict(self) | {"feature_layers": list(self.feature_layers), "targets": list(self.targets)}


def check_target(target: Transformer) -> None:
    """An input error where the head cannot draft for ``target``: it reads the target's embeddings unscaled and
    its logits unbent, as vLLM's Llama-style EAGLE-3 head does."""
    args = target.args
    if args.embed_scale is not None or args.final_softcap is not None:
        raise LmpressInputError(
            "EAGLE-3 heads read a Llama-style target: this one scales its embeddings or soft-caps its logits "
            "(Gemma), which vLLM's EAGLE-3 head does not"
        )
    if args.v_head_dim is not None:
        raise LmpressInputError("EAGLE-3 heads read a Llama-style target: latent attention (DeepSeek) is not one")


class Eagle3Head(nn.Module):
    """The draft layer, its input fusion ``fc`` and its head over the draft vocabulary (``draft_tokens``: the
    target token id of each row, ascending)."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        c, d = config, config.hidden_size
        self.config = config
        self.fc = nn.Linear(len(c.feature_layers) * c.target_hidden_size, d, bias=False)
        self.hidden_norm, self.input_layernorm = nn.RMSNorm(d, c.rms_norm_eps), nn.RMSNorm(d, c.rms_norm_eps)
        self.post_attention_layernorm, self.norm = nn.RMSNorm(d, c.rms_norm_eps), nn.RMSNorm(d, c.rms_norm_eps)
        q_width, kv_width = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.q_proj = nn.Linear(2 * d, q_width, bias=False)
        self.k_proj = nn.Linear(2 * d, kv_width, bias=False)
        self.v_proj = nn.Linear(2 * d, kv_width, bias=False)
        self.o_proj = nn.Linear(q_width, d, bias=False)
        self.gate_proj = nn.Linear(d, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, d, bias=False)
        self.lm_head = nn.Linear(d, c.draft_vocab_size, bias=False)
        self.register_buffer("draft_tokens", torch.arange(c.draft_vocab_size))
        inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float) / c.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``(..., n, head_dim)`` at ``positions`` (Llama's rotary embedding, halves rotated)."""
        angles = positions.float()[..., None] * self.inv_freq
        angles = torch.cat((angles, angles), -1)
        return angles.cos(), angles.sin()

    def qkv(
        self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys (rotated) and values ``(batch, heads, n, head_dim)`` of token embeddings ``embeds`` and
        hidden vectors ``hidden`` ``(batch, n, hidden)``, and the residual stream they start."""
        c = self.config
        residual = self.hidden_norm(hidden)
        x = torch.cat((self.input_layernorm(embeds), residual), -1)
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = self.rope(positions)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, residual

    def finish(self, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The layer's output (before ``norm``: the next step's hidden) from the attention's ``(batch, heads, n,
        head_dim)`` and the residual stream."""
        b, _, n, _ = attended.shape
        residual = residual + self.o_proj(attended.transpose(1, 2).reshape(b, n, -1))
        h = self.post_attention_layernorm(residual)
        return residual + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Scores over the draft vocabulary of the layer's outputs ``hidden``."""
        return self.lm_head(self.norm(hidden))

    def repeat_kv(self, x: torch.Tensor) -> torch.Tensor:
        """Keys or values ``(batch, kv_heads, n, head_dim)`` repeated for each query head of their group."""
        return x.repeat_interleave(self.config.num_attention_heads // self.config.num_key_value_heads, dim=1)


class Eagle3Drafter:
    """Drafts for ``speculative_decode`` from the target's features (``take_features``, after each verifying read)
    with ``head``, keeping a cache of its keys and values."""

    wants_features = True

    def __init__(
        self,
        head: Eagle3Head,
        target: Transformer,
        max_len: int,
        sampling: SamplingConfig,
        generator: torch.Generator,
        step: HeadStep | None = None,
    ) -> None:
        c = head.config
        self.check_fits(head, target)
        head = drafting_head(head) if target.kernels == "cpu" else head
        self.head, self.target, self.sampling, self.generator = head, target, sampling, generator
        self.step = step or eager_head_step
        self.max_len = max_len
        shape = (1, c.num_key_value_heads, max_len, c.head_dim)
        self.k, self.v = torch.zeros(shape), torch.zeros(shape)
        self.filled = 0  # positions whose entries come from the target's features
        self.pending: list[torch.Tensor] = []  # target features of the next positions, not yet read

    @torch.no_grad()  # as the drafter's steps run: a graph traced with gradients would be another graph
    def compile_steps(self) -> None:
        """Run the head's step over one position and over two on this drafter's cache, so a compiled step has both
        its graphs before a timed run (a drafter reading a text starts from ``read_prompt``)."""
        width = self.head.config.hidden_size
        for n in (1, 2):
            self.step(self.head, torch.zeros(1, n, width), torch.zeros(1, n, width), torch.arange(n), self.k, self.v)

    @staticmethod
    def check_fits(head: Eagle3Head, target: Transformer) -> None:
        """An input error where ``head`` cannot read ``target``'s features or speak its token ids."""
        c = head.config
        check_target(target)
        if c.vocab_size != target.args.vocab_size or c.target_hidden_size != target.args.dim:
            raise LmpressInputError(
                f"the draft head was built for a target with {c.vocab_size} tokens and width {c.target_hidden_size}; "
                f"this target has {target.args.vocab_size} and {target.args.dim}"
            )

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.head.config.feature_layers

    def room(self, seq_len: int) -> int:
        """How many drafts fit after ``seq_len`` tokens (the chain writes entries up to the last draft's)."""
        return self.max_len - seq_len + 1

    def read_prompt(self, prompt: list[int]) -> None:
        """Start a new text (its features arrive from the target's prefill, by ``take_features``)."""
        self.filled, self.pending = 0, []

    def take_features(self, features: torch.Tensor) -> None:
        """The target's features ``(n, width)`` of the next ``n`` positions it has read and kept."""
        self.pending.append(features.float().cpu())

    @torch.no_grad()
    def propose(self, seq: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        features = torch.cat(self.pending)
        self.pending = []
        start, n = self.filled, features.shape[0]
        if start + n != len(seq) - 1:
            raise ValueError(f"the target's features reach position {start + n - 1}; the text needs {len(seq) - 2}")
        out, scores = self._read(seq[start + 1 :], self.head.fc(features)[None], start)
        self.filled = len(seq) - 1
        drafts: list[int] = []
        probs: list[torch.Tensor] = []
        for i in range(k):
            token, q = self._choose(scores, seq + drafts)
            drafts.append(token)
            if q is not None:
                probs.append(q)
            if i + 1 < k:
                out, scores = self._read([token], out, self.filled + i)
        return drafts, torch.stack(probs) if probs else None

    def _read(self, tokens: list[int], hidden: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Read ``tokens`` with ``hidden`` ``(1, n, hidden)`` at positions ``start...``: the last position's output
        ``(1, 1, hidden)`` and its scores over the draft vocabulary ``(1, draft_vocab)``."""
        n = len(tokens)
        if start + n > self.max_len:
            raise LmpressInputError(f"{start + n} positions exceed the draft head's cache of {self.max_len}")
        ids = torch.tensor([tokens], device=self.target.device)
        embeds = self.target.tok_embeddings(ids).float().cpu()
        return self.step(self.head, embeds, hidden, torch.arange(start, start + n), self.k, self.v)

    def _choose(self, scores: torch.Tensor, history: list[int]) -> tuple[int, torch.Tensor | None]:
        """The next draft from the head's scores ``(1, draft_vocab)``, and the distribution it was drawn from over
        the target's vocabulary (None where greedy)."""
        if self.sampling.argmax_only:
            return int(self.head.draft_tokens[int(scores.argmax())]), None
        whole = scores.new_full((1, self.head.config.vocab_size), float("-inf"))
        whole[:, self.head.draft_tokens] = scores
        q = next_token_probs(whole, self.sampling, torch.tensor([history]))
        return int(draw(q, self.generator)[0]), q[0]


def head_step(
    head: Eagle3Head,
    embeds: torch.Tensor,
    hidden: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The head reading token embeddings ``embeds`` and hidden vectors ``hidden`` ``(1, n, hidden)`` at ``positions``
    ``(n,)``: its keys and values written into the caches ``(1, kv_heads, slots, head_dim)`` there, each query
    attending to the slots up to its own position; the last position's output ``(1, 1, hidden)`` and its scores
    over the draft vocabulary ``(1, draft_vocab)``. Its shapes do not depend on the position (the caches are read
    whole, later slots masked): the step ``compiled_head_step`` compiles."""
    q, k, v, residual = head.qkv(embeds, hidden, positions)
    k_cache.index_copy_(2, positions, k)
    v_cache.index_copy_(2, positions, v)
    mask = torch.arange(k_cache.shape[2], device=positions.device) <= positions[:, None]
    attended = few_query_attention(q[:, :, -1:], k_cache, v_cache, mask[None, None, -1:])  # only the last is read
    out = head.finish(attended, residual[:, -1:])
    return out, head.logits(out)[0]


# (head, embeds, hidden, positions, k_cache, v_cache) -> (output, scores): ``head_step``'s arguments and results
HeadStep = Callable[..., tuple[torch.Tensor, torch.Tensor]]
_HEAD_STEP_PARAMS = ("head", "embeds", "hidden", "positions", "k_cache", "v_cache")


def eager_head_step(
    head: Eagle3Head, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, *caches: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``head_step`` op by op over the caches' (keys', values') slots up to the last position: none masked."""
    filled = int(positions[-1]) + 1
    return head_step(head, embeds, hidden, positions, *(cache[:, :, :filled] for cache in caches))


def compiled_head_step() -> HeadStep:
    """``head_step`` compiled (on the CPU, where the drafter runs): one graph per head for one position (a chain
    step) and one, with the count symbolic, for reading several (a round's first step after accepted drafts);
    each called directly after its first call (``DirectCalls``), as the target's steps are."""
    compile = step_compiler(None, "inductor")
    steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def step(head, embeds, hidden, positions, k_cache, v_cache) -> tuple[torch.Tensor, torch.Tensor]:
        if head not in steps:
            steps[head] = DirectCalls(compile(head_step, positions.device), _HEAD_STEP_PARAMS, fixed=("head",))
        if embeds.shape[1] > 1:
            for t, dim in ((embeds, 1), (hidden, 1), (positions, 0)):
                torch._dynamo.maybe_mark_dynamic(t, dim)
        signature = (tensor_meta(embeds), tensor_meta(hidden))
        return steps[head](k_cache, signature, head, embeds, hidden, positions, k_cache, v_cache)

    return step


def decoding_head_step(compile: bool) -> HeadStep:
    """The step a draft head drafts with: op by op, or ``compiled_head_step``."""
    return compiled_head_step() if compile else eager_head_step


def drafting_head(head: Eagle3Head) -> Eagle3Head:
    """A copy of ``head`` that drafts on the CPU: each linear's weight rounded to 8 bits per output row
    (``DRAFTING_SCHEME``) and run by the runtime's CPU kernels; norms, rotary tables and ``draft_tokens`` as they are.
    Drafts change only where the rounding moves a draft's top score; the target's verification keeps the output
    the target's. Built once (50 ms for SmolLM2's head) and kept while the head's tensors stay the same objects at
    the same versions: an optimizer's step or ``load_state_dict`` builds it anew (a write through ``.data``, which
    keeps the version, would not)."""
    versions = tuple((t.data_ptr(), t._version) for t in (*head.parameters(), *head.buffers()))
    kept = _DRAFTING.get(head)
    if kept is not None and kept[0] == versions:
        return kept[1]
    drafting = copy.deepcopy(head)
    build = Build(torch.float32, "cpu")
    for name in HEAD_LINEARS:
        linear = getattr(head, name)
        packed = quantized_linear_from(linear, quantize_weight_rtn(linear.weight.detach(), DRAFTING_SCHEME))
        setattr(drafting, name, runtime_linear(packed, build))
    _DRAFTING[head] = (versions, drafting.eval())
    return drafting


_HEAD = "_lmpress_draft_head"  # on a transformers model: the EAGLE-3 head trained for it


def attach_draft_head(model: nn.Module, head: Eagle3Head | None) -> None:
    """Record on ``model`` the draft head trained for it (the run's exports write it, its evals draft with it)."""
    if head is None:
        if hasattr(model, _HEAD):
            delattr(model, _HEAD)
    else:
        object.__setattr__(model, _HEAD, head)  # not a submodule: the model's state dict stays its own


def draft_head_of(model: nn.Module) -> Eagle3Head | None:
    return getattr(model, _HEAD, None)


def save_draft_head(head: Eagle3Head, out: Path, verifier: str, architectures: list[str], tokens: int) -> None:
    """Write ``head`` to the folder ``out`` in the speculators format (``lmpress.export.speculators``), with the
    fingerprints of the targets it was trained for (``Eagle3Config.targets``)."""
    config = speculators_config(head.config.as_dict(), verifier, architectures, tokens)
    write_speculators(out, config, head.state_dict(), head.draft_tokens)


def load_draft_head(path: Path, target: Transformer, target_fingerprint: str | None) -> Eagle3Head:
    """The head in the speculators folder ``path`` for ``target``: an input error in one line where it was trained
    for another target (its recorded fingerprints do not hold ``target_fingerprint``) or does not fit it."""
    config, state, draft_tokens = read_speculators(path)
    lmpress_keys = config.get("lmpress", {})
    targets = tuple(lmpress_keys.get("targets", ()))
    if targets and target_fingerprint is not None and target_fingerprint not in targets:
        raise LmpressInputError(
            f"{path}: the draft head was trained for another target (fingerprint {targets[0][:12]}..., this one "
            f"{target_fingerprint[:12]}...): train one for this target (a draft_head stage in its recipe)"
        )
    layer = config["transformer_layer_config"]
    try:
        head_config = Eagle3Config(
            hidden_size=layer["hidden_size"],
            intermediate_size=layer["intermediate_size"],
            num_attention_heads=layer["num_attention_heads"],
            num_key_value_heads=layer["num_key_value_heads"],
            head_dim=layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
            vocab_size=layer["vocab_size"],
            draft_vocab_size=config["draft_vocab_size"],
            feature_layers=tuple(
                config.get("eagle_aux_hidden_state_layer_ids") or default_feature_layers(target.args.n_layers)
            ),
            target_hidden_size=config.get("target_hidden_size") or layer["hidden_size"],
            rms_norm_eps=layer.get("rms_norm_eps", 1e-5),
            rope_theta=layer.get("rope_theta", 10000.0),
            max_position_embeddings=layer.get("max_position_embeddings", target.args.max_seq_len),
            targets=targets,
        )
    except KeyError as e:
        raise LmpressInputError(f"{path}/config.json: no {e.args[0]} in the draft head's config") from None
    if max(head_config.feature_layers) > target.args.n_layers:
        raise LmpressInputError(
            f"{path}: the head reads target layers {list(head_config.feature_layers)}; the target has "
            f"{target.args.n_layers}"
        )
    head = Eagle3Head(head_config)
    try:
        head.load_state_dict(state | {"draft_tokens": draft_tokens})
    except RuntimeError as e:
        raise LmpressInputError(
            f"{path}: the head's tensors do not fit its config: {str(e).splitlines()[-1]}"
        ) from None
    Eagle3Drafter.check_fits(head, target)
    return head.eval()
