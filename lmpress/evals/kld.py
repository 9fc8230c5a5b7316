"""KL divergence of the candidate's next-token distributions from the baseline's.

Per scored position t: KL(P_base(.|x<t) || P_cand(.|x<t)) over the full
vocabulary, on exactly the perplexity windows, computed in the same forward pass
as the candidate's perplexity (configure it inside the perplexity eval):

    eval:
      perplexity: {seq_len: 2048, windows: 20, kld: {}}            # exact (the default)
      perplexity: {seq_len: 2048, windows: 20, kld: {top_k: 64}}   # opt-in: stored top-k, a lower bound

Exact (``top_k: null``, the default). The baseline pass stores, per scored
position, the input of the model's output head (its final hidden state, fp32),
the head's weight (and bias) and the argmax token, and checks on the first window
that ``log_softmax(F.linear(h, W, b))`` reproduces the model's log-probabilities
(an architecture that post-processes its logits is refused, with top-k as the
way out). The candidate pass recomputes the baseline's logits with the baseline's
head, a chunk of positions at a time, and takes sum p (log p - log q) in float32
over the whole vocabulary. The store is small where the vocabulary is large
(SmolLM2, 20 x 2048 positions: 94 MB of hidden states + 113 MB of head instead
of 8 GB of log-probs); the price is one head matmul per position in the
candidate pass. An identical model scores exactly 0 where the recomputed log-probs
are bit-identical to the model's own, i.e. where a matmul row does not depend on
how many rows are computed at once: torch's CPU BLAS here, for chunks of at least
MIN_ROWS rows (tests/evals/test_kld.py checks it); elsewhere (a GPU's kernels)
an identical model may score float32 rounding noise instead of 0.

Top-k (``top_k: K``, for very large vocabularies). The baseline pass stores its
top-k log-probabilities (fp32), their token ids (int32) and the log of the
remaining probability mass (fp32): 8 bytes x k per position. A candidate position
is scored on the same coarse grid: the baseline's k tokens one by one plus
"every other token" as one outcome. Lumping the remainder is a coarse-graining,
so by the log-sum inequality the stored KL never exceeds the exact one; the
shortfall is p_rest * KL(P_rest || Q_rest) (the remainder's conditional
distributions): on SmolLM2 with k=64 about a fifth of the exact value.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from lmpress.calib.compute_dtype import widened_head
from lmpress.errors import LmpressInputError
from lmpress.registry import StrictConfig

KLD_METRICS = ("kld_mean", "kld_median", "kld_p90", "kld_p99", "kld_max", "top1_agreement")
EXACT_FORMAT = "lmpress-kld-exact-v1"
TOPK_FORMAT = "lmpress-kld-topk-v1"
HIST_EDGES = [0.0] + [float(x) for x in np.logspace(-6, 2, 33)]  # nats; the first bin is [0, 1e-6)
# Each of the two float32 (positions x vocab) buffers of the exact candidate pass. Every matmul call re-packs the
# whole head weight, so fewer, taller chunks are cheaper: on SmolLM2 (682 rows) 14% less CPU than 64 MiB chunks.
CHUNK_BYTES = 128 << 20
# Below ~8 rows CPU BLAS takes another kernel whose sums round differently from the model's big matmul.
MIN_ROWS = 16
HEAD_TOLERANCE = 1e-3  # of max |logit|: the recomputed head must reproduce the model's log-probs this closely


class KLDConfig(StrictConfig):
    """``perplexity.kld``: score KL(baseline || candidate) in the perplexity pass.

    ``top_k: null`` (default): exact, over the full vocabulary. ``top_k: K``: store only the baseline's
    top K log-probs per position (a lower bound of the exact KL; for vocabularies too large to recompute).
    """

    top_k: int | None = Field(None, ge=1, le=4096)

    candidate_only: ClassVar[frozenset[str]] = frozenset(KLD_METRICS)

    def metric_names(self) -> list[str]:
        return list(KLD_METRICS)

    @property
    def mode(self) -> str:
        return "exact" if self.top_k is None else f"top{self.top_k}"

    def describe(self) -> str:
        """The protocol line of this mode."""
        if self.top_k is None:
            return (
                "exact: full-vocabulary KL(P_base || P_cand); baseline final hidden states (fp32) and output head "
                "stored, its logits recomputed in the candidate pass; same windows"
            )
        return (
            f"top-{self.top_k}: stored baseline top-{self.top_k} log-probs (fp32) + rest mass, same windows "
            "(a lower bound of the exact KL)"
        )


# Exact mode ---------------------------------------------------------------------------------------------------


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """``out = F.linear(hidden, weight, bias)`` as float32, with the model's own arithmetic (same dtype, same op)."""
    h = hidden.to(weight.dtype)
    if weight.dtype != out.dtype:
        out.copy_(F.linear(h, weight, bias))
    elif bias is None:
        torch.mm(h, weight.t(), out=out)
    else:
        torch.addmm(bias, h, weight.t(), out=out)


class ExactKL:
    """KL(P_base || P_cand) per position, P_base recomputed from the baseline's hidden states and output head.

    Works through the positions in chunks whose two float32 (rows x vocab) buffers are allocated once.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, device: torch.device) -> None:
        self.weight = widened_head(weight.to(device))  # as the model's forward computes it (layers_in_float32)
        self.bias = widened_head(None if bias is None else bias.to(device))
        vocab = weight.shape[0]
        self.rows = max(MIN_ROWS, CHUNK_BYTES // (4 * vocab))
        self.logits = torch.empty(self.rows, vocab, device=device)
        self.logp = torch.empty(self.rows, vocab, device=device)

    def base_logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        """The baseline's log-probs for ``hidden`` (at most ``rows`` positions); a view of a reused buffer."""
        n = hidden.shape[0]
        if n < MIN_ROWS:
            hidden = torch.cat([hidden, hidden[-1:].expand(MIN_ROWS - n, -1)])
        m = hidden.shape[0]
        head_logits(hidden, self.weight, self.bias, self.logits[:m])
        return torch.log_softmax(self.logits[:m], dim=-1, out=self.logp[:m])[:n]

    def __call__(self, hidden: torch.Tensor, cand_logprobs: torch.Tensor) -> torch.Tensor:
        """Per-position KL (float32, >= 0) of ``cand_logprobs`` (positions x vocab) from the recomputed baseline."""
        n = hidden.shape[0]
        kld = torch.empty(n, device=cand_logprobs.device)
        for start in range(0, n, self.rows):
            stop = min(n, start + self.rows)
            logp = self.base_logprobs(hidden[start:stop])
            terms = torch.sub(logp, cand_logprobs[start:stop], out=self.logits[: stop - start])
            terms.mul_(logp.exp_())  # p (log p - log q); exactly 0 where the log-probs are equal
            kld[start:stop] = terms.sum(-1)
        return kld.clamp_min_(0.0)


class Consumer:
    """What the perplexity pass feeds each window's log-probs to; ``attached`` hooks into the model if needed."""

    @contextmanager
    def attached(self) -> Iterator[None]:
        yield


def check_head(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, logprobs: torch.Tensor) -> None:
    """Refuse a model whose log-probs are not ``log_softmax`` of its output head applied to the head's input."""
    rows = min(hidden.shape[0], 256)
    logits = torch.empty(max(rows, MIN_ROWS), weight.shape[0], device=logprobs.device)
    h = hidden[:rows].to(logprobs.device)
    h = torch.cat([h, h[-1:].expand(logits.shape[0] - rows, -1)])
    bias = widened_head(None if bias is None else bias.to(logprobs.device))
    head_logits(h, widened_head(weight.to(logprobs.device)), bias, logits)
    error = (torch.log_softmax(logits[:rows], dim=-1) - logprobs[:rows]).abs().max().item()
    if not error <= HEAD_TOLERANCE * max(1.0, logits[:rows].abs().max().item()):
        raise LmpressInputError(
            "eval.perplexity.kld: this model's log-probs are not its output head applied to the head's input "
            f"(max difference {error:.3g}; the architecture post-processes its logits), so exact KLD cannot "
            "recompute them; use the stored top-k form: kld: {top_k: 64}"
        )


class ExactBaselineWriter(Consumer):
    """Collects the baseline's head inputs (a forward hook on the output head) and writes them once, atomically."""

    def __init__(self, path: Path, model: nn.Module, windows: torch.Tensor, tokenizer, vocab: int) -> None:
        self.path, self.head = path, model.get_output_embeddings()
        if self.head is None or not isinstance(getattr(self.head, "weight", None), torch.Tensor):
            raise LmpressInputError(
                "eval.perplexity.kld: exact KLD needs the model's output head (a linear layer); "
                "use the stored top-k form: kld: {top_k: 64}"
            )
        self.meta = store_meta(EXACT_FORMAT, windows, tokenizer, vocab)
        self.batch: torch.Tensor | None = None
        self.batch_first = self.seen = 0
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.hidden: list[torch.Tensor] = []
        self.top1: list[torch.Tensor] = []

    @contextmanager
    def attached(self) -> Iterator[None]:
        handle = self.head.register_forward_hook(self._capture)
        try:
            yield
        finally:
            handle.remove()
            self.batch = None

    def _capture(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if not args:  # the head was called with keywords only: __call__ then refuses the model
            self.batch = None
            return
        self.batch, self.batch_first = args[0].detach(), self.seen
        self.seen += args[0].shape[0]
        if self.weight is None:
            self.weight = module.weight.detach().to("cpu", copy=True)
            bias = getattr(module, "bias", None)
            self.bias = None if bias is None else bias.detach().to("cpu", copy=True)

    def __call__(self, window_index: int, logprobs: torch.Tensor) -> None:
        n, row = logprobs.shape[0], window_index - self.batch_first
        if self.batch is None or not 0 <= row < self.batch.shape[0] or self.batch.shape[1] < n + 1:
            raise LmpressInputError(
                "eval.perplexity.kld: the output head's input does not line up with the model's logits; "
                "use the stored top-k form: kld: {top_k: 64}"
            )
        hidden = self.batch[row, -n - 1 : -1].to("cpu", torch.float32, copy=True)
        if not self.hidden:
            check_head(hidden, self.weight, self.bias, logprobs)
        self.hidden.append(hidden)
        self.top1.append(logprobs.argmax(-1).int().cpu())

    def save(self) -> None:
        tensors = {"hidden": torch.cat(self.hidden), "top1": torch.cat(self.top1), "head_weight": self.weight}
        if self.bias is not None:
            tensors["head_bias"] = self.bias
        save_atomic(self.path, tensors, self.meta)


class ExactScorer(Consumer):
    """Scores each window's candidate log-probs against the baseline recomputed from its stored head inputs."""

    def __init__(self, path: Path, windows: torch.Tensor, tokenizer, vocab: int) -> None:
        self.path = path
        with open_store(path) as f:
            check_same_vocab(f.metadata(), EXACT_FORMAT, tokenizer, vocab, windows)
            self.weight = f.get_tensor("head_weight")
            self.bias = f.get_tensor("head_bias") if "head_bias" in f.keys() else None
            self.top1 = f.get_tensor("top1")
        self.kernel: ExactKL | None = None
        self.offset = 0
        self.kld: list[torch.Tensor] = []
        self.agree: list[torch.Tensor] = []

    def __call__(self, window_index: int, logprobs: torch.Tensor) -> None:
        n = logprobs.shape[0]
        stop = self.offset + n
        if stop > self.top1.shape[0]:
            raise LmpressInputError("eval.perplexity.kld: the candidate scores more positions than the baseline stored")
        if self.kernel is None:
            self.kernel = ExactKL(self.weight, self.bias, logprobs.device)
        with safe_open(str(self.path), framework="pt") as f:
            hidden = f.get_slice("hidden")[self.offset : stop].to(logprobs.device)
        self.kld.append(self.kernel(hidden, logprobs).cpu())
        self.agree.append(top1_agrees(logprobs, self.top1[self.offset : stop]).cpu())
        self.offset = stop

    def result(self) -> tuple[dict[str, float], dict]:
        return kld_summary(torch.cat(self.kld), torch.cat(self.agree))


def top1_agrees(logprobs: torch.Tensor, base_top1: torch.Tensor) -> torch.Tensor:
    """Whether the baseline's top token is a top token of the candidate (amax: several times faster than argmax)."""
    top = logprobs.gather(-1, base_top1.to(logprobs.device, torch.long)[:, None]).squeeze(-1)
    return top == logprobs.amax(-1)


# Top-k mode ---------------------------------------------------------------------------------------------------


def log_rest_mass(top_logprobs: torch.Tensor) -> torch.Tensor:
    """log(1 - sum(exp(top_logprobs))) per row, in float32; the rest is floored at 1e-12 of the mass."""
    mass = top_logprobs.double().exp().sum(-1)
    return torch.log1p(-mass.clamp(max=1.0 - 1e-12)).float()


def coarse_logprobs(top_logprobs: torch.Tensor, log_rest: torch.Tensor) -> torch.Tensor:
    """Log-probabilities on the grid (k tokens, rest), renormalized against rounding (float64)."""
    grid = torch.cat([top_logprobs.double(), log_rest.double()[:, None]], dim=-1)
    return grid - torch.logsumexp(grid, dim=-1, keepdim=True)


def coarse_kld(base_grid: torch.Tensor, cand_grid: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) per row of two grids of log-probabilities; 0 where they are equal."""
    terms = base_grid.exp() * (base_grid - cand_grid)
    return terms.sum(-1).clamp_min(0.0)


def summarize_baseline(logprobs: torch.Tensor, top_k: int) -> dict[str, torch.Tensor]:
    """The stored form of ``(positions, vocab)`` baseline log-probabilities."""
    k = min(top_k, logprobs.shape[-1] - 1)
    top = logprobs.topk(k, dim=-1)
    return {
        "top_logprobs": top.values.float(),
        "top_ids": top.indices.int(),
        "log_rest": log_rest_mass(top.values),
    }


def score_candidate(
    logprobs: torch.Tensor, top_ids: torch.Tensor, base_top: torch.Tensor, base_rest: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position KL on the stored grid and whether the argmax tokens agree."""
    cand_top = logprobs.gather(-1, top_ids.long())
    cand_grid = coarse_logprobs(cand_top, log_rest_mass(cand_top))
    base_grid = coarse_logprobs(base_top, base_rest)
    agree = logprobs.argmax(-1) == top_ids[:, 0].long()
    return coarse_kld(base_grid, cand_grid), agree


class TopKBaselineWriter(Consumer):
    """Collects the baseline's top-k form window by window and writes it once, atomically."""

    def __init__(self, path: Path, top_k: int, windows: torch.Tensor, tokenizer, vocab: int) -> None:
        self.path, self.top_k = path, top_k
        self.meta = store_meta(TOPK_FORMAT, windows, tokenizer, vocab) | {"top_k": str(top_k)}
        self.parts: list[dict[str, torch.Tensor]] = []

    def __call__(self, window_index: int, logprobs: torch.Tensor) -> None:
        self.parts.append({k: v.cpu() for k, v in summarize_baseline(logprobs, self.top_k).items()})

    def save(self) -> None:
        save_atomic(self.path, {key: torch.cat([p[key] for p in self.parts]) for key in self.parts[0]}, self.meta)


class TopKScorer(Consumer):
    """Scores each window's candidate log-probabilities against the stored top-k baseline."""

    def __init__(self, path: Path, windows: torch.Tensor, tokenizer, vocab: int) -> None:
        with open_store(path) as f:
            check_same_vocab(f.metadata(), TOPK_FORMAT, tokenizer, vocab, windows)
            self.top_logprobs = f.get_tensor("top_logprobs")
            self.top_ids = f.get_tensor("top_ids")
            self.log_rest = f.get_tensor("log_rest")
        self.offset = 0
        self.kld: list[torch.Tensor] = []
        self.agree: list[torch.Tensor] = []

    def __call__(self, window_index: int, logprobs: torch.Tensor) -> None:
        n = logprobs.shape[0]
        rows = slice(self.offset, self.offset + n)
        if self.offset + n > self.top_ids.shape[0]:
            raise LmpressInputError("eval.perplexity.kld: the candidate scores more positions than the baseline stored")
        stored = (self.top_ids[rows], self.top_logprobs[rows], self.log_rest[rows])
        kld, agree = score_candidate(logprobs, *(t.to(logprobs.device) for t in stored))
        self.kld.append(kld.cpu())
        self.agree.append(agree.cpu())
        self.offset += n

    def result(self) -> tuple[dict[str, float], dict]:
        return kld_summary(torch.cat(self.kld), torch.cat(self.agree))


# Both modes ---------------------------------------------------------------------------------------------------

BaselineWriter = ExactBaselineWriter | TopKBaselineWriter
CandidateScorer = ExactScorer | TopKScorer


def kld_consumer(
    config: KLDConfig, role: str, store: Path, model: nn.Module, windows: torch.Tensor, tokenizer, vocab: int
) -> BaselineWriter | CandidateScorer:
    """What the perplexity pass feeds its log-probs to: the baseline's writer, or a candidate's scorer."""
    path = store_path(store, config)
    if role == "baseline":
        if config.top_k is None:
            return ExactBaselineWriter(path, model, windows, tokenizer, vocab)
        return TopKBaselineWriter(path, config.top_k, windows, tokenizer, vocab)
    scorer = ExactScorer if config.top_k is None else TopKScorer
    return scorer(path, windows, tokenizer, vocab)


def store_path(store: Path, config: KLDConfig) -> Path:
    return store / f"kld-{config.mode}.safetensors"


def vocab_digest(tokenizer) -> str:
    """sha256 of the tokenizer's token -> id mapping: two tokenizers with equal digests split text alike."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8")).hexdigest()


def windows_digest(windows: torch.Tensor) -> str:
    return hashlib.sha256(windows.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()


def store_meta(form: str, windows: torch.Tensor, tokenizer, vocab: int) -> dict[str, str]:
    return {
        "format": form,
        "windows_sha256": windows_digest(windows),
        "vocab_sha256": vocab_digest(tokenizer),
        "vocab": str(vocab),
    }


def save_atomic(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=meta)
    tmp.replace(path)


def open_store(path: Path):
    if not path.exists():
        raise LmpressInputError(
            f"eval.perplexity.kld: the baseline's stored distributions {path} are missing; "
            "run the baseline with the same eval settings first (or clear the baseline cache)"
        )
    return safe_open(str(path), framework="pt")


def check_same_vocab(meta: dict[str, str], form: str, tokenizer, vocab: int, windows: torch.Tensor) -> None:
    """A clear error when the candidate's vocabulary or tokenization differs from the baseline's."""
    if meta.get("format") != form:
        raise LmpressInputError(f"eval.perplexity.kld: the baseline store has format {meta.get('format')!r}")
    if int(meta["vocab"]) != vocab:
        raise LmpressInputError(
            f"eval.perplexity.kld: the candidate's vocabulary has {vocab} entries, the baseline's "
            f"{meta['vocab']}; KLD is undefined between different vocabularies (use the baseline's tokenizer)"
        )
    if meta["vocab_sha256"] != vocab_digest(tokenizer) or meta["windows_sha256"] != windows_digest(windows):
        raise LmpressInputError(
            "eval.perplexity.kld: the candidate's tokenizer differs from the baseline's (other token ids or "
            "other token windows); KLD is undefined across tokenizers (use the baseline's tokenizer)"
        )


def kld_summary(kld: torch.Tensor, agree: torch.Tensor) -> tuple[dict[str, float], dict]:
    """Metrics over all scored positions, and a histogram of per-position KL for the report."""
    values = kld.double().numpy()
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    metrics = {
        "kld_mean": float(values.mean()),
        "kld_median": float(p50),
        "kld_p90": float(p90),
        "kld_p99": float(p99),
        "kld_max": float(values.max()),
        "top1_agreement": float(agree.double().mean()),
    }
    edges = np.array(HIST_EDGES)
    counts, _ = np.histogram(np.clip(values, 0.0, edges[-1]), bins=edges)
    details = {"kld_positions": int(values.size), "kld_histogram": {"edges": HIST_EDGES, "counts": counts.tolist()}}
    return metrics, details
