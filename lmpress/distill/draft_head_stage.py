"""``method: draft_head``: an EAGLE-3 draft head trained for the model the earlier stages made, as lmpress's runtime
runs it (``lmpress.distill.draft_head`` holds the training; ``lmpress.runtime.eagle3`` the head and its drafter).

The head is written beside the run's exports as ``OUT/draft-head/`` (speculators format, the exports'
fingerprints recorded); ``eval: speculation`` scores it on held-out text.

Sample (the last stage of a recipe; ``recipes/eagle-w4.yaml``):

    stages:
      - method: gptq
        bits: 4
        group_size: 64
      - method: draft_head
        prompts: 128            # calibration samples whose first prompt_tokens the target continues
        prompt_tokens: 64
        new_tokens: 192         # greedy tokens of the target per prompt: what the head learns
        draft_vocab: 8192       # the target's most frequent choices
        epochs: 3
        steps: 3                # drafting steps trained in a row (training-time test)
        batch_size: 4
        train_lm_head: false    # the output rows stay the target's (copied for the draft vocabulary)
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import Field
from torch import nn

from lmpress.distill.draft_head import (
    CAPTURE_BATCH,
    LOGIT_ROWS,
    DraftData,
    DraftHeadTraining,
    capture_draft_data,
    draft_vocabulary,
    held_out_scores,
    initialize_from_target,
    train_draft_head,
)
from lmpress.errors import LmpressInputError
from lmpress.export.speculators import export_fingerprint
from lmpress.memory import large_frees_unmapped, trim_c_heap
from lmpress.progress import QUIET, Bars
from lmpress.registry import StageConfig, StageContext, register_stage
from lmpress.runtime.eagle3 import Eagle3Config, Eagle3Head, attach_draft_head, draft_head_of, save_draft_head
from lmpress.runtime.model import Transformer

DATA_FILE = "draft-data.pt"
# Training's activations that glibc keeps resident as freed heap between steps, as a share of one step's: SmolLM2,
# batches of 4, 700-760 MiB measured against 512 counted without them, of which the activations were 374 (0.5-0.66).
# Handed back after every step (as distill's trainer does, where they are GiBs) they cost the head's training 6-9% of
# its time to save 50-75 MiB of its peak (64 prompts, interleaved, 2026-12-06): left to glibc, and counted here.
TRAINING_FREED_HEAP = 0.6


class DraftHeadConfig(StageConfig):
    method: str = "draft_head"
    prompts: int = Field(128, ge=2)
    prompt_tokens: int = Field(64, ge=1)
    new_tokens: int = Field(192, ge=1)
    draft_vocab: int = Field(8192, ge=1)
    epochs: int = Field(3, ge=1)
    steps: int = Field(3, ge=1, le=8)
    lr: float = Field(1e-3, gt=0)
    # SmolLM2 W4, 256 prompts, 3 epochs, held-out step-0 accuracy (docs/methods/draft-heads.md): batches of 4
    # (twice the optimizer steps for the same work) 0.428 against 0.410 with 8; the output rows kept as the
    # target's, not trained, 0.445 in 16% less time
    batch_size: int = Field(4, ge=1)
    train_lm_head: bool = False
    # The target's likeliest tokens learned per position (EAGLE-3's loss), 0: its greedy choice. SmolLM2 W4, 256
    # prompts, held-out tokens per pass: top 32 1.64 against 1.65 at 3 epochs, 1.76 against 1.83 at 6
    soft_labels: int = Field(0, ge=0)
    held_out: int = Field(8, ge=1)
    speculative_tokens: int = Field(3, ge=1, le=8)  # drafts per round written for vLLM
    seed: int = 0
    last_stage: ClassVar[bool] = True  # the head is trained for the finished model
    reads_whole_model: ClassVar[bool] = True  # lmpress's runtime runs the whole target
    learning_label: ClassVar[str] = "draft head"

    def learning_bytes(self, shape: Any, seq_len: int, packed: int = 0) -> int:
        """The runtime's copy of the target (float32 embeddings, its packed weights), the captured features
        (bfloat16), and the larger of the capture (a batch's KV cache, one read's float32 logits) and training.
        Training, in float32: the head with AdamW's state (16 bytes a trained parameter, 4 a frozen output row);
        per sequence and position, the last step's scores, their log-softmax and its gradient, and what each drafting
        step keeps for the backward pass: its log-softmax, its attention weights (a query head's over the
        positions), four MLP-wide and about ten hidden-wide tensors, and the blocks of them glibc keeps freed between
        steps (``TRAINING_FREED_HEAP``: training runs with glibc's heap as it is). SmolLM2, batches of 4: 512 MiB
        counted without them against 508-556 MiB measured with large blocks unmapped, 700-760 MiB with glibc's freed
        heap (docs/recipes.md)."""
        length = self.prompt_tokens + self.new_tokens
        positions = length - 1  # a sequence's training positions: each reads the next token's embedding
        width = 3 * shape.hidden  # the three target layers the head reads (default_feature_layers)
        runtime = 4 * shape.vocab * shape.hidden + packed
        features = self.prompts * length * (width * 2 + self.soft_labels * 6)  # bfloat16; int32 ids, bfloat16 p
        cache = CAPTURE_BATCH * length * shape.layers * 2 * shape.kv_width * 4
        capture = cache + LOGIT_ROWS * (shape.vocab + width) * 4
        capture += length * shape.vocab * 4 if self.soft_labels else 0  # a sequence's logsumexp for its top tokens
        output_rows = self.draft_vocab * shape.hidden
        trained = width * shape.hidden + 2 * shape.layer_parameters + (output_rows if self.train_lm_head else 0)
        per_step = self.draft_vocab + shape.heads * positions + 4 * shape.widest_input + 10 * shape.hidden
        activations = self.batch_size * positions * 4 * (3 * self.draft_vocab + self.steps * per_step)
        activations *= 1 + TRAINING_FREED_HEAP
        training = 16 * trained + (0 if self.train_lm_head else 4 * output_rows) + activations
        return int(runtime + features + max(capture, training))

    def training_texts(self, data_source: str) -> list[str]:
        return [data_source]  # the prompts the target continues

    def check(self, model: Any) -> None:
        vocab = model.config.vocab_size
        if self.draft_vocab > vocab:
            raise LmpressInputError(
                f"stage draft_head: draft_vocab {self.draft_vocab} is larger than the target's vocabulary ({vocab})"
            )
        if self.held_out >= self.prompts:
            raise LmpressInputError(f"stage draft_head: held_out {self.held_out} leaves none of {self.prompts} prompts")


def _draft_data(target: Transformer, config: DraftHeadConfig, ctx: StageContext, layers: tuple[int, ...]) -> DraftData:
    """The target's continuations, features and choices: captured once, kept in the stage's folder for --resume."""
    path = ctx.state_dir / DATA_FILE
    if ctx.resume and path.is_file():
        saved = torch.load(path, weights_only=True)
        top = saved.get("top_tokens")
        has_labels = config.soft_labels == 0 or (top is not None and top.shape[-1] >= config.soft_labels)
        if saved.get("fingerprint") == ctx.fingerprint and has_labels:  # else captured anew, with the soft labels
            return DraftData(**{f.name: saved.get(f.name) for f in dataclasses.fields(DraftData)})
    samples = ctx.calibration()
    if samples.shape[1] < config.prompt_tokens:
        raise LmpressInputError(
            f"stage draft_head: prompt_tokens {config.prompt_tokens} is longer than the calibration samples "
            f"({samples.shape[1]} tokens, data.seq_len)"
        )
    prompts = samples[: config.prompts, : config.prompt_tokens]
    if len(prompts) <= config.held_out:
        raise LmpressInputError(
            f"stage draft_head: {len(prompts)} calibration samples leave none to train on after held_out "
            f"{config.held_out} (data.samples)"
        )
    data = capture_draft_data(target, prompts, config.new_tokens, layers, bars=ctx.bars, soft_labels=config.soft_labels)
    ctx.state_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"fingerprint": ctx.fingerprint, **vars(data)}, path)
    return data


def train_head_for(
    target: Transformer,
    model: nn.Module,
    data: DraftData,
    config: DraftHeadConfig,
    head_config: Eagle3Config,
    bars: Bars = QUIET,
    held_out: DraftData | None = None,
) -> tuple[Eagle3Head, dict]:
    """A head of ``head_config``'s shape for ``target`` (the runtime of ``model``, the transformers model) trained
    on ``data`` as ``config`` says, and what it scored on the held-out continuations: ``held_out``, or else the last
    ``config.held_out`` rows of ``data``."""
    train, held_out = (data, held_out) if held_out is not None else data.split(config.held_out)
    torch.manual_seed(config.seed)
    head = Eagle3Head(head_config)
    head.draft_tokens.copy_(draft_vocabulary(train.choices, config.draft_vocab, head_config.vocab_size))
    copied = initialize_from_target(head, model)
    head.lm_head.weight.requires_grad_(config.train_lm_head or not copied)  # rows not the target's: learn them
    training = DraftHeadTraining(
        config.epochs, config.steps, config.lr, config.batch_size, config.seed, config.soft_labels
    )
    losses = train_draft_head(head, target, train, training, bars)
    accuracies, rounds = held_out_scores(head, target, held_out, config.steps, config.prompt_tokens - 1)
    expected, run = 1.0, 1.0
    for a in accuracies:  # a round of `steps` drafts: each accepted only after the ones before it
        run *= a
        expected += run
    return head, {
        "feature_layers": list(head_config.feature_layers),
        "draft_vocab": config.draft_vocab,
        "lm_head": "trained" if head.lm_head.weight.requires_grad else "the target's rows, frozen",
        "sequences": len(data.tokens),
        "tokens": int(data.tokens.numel()),
        "epoch_losses": losses,
        "held_out_step_accuracy": accuracies,
        "held_out_expected_accept_length": expected,  # the steps' accuracies alone: decoding gets less
        "held_out_accept_length": rounds,  # as decoding's rounds get it, on the held-out continuations
    }


@register_stage("draft_head", DraftHeadConfig)
def run_draft_head(model: nn.Module, config: DraftHeadConfig, ctx: StageContext) -> dict:
    began = time.perf_counter()
    target = Transformer.from_hf(model)  # the compressed model as lmpress's runtime runs it (its CPU kernels)
    head_config = Eagle3Config.for_target(target, model.config, config.draft_vocab)
    # each decode step frees buffers of a few MiB between long-lived ones: kept as freed heap they cost the capture
    # 220 MiB of its peak (SmolLM2, 64 prompts: 657 -> 436 MiB over the runtime, no slower). Training is left as
    # glibc runs it: unmapped, its buffers cost it 22% of its time (to save 200-250 MiB of its peak)
    with large_frees_unmapped():
        data = _draft_data(target, config, ctx, head_config.feature_layers)
    trim_c_heap()
    captured = time.perf_counter()
    head, summary = train_head_for(target, model, data, config, head_config, ctx.bars)
    attach_draft_head(model, head)
    return {**summary, "capture_seconds": captured - began, "train_seconds": time.perf_counter() - captured}


HEAD_FOLDER = "draft-head"


def export_draft_head(model: nn.Module, partial: Path, out: Path, formats: list[str], tokens: int) -> dict | None:
    """Write the head trained for ``model`` (None without one) to ``partial/draft-head`` in the speculators format,
    recording the fingerprint of each export of the run (``formats``, already in ``partial``) and naming the first
    as its verifier (where it will be once ``partial`` becomes ``out``)."""
    head = draft_head_of(model)
    if head is None:
        return None
    fingerprints = [f for f in (export_fingerprint(partial / fmt) for fmt in formats) if f is not None]
    head.config = dataclasses.replace(head.config, targets=tuple(fingerprints))
    verifier = str((out / formats[0]).resolve()) if formats else ""
    architectures = list(getattr(model.config, "architectures", None) or [])
    save_draft_head(head, partial / HEAD_FOLDER, verifier, architectures, tokens)
    size = sum(p.stat().st_size for p in (partial / HEAD_FOLDER).iterdir())
    return {"format": "speculators (EAGLE-3 draft head)", "path": HEAD_FOLDER, "size_mb": size / 1e6}
