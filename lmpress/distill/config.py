"""Distillation as a recipe stage: the model the earlier stages made (pruned, quantized or smaller)
learns from the unmodified model.

Sample recipe stage (after ``sparsegpt`` 2:4, or a ``gptq`` stage at 3 bits):

    - method: distill
      text: builtin:wikitext2:valid   # default: the recipe's data.source
      seq_len: 512
      text_windows: null        # at most this many windows of the text (a seeded choice; default: all)
      train_on: text            # text | calibration (exactly the recipe's calibration samples; seq_len = data.seq_len)
      steps: 400
      batch_size: 4
      lr: 5.0e-5
      scale_lr: null            # quantization scales (default: lr)
      norm_lr: null             # RMSNorm/LayerNorm weights (default: lr)
      learn_weights: true       # false: linear weights stay, only scales, norms (and biases) train
      loss: forward_kl          # forward_kl | reverse_kl | jsd
      temperature: 1.0
      hidden: {kind: mse, weight: 1.0, layers: {0: 1, 7: 15}}   # student layer -> teacher layer
      teacher_logits: online    # online | cache (top-k log-probabilities on disk, forward_kl only)
      teacher_answers: {prompts: 64, quote_tokens: 128}   # + chat prompts quoting the text, answered by the teacher
      eval_every: 100           # held-out perplexity on the last eval_windows windows of the text
      checkpoint_every: 50      # --resume continues from the last checkpoint exactly

Quantized layers train with straight-through fake quantization on their own grid and are
frozen back into the same packed form (``student.py``); pruned layers keep their masks.
The teacher is the recipe's model as loaded from disk (``teacher:`` names another with
the same vocabulary). The training text must not be the eval text.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator
from torch import nn

from lmpress.anatomy import decoder_layers
from lmpress.distill.answers import TeacherAnswers
from lmpress.distill.losses import Divergence, HiddenLoss
from lmpress.distributed import fsdp_requested
from lmpress.errors import LmpressInputError
from lmpress.registry import StageConfig, StrictConfig

# A training step's tensors beside the weights, per token of a micro-batch (the memory forecast): float32 copies of
# the decoder linears' input and output widths (what autograd keeps for the backward pass, the gradients it makes)
# and of the logits (the teacher's and the student's, their log-softmaxes, the gradient). SmolLM2-135M, R4 + NVFP4
# with its scales and norms trained, the freed heap handed back after each step: peaks of 3.88 GiB at 512 tokens a
# step and 5.95 GiB at 1,024, 4.05 MB a token = 2.5 x 1.22 MB of widths + 5 x 0.197 MB of logits
# (bench/distill_memory.py measures the forecast against the stage's peak).
STEP_ACTIVATION_COPIES = 2.5
STEP_LOGIT_COPIES = 5


class HiddenMatch(StrictConfig):
    kind: HiddenLoss = "mse"
    weight: float = Field(1.0, gt=0)
    layers: dict[int, int] = Field(min_length=1, description="student decoder layer -> teacher decoder layer")


class DistillConfig(StageConfig):
    method: Literal["distill"] = "distill"
    teacher: str | None = Field(None, description="teacher model source; default: the recipe's model, unmodified")
    text: str | None = Field(None, description="training text; default: the recipe's data.source")
    seq_len: int = Field(512, ge=8)
    text_windows: int | None = Field(
        None, ge=1, description="train on at most this many windows of the text (a seeded choice); default: all"
    )
    train_on: Literal["text", "calibration"] = Field(
        "text",
        description="calibration: train on exactly the recipe's calibration samples (data.samples x data.seq_len); "
        "held-out windows are text windows that are not among them",
    )
    steps: int = Field(200, ge=1, le=1_000_000)
    batch_size: int = Field(4, ge=1)
    grad_accum: int = Field(1, ge=1, description="micro-batches per step (batch_size is split among them)")
    lr: float = Field(5e-5, gt=0, le=1.0)
    scale_lr: float | None = Field(None, gt=0, le=1.0, description="lr of quantization scales (default: lr)")
    norm_lr: float | None = Field(None, gt=0, le=1.0, description="lr of the norms' weights (default: lr)")
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(10, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    max_grad_norm: float = Field(1.0, ge=0)
    loss: Divergence = "forward_kl"
    temperature: float = Field(1.0, gt=0)
    logit_weight: float = Field(1.0, ge=0)
    ce_weight: float = Field(0.0, ge=0, description="cross-entropy on the training text, added to the divergence")
    hidden: HiddenMatch | None = None
    teacher_logits: Literal["online", "cache"] = "online"
    teacher_answers: TeacherAnswers | None = Field(
        None, description="add windows of chat prompts quoting the text, answered by the teacher (answers.py)"
    )
    top_k: int = Field(64, ge=1, description="teacher tokens kept per position by the cache")
    learn_scales: bool = True
    learn_weights: bool = Field(True, description="false: the linear layers' weights stay; scales, norms train")
    train_embeddings: bool = False
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    gradient_checkpointing: bool = False
    eval_every: int = Field(50, ge=0)
    eval_windows: int = Field(4, ge=1, description="windows at the end of the text held out of training")
    checkpoint_every: int = Field(50, ge=0)
    max_minutes: float | None = Field(None, gt=0, description="stop early after this much training time")
    seed: int = 0

    @model_validator(mode="after")
    def _consistent(self) -> DistillConfig:
        if self.train_on == "calibration" and (self.text is not None or self.text_windows is not None):
            raise ValueError(
                "train_on: calibration trains on the recipe's calibration samples: leave text and text_windows unset"
            )
        if self.text_windows is not None and self.text_windows < self.batch_size:
            raise ValueError(f"text_windows: {self.text_windows} is fewer than one batch ({self.batch_size})")
        if self.batch_size % self.grad_accum:
            raise ValueError(f"grad_accum: {self.grad_accum} does not divide batch_size: {self.batch_size}")
        if self.teacher_logits == "cache" and (self.loss != "forward_kl" or self.hidden is not None):
            raise ValueError(
                "teacher_logits: cache keeps the teacher's top-k log-probabilities only: "
                "use loss: forward_kl and no hidden-state loss, or teacher_logits: online"
            )
        if not self.logit_weight and not self.ce_weight and self.hidden is None:
            raise ValueError("every loss weight is zero: nothing to train on")
        return self

    trains_across_processes: ClassVar[bool] = True

    def training_bytes(
        self, shape: Any, teacher: Any, size: int, quantized: tuple[int, int], seq_len: int, processes: int
    ) -> int:
        """The teacher (the model as loaded, in the run's dtype), float32 gradients and AdamW's two moments of what
        trains, a latent float weight for each quantized weight that trains (``learn_weights``), and one step's
        tensors: ``STEP_ACTIVATION_COPIES`` float32 copies of the decoder linears' widths and ``STEP_LOGIT_COPIES``
        of the logits per token of a micro-batch (with ``gradient_checkpointing``, each decoder layer's input and
        one layer's tensors at a time)."""
        weights, groups = quantized
        window = seq_len if self.train_on == "calibration" else self.seq_len
        tokens = self.batch_size // (processes * self.grad_accum) * window
        widths = sum(rows + cols for _, rows, cols in shape.linears)
        if self.gradient_checkpointing:
            activations = shape.layers * shape.hidden + STEP_ACTIVATION_COPIES * widths / max(shape.layers, 1)
        else:
            activations = STEP_ACTIVATION_COPIES * widths
        step = tokens * 4 * (activations + STEP_LOGIT_COPIES * shape.vocab)
        if self.learn_weights:
            trained = shape.parameters - (0 if self.train_embeddings else shape.vocab * shape.hidden) + groups
        else:  # the quantized layers' codes fixed: their scales and the norms train
            trained = (2 * shape.layers + 1) * shape.hidden + (groups if self.learn_scales else 0)
        latent = 4 * weights if self.learn_weights else 0
        return int(teacher.parameters * size + latent + 12 * trained + step)

    def check_processes(self, world: int) -> None:
        if fsdp_requested():
            raise LmpressInputError(
                "stage distill: FSDP is not supported (freezing the student into packed codes needs its whole "
                "weights, FSDP keeps a shard per process): launch with DDP (accelerate launch --multi_gpu, or torchrun)"
            )
        if self.batch_size % (world * self.grad_accum):
            raise LmpressInputError(
                f"stage distill: batch_size {self.batch_size} does not split into {world} launched processes of "
                f"{self.grad_accum} micro-batch(es) each: make it a multiple of {world * self.grad_accum}"
            )

    def texts(self) -> list[str]:
        return [self.text] if self.text else []

    def training_texts(self, data_source: str) -> list[str]:
        return [self.text or data_source]

    def check(self, model: nn.Module) -> None:
        if self.hidden is not None and self.teacher is None:
            check_layer_map(self.hidden.layers.values(), len(decoder_layers(model)), "teacher")


def check_layer_map(indices, n_layers: int, side: str) -> None:
    bad = sorted(i for i in indices if not 0 <= i < n_layers)
    if bad:
        raise LmpressInputError(
            f"stage distill: hidden.layers names {side} layer(s) {bad}; the {side} has layers 0..{n_layers - 1}"
        )
