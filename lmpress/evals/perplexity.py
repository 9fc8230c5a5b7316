"""Token-level perplexity over fixed windows of the eval text.

Sample recipe eval:

    eval:
      text: builtin:wikitext2:test
      perplexity: {seq_len: 2048, windows: 20, batch_size: 4}

Perplexity = exp(mean next-token NLL over every scored position). Windows are
non-overlapping unless ``stride`` is set; with a stride, each window after the
first scores only its last ``stride`` positions (the ones no earlier window
scored). This is token-level perplexity, not lm-eval's word perplexity.

With a ``kld`` section (``perplexity: {..., kld: {}}``: exact, the default; or
``kld: {top_k: 64}``: the stored top-k lower bound) the same pass also stores the
baseline's reference or scores the candidate's KL divergence from it
(lmpress.evals.kld): perplexity and KLD share one forward pass.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import ClassVar

import torch
from pydantic import PositiveInt, model_validator
from torch import nn

from lmpress.anatomy import context_length
from lmpress.data import token_windows
from lmpress.errors import LmpressInputError
from lmpress.evals.kld import KLD_METRICS, CandidateScorer, KLDConfig, kld_consumer, vocab_digest, windows_digest
from lmpress.progress import QUIET, Bars
from lmpress.registry import EvalConfig, EvalContext, EvalResult, register_eval


class PerplexityConfig(EvalConfig):
    seq_len: PositiveInt = 2048
    windows: PositiveInt | None = 20  # None: every full window of the text
    stride: PositiveInt | None = None  # None: seq_len (non-overlapping)
    batch_size: PositiveInt = 4
    bos: bool = False  # prepend the tokenizer's BOS to each window
    kld: KLDConfig | None = None  # also KL(baseline || candidate) in the same pass

    # Metrics only the candidate has (no baseline value, so no _ratio/_delta gates).
    candidate_only: ClassVar[frozenset[str]] = frozenset([*KLD_METRICS, "kld_tokens_per_s"])

    @model_validator(mode="after")
    def _stride_fits(self) -> PerplexityConfig:
        if self.stride is not None and self.stride > self.seq_len:
            raise ValueError(f"stride {self.stride} is longer than seq_len {self.seq_len}")
        return self

    def metric_names(self) -> list[str]:
        kld = [*self.kld.metric_names(), "kld_tokens_per_s"] if self.kld else []
        return ["ppl", "nll", "ppl_tokens_per_s", *kld]

    def check(self, model: nn.Module) -> None:
        check_context(model, self.seq_len, "eval.perplexity")

    def logit_tokens(self) -> int:
        return self.batch_size * self.seq_len

    def windows_for(self, ids: torch.Tensor, tokenizer) -> torch.Tensor:
        bos = tokenizer.bos_token_id if self.bos else None
        if self.bos and bos is None:
            raise LmpressInputError("eval.perplexity.bos: the tokenizer has no BOS token")
        return token_windows(ids, self.seq_len, self.windows, self.stride, bos, where="eval.perplexity")

    def score_from(self, window_index: int) -> int:
        """First target position (index into the shifted targets) that window ``window_index`` scores."""
        if self.stride is None or window_index == 0:
            return 0
        return max(0, self.seq_len - 1 - self.stride)  # stride == seq_len: nothing overlaps, score every target


def check_context(model: nn.Module, seq_len: int, what: str) -> None:
    limit = context_length(model)
    if seq_len > limit:
        raise LmpressInputError(f"{what}: window of {seq_len} tokens is longer than the model's context ({limit})")


def forward_windows(
    model: nn.Module, windows: torch.Tensor, batch_size: int, bars: Bars = QUIET, label: str = "eval"
) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield ``(first_window_index, float32 logits of the batch)`` for every batch of windows.

    A plain generator over an inference-mode forward, not one decorated with ``torch.inference_mode()``: torch's
    wrapper of a decorated generator holds what it yielded until the next one is asked for, so a batch's logits
    (805 MB for SmolLM2's 4 x 1024 tokens) outlived the caller's ``del`` and stayed beside the next batch's: the
    quickstart's baseline eval peaked at 2.9 GB, 0.9 GB over the same loop without it.
    """
    device = next(model.parameters()).device
    starts = range(0, windows.shape[0], batch_size)
    for start in bars.track(starts, label, total=len(starts)):
        yield start, batch_logits(model, windows[start : start + batch_size].to(device))


@torch.inference_mode()
def batch_logits(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch, use_cache=False).logits.float()


WindowConsumer = Callable[[int, torch.Tensor], None]  # (window index, scored positions' log-probs)


def perplexity(
    model: nn.Module,
    windows: torch.Tensor,
    config: PerplexityConfig,
    bars: Bars = QUIET,
    consumer: WindowConsumer | None = None,
) -> dict[str, float]:
    """Perplexity over ``windows``; ``consumer`` sees every window's scored log-probabilities in the same pass."""
    total_nll, scored, consumer_seconds = 0.0, 0, 0.0
    began = time.perf_counter()
    for start, logits in forward_windows(model, windows, config.batch_size, bars, "perplexity"):
        targets = windows[start : start + logits.shape[0], 1:].to(logits.device)
        for row in range(logits.shape[0]):
            first = config.score_from(start + row)
            logprobs = torch.log_softmax(logits[row, first:-1], dim=-1)
            total_nll -= logprobs.gather(-1, targets[row, first:, None]).double().sum().item()
            scored += logprobs.shape[0]
            if consumer is not None:
                tick = time.perf_counter()
                consumer(start + row, logprobs)
                consumer_seconds += time.perf_counter() - tick
            del logprobs  # before the next row's (a window's: 201 MB for SmolLM2 at 1024 tokens)
        del logits
    seconds = time.perf_counter() - began
    mean_nll = total_nll / scored
    return {
        "ppl": math.exp(mean_nll),
        "nll": mean_nll,
        "ppl_tokens_per_s": windows.numel() / seconds,
        "scored_tokens": scored,
        "seconds": seconds,
        "consumer_seconds": consumer_seconds,
    }


def window_protocol(ctx: EvalContext, tokenizer, windows: torch.Tensor, **settings) -> dict:
    """How a set of token windows was cut from the eval text: enough to reproduce them."""
    return {
        "text_source": ctx.text.source,
        "text_sha256": ctx.text.sha256,
        "text_preprocessing": "UTF-8, CRLF->LF, documents joined as in the file, tokenized once without special tokens",
        **settings,
        "windows": int(windows.shape[0]),
        "tokenizer": getattr(tokenizer, "name_or_path", type(tokenizer).__name__),
        "tokenizer_sha256": vocab_digest(tokenizer),
        "windows_sha256": windows_digest(windows),
        "level": "token",
    }


def vocab_size(model: nn.Module) -> int:
    head = model.get_output_embeddings()  # nn.Linear or a quantized head (no .weight): both know out_features
    return int(getattr(head, "out_features", None) or head.weight.shape[0])


@register_eval("perplexity", PerplexityConfig)
def run_perplexity(model: nn.Module, tokenizer, config: PerplexityConfig, ctx: EvalContext) -> EvalResult:
    config.check(model)
    windows = config.windows_for(ctx.ids(), tokenizer)
    consumer = None
    if config.kld is not None:
        consumer = kld_consumer(config.kld, ctx.role, ctx.store, model, windows, tokenizer, vocab_size(model))
    with consumer.attached() if consumer is not None else nullcontext():
        result = perplexity(model, windows, config, ctx.bars, consumer)
    protocol = window_protocol(
        ctx, tokenizer, windows, seq_len=config.seq_len, stride=config.stride or config.seq_len, bos=config.bos
    )
    metrics = {k: result[k] for k in ("ppl", "nll", "ppl_tokens_per_s")}
    details = {k: result[k] for k in ("scored_tokens", "seconds")}
    if config.kld is not None:
        protocol["kld"] = config.kld.describe()
        details["kld_seconds"] = result["consumer_seconds"]
        if isinstance(consumer, CandidateScorer):
            kld_metrics, kld_details = consumer.result()
            metrics |= kld_metrics
            metrics["kld_tokens_per_s"] = result["ppl_tokens_per_s"]
            details |= kld_details
        else:
            consumer.save()
    return EvalResult(metrics=metrics, details=details, protocol=protocol)
