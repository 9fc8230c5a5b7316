"""Prefill, one-token decode, and a generator that yields tokens as they come.

A batch of prompts is left padded to one length (``left_pad``); each row stops on
its own at EOS or a stop string, and generation ends when every row has stopped,
after ``max_new_tokens``, or when the model's context is full.
"""

from __future__ import annotations

import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from lmpress.errors import LmpressInputError
from lmpress.memory import trims_heap_after
from lmpress.runtime.direct_graph import DirectCalls, RecordingBackend
from lmpress.runtime.kv_cache import KVCache
from lmpress.runtime.model import Transformer
from lmpress.runtime.sample import SamplingConfig, make_generator, next_token, step_noise

FINISHED = -1  # what ``generate_tokens`` yields for a row that has already stopped
DecodeFn = Callable[[Transformer, torch.Tensor, KVCache], torch.Tensor]  # (batch,) -> logits (batch, vocab)
ForwardFn = Callable[[Transformer, torch.Tensor, KVCache], torch.Tensor]  # (batch, n) -> logits (batch, n, vocab)
# (model, token (batch,), cache, sampling, noise, history) -> the next token (batch,), on the model's device
StepFn = Callable[
    [Transformer, torch.Tensor, KVCache, SamplingConfig, torch.Tensor | None, torch.Tensor | None], torch.Tensor
]
# Tokens a GPU decodes between two reads of its tokens by the host: each read waits for the device to finish, so
# the host reads every token only where that costs nothing (the CPU computes synchronously anyway).
DEVICE_READ_EVERY = 16


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


def sampled(decode: DecodeFn = decode_one_token) -> StepFn:
    """The ``StepFn`` of a logits step: ``decode``'s logits, then ``next_token`` outside it (still on the device)."""

    def step(model, token, cache, sampling, noise, history):
        return next_token(decode(model, token, cache), sampling, noise, history)

    return step


def read_every_for(device: torch.device) -> int:
    """How many tokens ``generate_tokens`` decodes between reads of its tokens on ``device``."""
    return 1 if device.type == "cpu" else DEVICE_READ_EVERY


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
    step: StepFn | None = None,
    read_every: int | None = None,
) -> Iterator[torch.Tensor]:
    """Yield each step's new tokens ``(batch,)`` as they are produced; a stopped row yields ``FINISHED``.

    The token that triggers a stop (EOS, or the one completing a stop string) is
    yielded; nothing after it. Each token is chosen on the model's device (``next_token``) by ``step``
    (default: ``sampled(decode)``; ``decode`` may be a compiled ``decode_one_token``, ``step`` a
    ``compiled_step``), and the host reads the tokens ``read_every`` steps at a time (default
    ``read_every_for(device)``: every token on the CPU, every ``DEVICE_READ_EVERY`` on a GPU after the first, so the
    GPU runs ahead of the host; a stop found in a read ends the generation there, the steps decoded past it unused).
    """
    sampling = sampling or SamplingConfig()
    step = step or sampled(decode)
    if max_new_tokens < 1:
        raise LmpressInputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    batch = as_batch(prompts)
    tokens, pad = left_pad(batch)
    check_context(tokens.shape[1], model.args.max_seq_len)
    stops = StopCriteria(eos_token_id, stop_strings, tokenizer)
    # Generating n tokens reads the prompt and the first n - 1 of them.
    max_len = cache_length(tokens.shape[1], max_new_tokens, model.args.max_seq_len)
    n_new = max_len - tokens.shape[1] + 1
    read_every = read_every or read_every_for(model.device)
    cache = model.new_cache(len(batch), max_len, pad)
    history = new_history(tokens, pad, max_len, model.device)  # every token so far, on the device; FINISHED after
    generator = make_generator(seed, model.device)
    generated: list[list[int]] = [[] for _ in batch]
    active = [True] * len(batch)
    logits = prefill(model, tokens, cache)
    noise_shape = tuple(logits.shape)
    noise = step_noise(sampling, noise_shape, generator, model.device)
    token = next_token(logits, sampling, noise, penalized(history, sampling))
    read = tokens.shape[1]  # the first position the host has not read
    for i in range(n_new):
        filled = tokens.shape[1] + i
        history[:, filled] = token
        if i == 0 or i == n_new - 1 or (i + 1) % read_every == 0:  # the first token as soon as it exists
            for column in history[:, read : filled + 1].cpu().unbind(1):
                yield _stopping(column, active, generated, stops)
                if not any(active):
                    return
            read = filled + 1
        if i == n_new - 1:
            return
        noise = step_noise(sampling, noise_shape, generator, model.device)
        token = step(model, token, cache, sampling, noise, penalized(history, sampling))


def new_history(tokens: torch.Tensor, pad: torch.Tensor, max_len: int, device: torch.device) -> torch.Tensor:
    """``(batch, max_len + 1)`` ids on ``device``: the left-padded prompts (padding as ``FINISHED``), then
    ``FINISHED`` where the generated tokens will go. A fixed shape, so a compiled step reading it compiles once."""
    history = torch.full((tokens.shape[0], max_len + 1), FINISHED, dtype=torch.long)
    history[:, : tokens.shape[1]] = tokens.masked_fill(torch.arange(tokens.shape[1]) < pad[:, None], FINISHED)
    return history.to(device)


def penalized(history: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor | None:
    """The history a step's repetition penalty reads (None without a penalty: the step reads nothing of it)."""
    return None if sampling.repetition_penalty == 1.0 else history


def _stopping(token: torch.Tensor, active: list[bool], generated: list[list[int]], stops: StopCriteria) -> torch.Tensor:
    """One step's tokens as ``generate_tokens`` yields them (``FINISHED`` for rows stopped before it); rows whose
    token stops them are marked inactive."""
    out = token.clone()
    for row, value in enumerate(token.tolist()):
        if not active[row]:
            out[row] = FINISHED
            continue
        generated[row].append(value)
        if stops.done(generated[row]):
            active[row] = False
    return out


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


def _static_sample_step(
    model: Transformer,
    tokens: torch.Tensor,
    k: list[torch.Tensor],
    v: list[torch.Tensor],
    pad,
    pos,
    side,
    sampling: SamplingConfig,
    noise: torch.Tensor | None,
    history: torch.Tensor | None,
) -> torch.Tensor:
    """One decode step ending in its next tokens: what ``lmpress generate --compile`` and ``lmpress bench``
    compile whole (and capture in a CUDA graph on a GPU)."""
    logits = model.forward_static(tokens, k, v, pad, pos, side)[:, -1].float()
    return next_token(logits, sampling, noise, history)


def _static_positions(model: Transformer, cache: KVCache, n: int) -> torch.Tensor:
    """The slots a fixed-shape step reading ``n`` tokens writes (``cache`` checked to hold them)."""
    if cache.length + n > cache.max_len:
        raise LmpressInputError(f"{cache.length + n} tokens exceed the cache of {cache.max_len}")
    if cache.kv is not model.kv_quant:
        raise ValueError("the cache was made for another KV scheme than the model's (make it by model.new_cache)")
    return torch.arange(cache.length, cache.length + n, device=model.device)


def static_forward(step: Callable[..., torch.Tensor] = _static_step) -> ForwardFn:
    """A ``ForwardFn`` running ``step`` (``_static_step``, or a compiled form of it) on a cache's tensors."""

    @torch.no_grad()
    def forward(
        model: Transformer, tokens: torch.Tensor, cache: KVCache, feature_layers: tuple[int, ...] = ()
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        n = tokens.shape[1]
        pos = _static_positions(model, cache, n)
        out = step(model, tokens.to(model.device), cache.k, cache.v, cache.pad, pos, cache.side, feature_layers)
        cache.advance(n)
        if feature_layers:  # a CUDA graph overwrites its outputs at the next replay
            return out[0].clone(), out[1].clone()
        return out.clone()

    return forward


def static_decode(step: Callable[..., torch.Tensor] = _static_step) -> DecodeFn:
    """The one-token step of ``static_forward(step)``."""
    return decode_with(static_forward(step))


def static_step(step: Callable[..., torch.Tensor] = _static_sample_step) -> StepFn:
    """A ``StepFn`` running ``step`` (``_static_sample_step``, or a compiled form of it) on a cache's tensors."""

    @torch.no_grad()
    def run(model, token, cache, sampling, noise, history) -> torch.Tensor:
        pos = _static_positions(model, cache, 1)
        tokens = token.to(model.device)[:, None]
        out = step(model, tokens, cache.k, cache.v, cache.pad, pos, cache.side, sampling, noise, history)
        cache.advance(1)
        return out.clone()  # a CUDA graph overwrites its outputs at the next replay

    return run


def _own_copy(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of ``fn`` with a code object of its own: dynamo keeps compiled graphs per code
    object, so with the module guards dropped no two models may share one."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__)


def step_compiler(mode: str | None, backend: str) -> Callable[[Callable[..., Any], torch.device], Callable[..., Any]]:
    """``compile(fn, device)``: a fresh copy of ``fn`` (``_own_copy``) through ``torch.compile(fullgraph=True)``.

    Dynamo's guards on the model's ~600 parameters cost ~0.5 ms per call on 2 CPU threads (7% of SmolLM2's W4
    step), so they are dropped: each model gets its own compiled steps, and the cache's tensors stay guarded
    (a new cache size recompiles). ``backend="eager"`` traces with dynamo alone (tests: one graph, no break).
    On the CPU Inductor compiles through a ``RecordingBackend``, so the steps' ``DirectCalls`` call each graph
    without dynamo once dynamo has called it for a cache (``direct_graph``); CUDA graphs keep dynamo's entry."""
    # The guards left check every input's sizes and strides, so the graphs' own size asserts (~300 per call)
    # repeat them (a one-off A/B, with alignment asserts off too: a 2.88 ms draft step took 2.74 ms).
    guards = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    options = {"size_asserts": False}
    if mode is not None:
        options.update(torch._inductor.list_mode_options(mode))

    def compile(fn: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
        if backend != "inductor":
            return torch.compile(_own_copy(fn), fullgraph=True, backend=backend, options=guards)
        inductor = {**options, **wrapper_options(device)}
        if device.type == "cpu":
            return torch.compile(_own_copy(fn), fullgraph=True, backend=RecordingBackend(inductor), options=guards)
        return torch.compile(_own_copy(fn), fullgraph=True, options={**guards, **inductor})

    return compile


def uncompilable(model: Transformer) -> str | None:
    """Why ``model``'s fixed-shape step cannot be compiled as one graph (None: it can)."""
    from lmpress.runtime.feed_forward import MoEFeedForward

    if any(isinstance(block.feed_forward, MoEFeedForward) for block in model.layers):
        return "its mixture-of-experts layers send each token to experts chosen as it runs (shapes known only then)"
    return None


def compile_or_not(compile: Callable[..., Any], fn: Callable[..., Any], model: Transformer) -> Callable[..., Any]:
    """``fn`` compiled for ``model``, or, where it cannot be (``uncompilable``), ``fn`` itself after one warning:
    eager tokens, never a broken graph."""
    reason = uncompilable(model)
    if reason is None:
        return compile(fn, model.device)
    warnings.warn(f"--compile: the decode step runs eagerly: {reason}", stacklevel=3)
    return fn


def _keep_in_place(mode: str | None, tensors: Iterable[torch.Tensor | None]) -> None:
    """With CUDA graphs (``mode="reduce-overhead"``) the tensors a step writes into (the cache's) or reads in place
    (the history) must be static inputs; unguarded, so a new cache of the same size re-records the graph instead of
    recompiling."""
    if mode != "reduce-overhead":
        return
    for t in tensors:
        if t is not None and not hasattr(t, "_dynamo_static_input_type"):
            torch._dynamo.mark_static_address(t, guard=False)


def _cache_tensors(k: list, v: list, side) -> Iterator[torch.Tensor]:
    yield from (*k, *v, *(t for tensors in side for t in tensors))


def tensor_meta(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.shape, t.dtype, t.stride())


_STEP_PARAMS = ("model", "tokens", "k", "v", "pad", "pos", "side", "feature_layers")  # ``_static_step``'s
_SAMPLE_STEP_PARAMS = ("model", "tokens", "k", "v", "pad", "pos", "side", "sampling", "noise", "history")

STATIC_TOKENS = 4  # reads of up to this many tokens get a graph of their own (decode, verifying up to 3 drafts)


def compiled_forward(mode: str | None = None, backend: str = "inductor") -> ForwardFn:
    """A forward over a few tokens as ``torch.compile``'d graphs of fixed shapes (``Transformer.forward_static``).

    Each model gets one graph per token count up to ``STATIC_TOKENS`` (a draft model's
    re-read of two tokens, verifying 1-3 drafts) and one graph for any longer read, where the count
    is a symbolic size; each is compiled at its first use (5-30 s for SmolLM2 on 2 CPU threads, in
    one-off timings: ``compile_reads`` pays that up front) and reused at every step.
    Specialized counts run faster than the symbolic graph (a one-off A/B in one process, SmolLM2 FP32
    on 2 CPU threads inside speculative decoding: verifying 1 draft 19.6 vs 20.5 ms, 3 drafts 22.2 ms
    where the symbolic graph took 23.5 ms for 2; speculative decoding 73.9 vs 70.7 tok/s).
    ``mode="reduce-overhead"`` also captures them in CUDA graphs on a GPU. Long reads (a prompt) belong to the
    model's own forward: the static step's attention is written for a few queries. Plain decoding runs
    ``compiled_step``, which ends in the next token.
    """
    compile = step_compiler(mode, backend)
    steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def step(model: Transformer, tokens: torch.Tensor, k: list, v: list, pad, pos, side, feature_layers=()) -> Any:
        if model not in steps:  # the counts' graphs, the symbolic graph
            fixed = compile_or_not(compile, _static_step, model)  # an uncompilable model: both eager, said once
            symbolic = fixed if fixed is _static_step else compile(_static_step, model.device)
            steps[model] = (DirectCalls(fixed, _STEP_PARAMS, fixed=("model",)), symbolic)
        _keep_in_place(mode, _cache_tensors(k, v, side))
        fixed, symbolic = steps[model]
        if tokens.shape[1] > STATIC_TOKENS:  # symbolic from its first compile: one graph for every longer read
            torch._dynamo.maybe_mark_dynamic(tokens, 1)
            torch._dynamo.maybe_mark_dynamic(pos, 0)
            return symbolic(model, tokens, k, v, pad, pos, side, feature_layers)
        torch._dynamo.mark_static(tokens, 1)  # never generalized to a symbolic count (a cache size may be)
        torch._dynamo.mark_static(pos, 0)
        signature = (tensor_meta(tokens), feature_layers)  # the graph reads inputs with the strides it was built for
        return fixed(k[0], signature, model, tokens, k, v, pad, pos, side, feature_layers)

    return static_forward(step)


def compiled_step(mode: str | None = None, backend: str = "inductor") -> StepFn:
    """Plain decoding's step compiled whole (``_static_sample_step``: the model's one-token read and the choice of
    the next token, greedy or sampled, in one graph), one graph per model and cache size; with
    ``mode="reduce-overhead"`` captured in a CUDA graph on a GPU, so a token costs one replay and no host sync."""
    compile = step_compiler(mode, backend)
    steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def step(model: Transformer, tokens, k, v, pad, pos, side, sampling, noise, history) -> torch.Tensor:
        if model not in steps:
            compiled = compile_or_not(compile, _static_sample_step, model)
            steps[model] = DirectCalls(compiled, _SAMPLE_STEP_PARAMS, fixed=("model",))
        _keep_in_place(mode, (*_cache_tensors(k, v, side), history))
        signature = (tensor_meta(tokens), sampling, tensor_meta(noise), tensor_meta(history))
        return steps[model](k[0], signature, model, tokens, k, v, pad, pos, side, sampling, noise, history)

    return static_step(step)


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


def compile_mode(device: torch.device) -> str | None:
    """``torch.compile``'s mode for decoding on ``device``: CUDA graphs on a GPU."""
    return "reduce-overhead" if device.type == "cuda" else None


def decoding_forward(device: torch.device, compile: bool) -> ForwardFn:
    """The forward decoding runs on ``device``: eager, or compiled (on a GPU also captured in CUDA graphs)."""
    return compiled_forward(compile_mode(device)) if compile else model_forward


def decoding_step(device: torch.device, compile: bool, backend: str = "inductor") -> StepFn:
    """The ``StepFn`` plain decoding runs on ``device``: eager, or ``compiled_step`` (CUDA graphs on a GPU) through
    ``backend`` (dynamo's ``"eager"``: the same graph, not compiled, where tests and dry runs need no compiler)."""
    return compiled_step(compile_mode(device), backend) if compile else sampled()


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


def compile_steps(step: StepFn, model: Transformer, max_len: int, sampling: SamplingConfig) -> None:
    """Run ``step`` once on a scratch cache of ``max_len`` slots, so a compiled step has the graph a generation of
    one row with that cache (``cache_length``) and ``sampling`` will use before its first token."""
    cache = model.new_cache(1, max_len)
    one = torch.zeros((1, 1), dtype=torch.long)
    history = new_history(one, torch.zeros(1, dtype=torch.long), max_len, model.device)
    width = model.args.vocab_size if model.output_tokens is None else len(model.output_tokens)  # the logits'
    noise = step_noise(sampling, (1, width), make_generator(0, model.device), model.device)
    step(model, torch.zeros(1, dtype=torch.long), cache, sampling, noise, penalized(history, sampling))


def compiled_decode(mode: str | None = None) -> DecodeFn:
    """The one-token step of ``compiled_forward(mode)``."""
    return decode_with(compiled_forward(mode))
