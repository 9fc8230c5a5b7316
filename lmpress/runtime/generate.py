"""Prefill, one-token decode, and a generator that yields tokens as they come.

A batch of prompts is left padded to one length (``left_pad``); each row stops on
its own at EOS or a stop string, and generation ends when every row has stopped,
after ``max_new_tokens``, or when the model's context is full.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from lmpress.errors import LmpressInputError
from lmpress.memory import trims_heap_after
from lmpress.runtime.kv_cache import KVCache
from lmpress.runtime.model import Transformer
from lmpress.runtime.sample import SamplingConfig, make_generator, sample

FINISHED = -1  # what ``generate_tokens`` yields for a row that has already stopped
DecodeFn = Callable[[Transformer, torch.Tensor, KVCache], torch.Tensor]  # (batch,) -> logits (batch, vocab)
ForwardFn = Callable[[Transformer, torch.Tensor, KVCache], torch.Tensor]  # (batch, n) -> logits (batch, n, vocab)


@torch.no_grad()
def prefill(model: Transformer, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Read the prompts ``(batch, n)`` into the cache; logits ``(batch, vocab)`` for the next token."""
    return model(tokens, cache, last_only=True)[:, -1].float()


@torch.no_grad()
def decode_one_token(model: Transformer, token: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Read one token per row ``(batch,)``; logits ``(batch, vocab)`` for the next one."""
    return model(token[:, None], cache)[:, -1].float()


def as_batch(prompts: Sequence[int] | Sequence[Sequence[int]] | torch.Tensor) -> list[list[int]]:
    """One prompt (ids) or several, as a list of id lists."""
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist()
    prompts = list(prompts)
    if not prompts:
        raise LmpressInputError("no prompt given: pass token ids, or a list of token-id lists")
    if all(isinstance(p, int) for p in prompts):
        prompts = [prompts]
    batch = [list(p) for p in prompts]
    if any(len(p) == 0 for p in batch):
        raise LmpressInputError("a prompt is empty: every prompt needs at least one token")
    return batch


def check_context(prompt_len: int, context: int) -> None:
    if prompt_len > context:
        raise LmpressInputError(
            f"the prompt has {prompt_len} tokens, more than the model's context of {context}: shorten it"
        )


def left_pad(prompts: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as one ``(batch, longest)`` tensor padded on the left, and each row's padding."""
    longest = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    pad = torch.tensor([longest - len(p) for p in prompts], dtype=torch.long)
    for row, prompt in enumerate(prompts):
        tokens[row, longest - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
    return tokens, pad


class StopCriteria:
    """Per row: stop after an EOS id, or once the generated text contains a stop string."""

    def __init__(
        self, eos_token_id: int | Sequence[int] | None, stop_strings: Sequence[str] = (), tokenizer: Any = None
    ) -> None:
        if stop_strings and tokenizer is None:
            raise LmpressInputError("stop strings need the tokenizer to decode the generated text: pass tokenizer=")
        eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
        self.eos = set(eos)
        self.stop_strings = tuple(stop_strings)
        self.tokenizer = tokenizer
        self.longest_stop = max((len(s) for s in self.stop_strings), default=0)

    def done(self, generated: list[int]) -> bool:
        """Whether a row that has generated ``generated`` (its last token just now) stops here."""
        if generated[-1] in self.eos:
            return True
        if not self.stop_strings:
            return False
        # A stop string that ends in the newest token lies within its last few tokens' text.
        tail = self.tokenizer.decode(generated[-(self.longest_stop + 1) :], skip_special_tokens=False)
        return any(s in tail for s in self.stop_strings)


def cache_length(prompt_tokens: int, max_new_tokens: int, max_seq_len: int) -> int:
    """The KV cache slots a generation of ``max_new_tokens`` after a prompt needs (the last token is not read back),
    at most the model's context."""
    return min(prompt_tokens + max_new_tokens - 1, max_seq_len)


@trims_heap_after  # the cache and a prefill's activations, freed, are handed back
def generate_tokens(
    model: Transformer,
    prompts: Sequence[int] | Sequence[Sequence[int]] | torch.Tensor,
    max_new_tokens: int = 128,
    sampling: SamplingConfig | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    stop_strings: Sequence[str] = (),
    tokenizer: Any = None,
    seed: int | None = None,
    decode: DecodeFn = decode_one_token,
) -> Iterator[torch.Tensor]:
    """Yield each step's new tokens ``(batch,)`` as they are produced; a stopped row yields ``FINISHED``.

    The token that triggers a stop (EOS, or the one completing a stop string) is
    yielded; nothing after it. ``decode`` may be a compiled ``decode_one_token``.
    """
    sampling = sampling or SamplingConfig()
    if max_new_tokens < 1:
        raise LmpressInputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    batch = as_batch(prompts)
    tokens, pad = left_pad(batch)
    check_context(tokens.shape[1], model.args.max_seq_len)
    stops = StopCriteria(eos_token_id, stop_strings, tokenizer)
    # Generating n tokens reads the prompt and the first n - 1 of them.
    max_len = cache_length(tokens.shape[1], max_new_tokens, model.args.max_seq_len)
    n_new = max_len - tokens.shape[1] + 1
    cache = model.new_cache(len(batch), max_len, pad)
    history = torch.full((len(batch), tokens.shape[1] + n_new), FINISHED, dtype=torch.long)
    history[:, : tokens.shape[1]] = tokens.masked_fill(torch.arange(tokens.shape[1]) < pad[:, None], FINISHED)
    generator = make_generator(seed)
    generated: list[list[int]] = [[] for _ in batch]
    active = torch.ones(len(batch), dtype=torch.bool)
    logits = prefill(model, tokens, cache)
    for step in range(n_new):
        filled = tokens.shape[1] + step
        token = sample(logits.cpu(), sampling, generator, history[:, :filled])
        history[:, filled] = token
        out = token.masked_fill(~active, FINISHED)
        for row in active.nonzero().flatten().tolist():
            generated[row].append(int(token[row]))
            if stops.done(generated[row]):
                active[row] = False
        yield out
        if not bool(active.any()) or step == n_new - 1:
            return
        logits = decode(model, token, cache)


def generate(
    model: Transformer, prompts: Sequence[int] | Sequence[Sequence[int]] | torch.Tensor, **kwargs: Any
) -> list[list[int]]:
    """Every row's generated ids (``generate_tokens`` run to the end)."""
    batch = as_batch(prompts)
    rows: list[list[int]] = [[] for _ in batch]
    for step in generate_tokens(model, batch, **kwargs):
        for row, token in enumerate(step.tolist()):
            if token != FINISHED:
                rows[row].append(token)
    return rows


def model_forward(
    model: Transformer, tokens: torch.Tensor, cache: KVCache, feature_layers: tuple[int, ...] = ()
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Read ``tokens`` ``(batch, n)`` after the cache's contents; float logits ``(batch, n, vocab)``, and with
    ``feature_layers`` the features a draft head reads (``Transformer.forward_with_features``) beside them."""
    if feature_layers:
        logits, features = model.forward_with_features(tokens, cache, feature_layers)
        return logits.float(), features
    return model(tokens, cache).float()


def decode_with(forward: ForwardFn) -> DecodeFn:
    """The one-token step of a ``ForwardFn``."""

    def decode(model: Transformer, token: torch.Tensor, cache: KVCache) -> torch.Tensor:
        return forward(model, token[:, None], cache)[:, -1]

    return decode


def _static_step(
    model: Transformer,
    tokens: torch.Tensor,
    k: list[torch.Tensor],
    v: list[torch.Tensor],
    pad,
    pos,
    side=([], [], []),
    feature_layers: tuple[int, ...] = (),
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    out = model.forward_static(tokens, k, v, pad, pos, side, feature_layers)
    return (out[0].float(), out[1]) if feature_layers else out.float()


def static_forward(step: Callable[..., torch.Tensor] = _static_step) -> ForwardFn:
    """A ``ForwardFn`` running ``step`` (``_static_step``, or a compiled form of it) on a cache's tensors."""

    @torch.no_grad()
    def forward(
        model: Transformer, tokens: torch.Tensor, cache: KVCache, feature_layers: tuple[int, ...] = ()
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        n = tokens.shape[1]
        if cache.length + n > cache.max_len:
            raise LmpressInputError(f"{cache.length + n} tokens exceed the cache of {cache.max_len}")
        pos = torch.arange(cache.length, cache.length + n, device=model.device)
        if cache.kv is not model.kv_quant:
            raise ValueError("the cache was made for another KV scheme than the model's (make it by model.new_cache)")
        out = step(model, tokens.to(model.device), cache.k, cache.v, cache.pad, pos, cache.side, feature_layers)
        cache.advance(n)
        if feature_layers:  # a CUDA graph overwrites its outputs at the next replay
            return out[0].clone(), out[1].clone()
        return out.clone()

    return forward


def static_decode(step: Callable[..., torch.Tensor] = _static_step) -> DecodeFn:
    """The one-token step of ``static_forward(step)``."""
    return decode_with(static_forward(step))


def _own_static_step() -> Callable[..., torch.Tensor]:
    """A copy of ``_static_step`` with a code object of its own: dynamo keeps compiled graphs per code
    object, so with the module guards dropped no two models may share one."""
    code = _static_step.__code__.replace()
    return types.FunctionType(code, _static_step.__globals__, _static_step.__name__)


STATIC_TOKENS = 4  # reads of up to this many tokens get a graph of their own (decode, verifying up to 3 drafts)


def compiled_forward(mode: str | None = None) -> ForwardFn:
    """A forward over a few tokens as ``torch.compile``'d graphs of fixed shapes (``Transformer.forward_static``).

    Each model gets one graph per token count up to ``STATIC_TOKENS`` (decode, a draft model's
    re-read of two tokens, verifying 1-3 drafts) and one graph for any longer read, where the count
    is a symbolic size; each is compiled at its first use (5-30 s for SmolLM2 on 2 CPU threads, in
    one-off timings: ``compile_reads`` pays that up front) and reused at every step.
    Specialized counts run faster than the symbolic graph (a one-off A/B in one process, SmolLM2 FP32
    on 2 CPU threads inside speculative decoding: verifying 1 draft 19.6 vs 20.5 ms, 3 drafts 22.2 ms
    where the symbolic graph took 23.5 ms for 2; speculative decoding 73.9 vs 70.7 tok/s).
    ``mode="reduce-overhead"`` also captures them in CUDA graphs on a GPU. Dynamo's guards on the
    model's ~600 parameters cost ~0.5 ms per call on 2 CPU threads (7% of SmolLM2's W4 step), so
    they are dropped: each model gets its own compiled steps, and the cache's tensors stay guarded
    (a new cache size recompiles). Long reads (a prompt) belong to the model's own forward: the
    static step's attention is written for a few queries.
    """
    # The guards left check every input's sizes and strides, so the graphs' own size asserts (~300 per call)
    # repeat them (a one-off A/B, with alignment asserts off too: a 2.88 ms draft step took 2.74 ms).
    options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe, "size_asserts": False}
    if mode is not None:
        options.update(torch._inductor.list_mode_options(mode))
    steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def compile_step(device: torch.device) -> Callable[..., torch.Tensor]:
        return torch.compile(_own_static_step(), fullgraph=True, options={**options, **wrapper_options(device)})

    def step(model: Transformer, tokens: torch.Tensor, k: list, v: list, pad, pos, side, feature_layers=()) -> Any:
        if model not in steps:  # the counts' graphs, the symbolic graph
            steps[model] = (compile_step(model.device), compile_step(model.device))
        if mode == "reduce-overhead":
            # A CUDA graph may write into the cache only if its tensors are static inputs; unguarded, so a
            # new cache of the same size re-records the graph instead of recompiling.
            for t in (*k, *v, *(t for tensors in side for t in tensors)):
                if not hasattr(t, "_dynamo_static_input_type"):
                    torch._dynamo.mark_static_address(t, guard=False)
        fixed, symbolic = steps[model]
        if tokens.shape[1] > STATIC_TOKENS:  # symbolic from its first compile: one graph for every longer read
            torch._dynamo.maybe_mark_dynamic(tokens, 1)
            torch._dynamo.maybe_mark_dynamic(pos, 0)
            return symbolic(model, tokens, k, v, pad, pos, side, feature_layers)
        torch._dynamo.mark_static(tokens, 1)  # never generalized to a symbolic count (a cache size may be)
        torch._dynamo.mark_static(pos, 0)
        return fixed(model, tokens, k, v, pad, pos, side, feature_layers)

    return static_forward(step)


def wrapper_options(device: torch.device) -> dict[str, bool]:
    """Inductor options for the code that calls a compiled step's kernels on ``device``.

    On the CPU that code is C++ (``cpp_wrapper``): Python's wrapper spends some microseconds per kernel call, and a
    decode step calls ~120 (the linears of SmolLM2's 30 layers and its head) while the other thread waits; W4 decode
    ran 1.19x faster with it (bench/decode_wrapper.py, both in one process, alternating). The entry and the kernels
    are built apart (``cpp_wrapper_build_separate``): built together, the first graph of SmolLM2 took 105 s to
    compile where the Python wrapper's takes 58 s; apart, 64 s. On a GPU, CUDA graphs already take the per-call
    cost away.
    """
    if device.type != "cpu":
        return {}
    return {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}


def decoding_forward(device: torch.device, compile: bool) -> ForwardFn:
    """The forward decoding runs on ``device``: eager, or compiled (on a GPU also captured in CUDA graphs)."""
    if not compile:
        return model_forward
    return compiled_forward("reduce-overhead" if device.type == "cuda" else None)


def compile_reads(
    forward: ForwardFn, model: Transformer, max_len: int, counts: Sequence[int], feature_layers: tuple[int, ...] = ()
) -> None:
    """Run ``forward`` once for each token count in ``counts`` on a scratch cache of ``max_len`` slots, so a
    compiled forward has the graphs a decode with caches of that size will use before it is timed (with
    ``feature_layers``: the reads that return a draft head's features too)."""
    cache = model.new_cache(1, max_len)
    for n in counts:
        cache.reset()
        ids = torch.zeros((1, n), dtype=torch.long)
        forward(model, ids, cache, feature_layers) if feature_layers else forward(model, ids, cache)


def compiled_decode(mode: str | None = None) -> DecodeFn:
    """The one-token step of ``compiled_forward(mode)``."""
    return decode_with(compiled_forward(mode))
