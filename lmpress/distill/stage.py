"""Distillation as a recipe stage: the model the earlier stages made (pruned, quantized or smaller)
learns from the unmodified model. Its settings and a sample stage: ``config.py``.

Quantized layers train with straight-through fake quantization on their own grid and are
frozen back into the same packed form (``student.py``); pruned layers keep their masks.
The teacher is the recipe's model as loaded from disk (``teacher:`` names another with
the same vocabulary). The training text must not be the eval text.
"""

from __future__ import annotations

import torch
from torch import nn

from lmpress.anatomy import decoder_layers
from lmpress.data import load_text, tokenize
from lmpress.distill.answers import teacher_answer_windows
from lmpress.distill.config import DistillConfig, check_layer_map
from lmpress.distill.student import freeze_student, prepare_student
from lmpress.distill.trainer import TrainingWindows, held_out_perplexity, split_windows, train_student
from lmpress.errors import LmpressInputError
from lmpress.placement import on_device
from lmpress.registry import StageContext, register_stage


def check_same_vocabulary(student: nn.Module, teacher: nn.Module) -> None:
    s, t = student.get_output_embeddings(), teacher.get_output_embeddings()
    s_vocab = s.weight.shape[0] if s is not None else student.config.vocab_size
    t_vocab = t.weight.shape[0] if t is not None else teacher.config.vocab_size
    if s_vocab != t_vocab:
        raise LmpressInputError(
            f"stage distill: the student's vocabulary ({s_vocab} tokens) differs from the teacher's ({t_vocab}): "
            "logit distillation needs the same tokenizer"
        )


def calibration_windows(samples: torch.Tensor, ids: torch.Tensor, config: DistillConfig) -> TrainingWindows:
    """The calibration samples as training windows, and the last ``eval_windows`` windows of the text that
    overlap none of them as held-out windows."""
    if samples.shape[1] != config.seq_len:
        raise LmpressInputError(
            f"stage distill: train_on: calibration needs seq_len: {samples.shape[1]} (data.seq_len), "
            f"not {config.seq_len}"
        )
    if samples.shape[0] < config.batch_size:
        raise LmpressInputError(
            f"stage distill: {samples.shape[0]} calibration samples are fewer than one batch of {config.batch_size}"
        )
    text = split_windows(ids, config.seq_len, 0, 1).train
    unused = [w for w in text.flip(0) if not (samples == w).all(dim=1).any()][: config.eval_windows]
    if len(unused) < config.eval_windows:
        raise LmpressInputError(
            f"stage distill: the text has {len(unused)} windows outside the calibration samples, "
            f"{config.eval_windows} wanted as held-out (eval_windows)"
        )
    return TrainingWindows(samples.clone(), torch.stack(unused[::-1]))


@register_stage("distill", DistillConfig)
def run_distill(model: nn.Module, config: DistillConfig, ctx: StageContext) -> dict:
    if ctx.teacher is None or ctx.tokenizer is None:
        raise LmpressInputError("stage distill needs the recipe's model as its teacher (run it from a recipe)")
    teacher = ctx.teacher(config.teacher)
    check_same_vocabulary(model, teacher)
    if config.hidden is not None:
        check_layer_map(config.hidden.layers.keys(), len(decoder_layers(model)), "student")
        check_layer_map(config.hidden.layers.values(), len(decoder_layers(teacher)), "teacher")
    source = config.text or ctx.text_source
    ids = tokenize(ctx.tokenizer, load_text(source, default_split="train"))
    if config.train_on == "calibration":
        windows = calibration_windows(ctx.calibration(), ids, config)
    else:
        windows = split_windows(ids, config.seq_len, config.eval_windows, config.batch_size)
    quoted = windows.train.flatten()
    if config.text_windows is not None and config.text_windows < windows.train.shape[0]:
        chosen = torch.randperm(windows.train.shape[0], generator=torch.Generator().manual_seed(config.seed))
        windows = TrainingWindows(windows.train[chosen[: config.text_windows].sort().values], windows.held_out)
    for p in teacher.parameters():
        p.requires_grad_(False)
    counts = prepare_student(model, config.learn_scales, config.train_embeddings, config.learn_weights)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if not trainable:
        raise LmpressInputError("stage distill: nothing to train (learn_weights and learn_scales are off, no norms)")
    # the student and the teacher on the compute device for the whole stage; back on the CPU after, where the
    # student is frozen into its packed form
    # a step's activations are freed between steps: mapped on their own, they go back to the OS at once instead of
    # staying resident as freed heap that the next step's slightly different blocks do not all reuse
    with on_device(ctx.device, model, teacher):
        if config.teacher_answers is not None:
            answers = teacher_answer_windows(
                teacher.eval(),
                ctx.tokenizer,
                quoted,
                config.teacher_answers,
                config.seq_len,
                config.seed,
                ctx.state_dir,
                ctx.device,
                ctx.bars,
            )
            windows = TrainingWindows(torch.cat([windows.train, answers]), windows.held_out)
        ppl_before = held_out_perplexity(model, windows.held_out, ctx.device) if config.eval_every else None
        log = train_student(
            model,
            teacher,
            windows,
            config,
            ctx.state_dir,
            (ctx.shared_state_dir or ctx.state_dir) / "checkpoint",
            ctx.resume,
            ctx.fingerprint,
            ctx.device,
            ctx.bars,
        )
    del teacher
    frozen = freeze_student(model)
    return {
        **counts,
        "trainable_parameters": trainable,
        "frozen_quantized_layers": frozen,
        "training_windows": windows.train.shape[0],
        "steps": log.step,
        "tokens": log.tokens,
        "train_seconds": round(log.seconds, 1),
        "tokens_per_s": round(log.tokens / max(log.seconds, 1e-9), 1),
        "held_out_ppl_before": ppl_before,
        "held_out_ppl_after": log.evals[-1]["ppl"] if log.evals else None,
        "training": {"losses": log.losses, "evals": log.evals},
    }
