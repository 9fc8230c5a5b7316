"""KL divergence of the candidate's next-token distributions from the baseline's.

Per scored position t: KL(P_base(.|x<t) || P_cand(.|x<t)) over the full
vocabulary, on exactly the perplexity windows, computed in the same forward pass
as the candidate's perplexity (configure it inside the perplexity eval):

    eval:
      perplexity: {seq_len: 2048, windows: 20, kld: {top_k: 64}}

The baseline pass stores, per position, its top-k log-probabilities (fp32), their
token ids (int32) and the log of the remaining probability mass (fp32) in the
baseline's store directory: 8 bytes x k per position instead of 4 bytes x vocab
(SmolLM2, 20 x 2048 positions, k=64: 21 MB instead of 8 GB). A candidate position
is scored on the same coarse grid: the baseline's k tokens one by one plus
"every other token" as one outcome.

Error: lumping the remainder is a coarse-graining, so by the log-sum inequality
the stored KL never exceeds the exact one; the shortfall is
p_rest * KL(P_rest || Q_rest) (the remainder's conditional distributions), small
when k covers most of the baseline's mass. The log-probabilities stay fp32: fp16
rounding (spacing 2^-7 at |log p| ~ 10) moved the KL of near-identical models by
several percent. tests/evals/test_kld.py checks the stored form against the exact
full-vocabulary KL; an identical model scores exactly 0.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from pydantic import Field
from safetensors import safe_open
from safetensors.torch import save_file

from lmpress.errors import LmpressInputError
from lmpress.registry import StrictConfig

KLD_METRICS = ("kld_mean", "kld_median", "kld_p90", "kld_p99", "kld_max", "top1_agreement")
STORE_FORMAT = "lmpress-kld-topk-v1"
HIST_EDGES = [0.0] + [float(x) for x in np.logspace(-6, 2, 33)]  # nats; the first bin is [0, 1e-6)


class KLDConfig(StrictConfig):
    """``perplexity.kld``: score KL(baseline || candidate) in the perplexity pass."""

    top_k: int = Field(64, ge=1, le=4096)  # baseline tokens stored per position

    candidate_only: ClassVar[frozenset[str]] = frozenset(KLD_METRICS)

    def metric_names(self) -> list[str]:
        return list(KLD_METRICS)


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


def exact_kld(base_logprobs: torch.Tensor, cand_logprobs: torch.Tensor) -> torch.Tensor:
    """The full-vocabulary KL(P || Q) per row (float64): the reference the stored form approximates."""
    p = base_logprobs.double()
    return (p.exp() * (p - cand_logprobs.double())).sum(-1)


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


def vocab_digest(tokenizer) -> str:
    """sha256 of the tokenizer's token -> id mapping: two tokenizers with equal digests split text alike."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8")).hexdigest()


def windows_digest(windows: torch.Tensor) -> str:
    return hashlib.sha256(windows.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()


def store_path(store: Path, config: KLDConfig) -> Path:
    return store / f"kld-top{config.top_k}.safetensors"


class BaselineWriter:
    """Collects the baseline's stored form window by window and writes it once, atomically."""

    def __init__(self, path: Path, config: KLDConfig, windows: torch.Tensor, tokenizer, vocab: int) -> None:
        self.path, self.config = path, config
        self.meta = {
            "format": STORE_FORMAT,
            "windows_sha256": windows_digest(windows),
            "vocab_sha256": vocab_digest(tokenizer),
            "vocab": str(vocab),
            "top_k": str(config.top_k),
        }
        self.parts: list[dict[str, torch.Tensor]] = []

    def __call__(self, window_index: int, logprobs: torch.Tensor) -> None:
        self.parts.append(summarize_baseline(logprobs, self.config.top_k))

    def save(self) -> None:
        tensors = {key: torch.cat([p[key] for p in self.parts]).contiguous() for key in self.parts[0]}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        save_file(tensors, str(tmp), metadata=self.meta)
        tmp.replace(self.path)


class CandidateScorer:
    """Scores each window's candidate log-probabilities against the stored baseline."""

    def __init__(self, path: Path, windows: torch.Tensor, tokenizer, vocab: int) -> None:
        if not path.exists():
            raise LmpressInputError(
                f"eval.perplexity.kld: the baseline's stored distributions {path} are missing; "
                "run the baseline with the same eval settings first (or clear the baseline cache)"
            )
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
            self.top_logprobs = f.get_tensor("top_logprobs")
            self.top_ids = f.get_tensor("top_ids")
            self.log_rest = f.get_tensor("log_rest")
        check_same_vocab(meta, tokenizer, vocab, windows)
        self.offset = 0
        self.kld: list[torch.Tensor] = []
        self.agree: list[torch.Tensor] = []

    def __call__(self, window_index: int, logprobs: torch.Tensor) -> None:
        n = logprobs.shape[0]
        rows = slice(self.offset, self.offset + n)
        if self.offset + n > self.top_ids.shape[0]:
            raise LmpressInputError("eval.perplexity.kld: the candidate scores more positions than the baseline stored")
        kld, agree = score_candidate(logprobs, self.top_ids[rows], self.top_logprobs[rows], self.log_rest[rows])
        self.kld.append(kld)
        self.agree.append(agree)
        self.offset += n

    def result(self) -> tuple[dict[str, float], dict]:
        return kld_summary(torch.cat(self.kld), torch.cat(self.agree))


def check_same_vocab(meta: dict[str, str], tokenizer, vocab: int, windows: torch.Tensor) -> None:
    """A clear error when the candidate's vocabulary or tokenization differs from the baseline's."""
    if meta.get("format") != STORE_FORMAT:
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
