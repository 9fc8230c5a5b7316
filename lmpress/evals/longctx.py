"""Long-context quality: passkey retrieval and mean NLL by position bucket.

Sample recipe eval:

    eval:
      passkey: {lengths: [1024, 2048, 4096, 8192], depths: [0, 0.25, 0.5, 0.75, 1], trials: 1}
      ppl_by_position: {seq_len: 8192, documents: 2}

Passkey: a 5-digit number hidden at a relative depth in repeated filler text,
followed by the question; the model decodes greedily and scores 1 when the first
number it writes is the key. Prompts depend only on the tokenizer and the seed,
so baseline and candidate answer the same prompts. A prompt of length L holds
L - max_new_tokens tokens, so prompt plus answer fit in L.

NLL by position: ``documents`` windows of ``seq_len`` tokens cut from the start
of the eval text (its articles joined as in the file); each predicted token's
NLL goes to the bucket of its position, so a candidate that degrades late in the
context shows it there. SmolLM2-135M on 2 cores: see bench/results/eval_suite.md
for what each length costs.
"""

from __future__ import annotations

import inspect
import math
import random
import re
import time
from collections.abc import Callable

import torch
from pydantic import Field, PositiveInt, field_validator
from torch import nn

from lmpress.anatomy import context_length
from lmpress.data import token_windows
from lmpress.errors import LmpressInputError
from lmpress.evals.kld import vocab_digest
from lmpress.evals.perplexity import forward_windows, window_protocol
from lmpress.progress import QUIET, Bars
from lmpress.registry import EvalConfig, EvalContext, EvalResult, register_eval
from lmpress.runtime.generate import generate_tokens
from lmpress.runtime.model import Transformer

INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n\n"
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"


def length_label(n: int) -> str:
    """1024 -> '1k', 512 -> '512', 1536 -> '1536'."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _unique_sorted(values: list) -> list:
    if len(set(values)) != len(values):
        raise ValueError("values must be distinct")
    return sorted(values)


class PasskeyConfig(EvalConfig):
    lengths: list[PositiveInt] = Field(default=[1024, 2048, 4096], min_length=1)  # prompt + answer, in tokens
    depths: list[float] = Field(default=[0.0, 0.25, 0.5, 0.75, 1.0], min_length=1)  # where the key sits, 0..1
    trials: PositiveInt = 1  # prompts (keys) per length x depth
    seed: int = 0
    max_new_tokens: PositiveInt = 8

    _lengths_ok = field_validator("lengths")(classmethod(lambda cls, v: _unique_sorted(v)))

    @field_validator("depths")
    @classmethod
    def _depths_ok(cls, v: list[float]) -> list[float]:
        if any(not 0.0 <= d <= 1.0 for d in v):
            raise ValueError(f"depths are fractions of the filler between 0 and 1, got {v}")
        return _unique_sorted(v)

    def metric_names(self) -> list[str]:
        return ["passkey_accuracy"] + [f"passkey_accuracy_{length_label(n)}" for n in self.lengths]

    def logit_tokens(self) -> int:
        return max(self.lengths)

    def check(self, model: nn.Module) -> None:
        limit = context_length(model)
        too_long = [n for n in self.lengths if n > limit]
        if too_long:
            raise LmpressInputError(
                f"eval.passkey.lengths: {too_long} exceed the model's context of {limit} tokens "
                f"(use lengths up to {limit})"
            )


class PositionNLLConfig(EvalConfig):
    seq_len: PositiveInt = 4096  # document length; 8192 adds the 4k-8k bucket at about 3x the cost
    documents: PositiveInt = 2
    edges: list[int] = [0, 512, 1024, 2048, 4096, 8192]  # bucket boundaries, cut at seq_len

    @field_validator("edges")
    @classmethod
    def _edges_ok(cls, v: list[int]) -> list[int]:
        if len(v) < 2 or v[0] != 0 or any(b <= a for a, b in zip(v, v[1:], strict=False)):
            raise ValueError(f"edges must start at 0 and increase, got {v}")
        return v

    def buckets(self) -> list[tuple[int, int]]:
        return [(a, min(b, self.seq_len)) for a, b in zip(self.edges, self.edges[1:], strict=False) if a < self.seq_len]

    def metric_names(self) -> list[str]:
        return [bucket_metric(a, b) for a, b in self.buckets()]

    def logit_tokens(self) -> int:
        return self.seq_len

    def check(self, model: nn.Module) -> None:
        limit = context_length(model)
        if self.seq_len > limit:
            raise LmpressInputError(
                f"eval.ppl_by_position.seq_len: {self.seq_len} exceeds the model's context of {limit} tokens"
            )


def bucket_metric(a: int, b: int) -> str:
    return f"nll_pos_{length_label(a)}_{length_label(b)}"


def passkey_prompt(tokenizer, length: int, depth: float, key: int, answer_room: int) -> list[int]:
    """Token ids of one prompt of exactly ``length - answer_room`` tokens with ``key`` at ``depth``.

    The filler is the repeated unit cut to fit; the key goes at the unit boundary (or the filler's end)
    nearest to ``depth``.
    """
    encode = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]
    intro, unit, needle, question = encode(INTRO), encode(FILLER), encode(NEEDLE.format(key=key)), encode(QUESTION)
    budget = length - answer_room - len(intro) - len(needle) - len(question)
    if budget < len(unit):
        raise LmpressInputError(f"eval.passkey.lengths: {length} tokens is too short for the passkey prompt")
    filler = (unit * (budget // len(unit) + 1))[:budget]
    boundaries = [*range(0, budget, len(unit)), budget]
    cut = min(boundaries, key=lambda b: abs(b - depth * budget))
    return intro + filler[:cut] + needle + filler[cut:] + question


def _keeps_last_logits(model: nn.Module) -> dict:
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


@torch.inference_mode()
def greedy_decode(
    model: nn.Module,
    prompt: list[int],
    max_new_tokens: int,
    eos_id: int | None,
    stop: Callable[[list[int]], bool] | None = None,
    runtime: Transformer | None = None,
) -> list[int]:
    """Greedy continuation of ``prompt`` until EOS, ``stop(tokens)`` or the limit.

    Decodes on lmpress's runtime (``runtime``, or a view of ``model`` sharing its layers)
    where it supports the architecture; otherwise with transformers' own KV cache.
    """
    runtime = runtime or Transformer.sharing(model)
    if runtime is None:
        return _transformers_greedy_decode(model, prompt, max_new_tokens, eos_id, stop)
    generated: list[int] = []
    for step in generate_tokens(runtime, prompt, max_new_tokens=max_new_tokens, eos_token_id=eos_id):
        generated.append(int(step[0]))
        if stop is not None and stop(generated):
            break
    return generated


def _transformers_greedy_decode(
    model: nn.Module, prompt: list[int], max_new_tokens: int, eos_id: int | None, stop: Callable | None
) -> list[int]:
    device = next(model.parameters()).device
    keep = _keeps_last_logits(model)
    out = model(torch.tensor([prompt], device=device), use_cache=True, **keep)
    generated: list[int] = []
    for _ in range(max_new_tokens):
        token = int(out.logits[0, -1].argmax())
        generated.append(token)
        if token == eos_id or len(generated) == max_new_tokens or (stop is not None and stop(generated)):
            break
        out = model(torch.tensor([[token]], device=device), past_key_values=out.past_key_values, use_cache=True, **keep)
    return generated


def answered_key(text: str) -> int | None:
    match = re.search(r"\d+", text)
    return int(match.group()) if match else None


def passkey_trials(config: PasskeyConfig) -> list[tuple[int, float, int, int]]:
    """(length, depth, trial, key) for every prompt; keys depend on the seed and the cell only."""
    cells = []
    for length in config.lengths:
        for depth in config.depths:
            for trial in range(config.trials):
                rng = random.Random(f"{config.seed}/{length}/{depth}/{trial}")
                cells.append((length, depth, trial, rng.randint(10000, 99999)))
    return cells


def passkey(model: nn.Module, tokenizer, config: PasskeyConfig, bars: Bars = QUIET) -> tuple[dict, dict]:
    samples = []
    began = time.perf_counter()
    runtime = Transformer.sharing(model)
    for length, depth, trial, key in bars.track(passkey_trials(config), "passkey"):
        prompt = passkey_prompt(tokenizer, length, depth, key, config.max_new_tokens)
        tokens = greedy_decode(model, prompt, config.max_new_tokens, tokenizer.eos_token_id, runtime=runtime)
        answer = tokenizer.decode(tokens)
        samples.append(
            {
                "length": length,
                "depth": depth,
                "trial": trial,
                "key": key,
                "answer": answer,
                "correct": answered_key(answer) == key,
                "prompt_tokens": len(prompt),
            }
        )
    seconds = time.perf_counter() - began
    accuracy = [
        [
            sum(s["correct"] for s in samples if s["length"] == n and s["depth"] == d) / config.trials
            for n in config.lengths
        ]
        for d in config.depths
    ]
    metrics = {"passkey_accuracy": sum(s["correct"] for s in samples) / len(samples)}
    for n in config.lengths:
        cell = [s["correct"] for s in samples if s["length"] == n]
        metrics[f"passkey_accuracy_{length_label(n)}"] = sum(cell) / len(cell)
    details = {
        "passkey_grid": {"lengths": config.lengths, "depths": config.depths, "accuracy": accuracy},
        "passkey_samples": samples,
        "passkey_seconds": seconds,
        "passkey_prompt_tokens": sum(s["prompt_tokens"] for s in samples),
    }
    return metrics, details


@register_eval("passkey", PasskeyConfig)
def run_passkey(model: nn.Module, tokenizer, config: PasskeyConfig, ctx: EvalContext) -> EvalResult:
    config.check(model)
    metrics, details = passkey(model, tokenizer, config, ctx.bars)
    protocol = {
        "task": "passkey retrieval, exact match of the first number in the answer",
        "template": INTRO + "{filler}" + NEEDLE + "{filler}" + QUESTION,
        "filler": FILLER,
        "lengths": config.lengths,
        "depths": config.depths,
        "trials": config.trials,
        "seed": config.seed,
        "decoding": f"greedy, up to {config.max_new_tokens} new tokens, no BOS",
        "tokenizer": getattr(tokenizer, "name_or_path", type(tokenizer).__name__),
        "tokenizer_sha256": vocab_digest(tokenizer),
    }
    return EvalResult(metrics=metrics, details=details, protocol=protocol)


def position_nll(
    model: nn.Module, documents: torch.Tensor, buckets: list[tuple[int, int]], bars: Bars = QUIET, chunk: int = 1024
) -> tuple[dict[str, float], dict]:
    """Mean NLL of the tokens at positions [a, b) of each document, per bucket (position 0 is never predicted)."""
    sums = torch.zeros(documents.shape[1], dtype=torch.float64)
    for start, logits in forward_windows(model, documents, 1, bars, "ppl_by_position"):
        targets = documents[start, 1:].to(logits.device)
        for lo in range(0, targets.numel(), chunk):
            logprobs = torch.log_softmax(logits[0, lo : lo + chunk], dim=-1)[: targets.numel() - lo]
            nll = -logprobs.gather(-1, targets[lo : lo + logprobs.shape[0], None]).squeeze(-1)
            sums[1 + lo : 1 + lo + nll.numel()] += nll.double().cpu()
        del logits
    metrics, table = {}, []
    for a, b in buckets:
        lo = max(a, 1)
        mean = (sums[lo:b].sum() / ((b - lo) * documents.shape[0])).item()
        metrics[bucket_metric(a, b)] = mean
        label = f"{length_label(a)}-{length_label(b)}"
        table.append({"bucket": label, "start": a, "end": b, "nll": mean, "ppl": math.exp(mean)})
    return metrics, {"nll_by_position": table}


@register_eval("ppl_by_position", PositionNLLConfig)
def run_position_nll(model: nn.Module, tokenizer, config: PositionNLLConfig, ctx: EvalContext) -> EvalResult:
    config.check(model)
    documents = token_windows(ctx.ids(), config.seq_len, config.documents, where="eval.ppl_by_position")
    began = time.perf_counter()
    metrics, details = position_nll(model, documents, config.buckets(), ctx.bars)
    seconds = time.perf_counter() - began
    details |= {"seconds": seconds, "tokens_per_s": documents.numel() / seconds}
    protocol = window_protocol(ctx, tokenizer, documents, seq_len=config.seq_len, stride=config.seq_len, bos=False)
    protocol["buckets"] = [f"{length_label(a)}-{length_label(b)}" for a, b in config.buckets()]
    return EvalResult(metrics=metrics, details=details, protocol=protocol)
