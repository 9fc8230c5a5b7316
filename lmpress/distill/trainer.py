"""The distillation training loop, on accelerate: one process on a CPU and DDP across launched processes
(``accelerate launch``, ``torchrun``; CPUs or GPUs) run the same code. FSDP is refused before any work
(``DistillConfig.check_processes``).

Every step is a function of the step number alone: the windows of step ``s`` come from
a permutation seeded by ``(seed, epoch)``, the learning rate from a cosine schedule with
linear warm-up. A checkpoint (accelerate's ``save_state``: student, optimizer, scheduler
and every RNG, plus this loop's step, history and the run's fingerprint) is written
aside and renamed into place every ``checkpoint_every`` steps, so ``--resume`` after a
kill continues from the last one and ends with the same weights as a run that was
never stopped.

Launched processes (``lmpress.distributed``) split each global batch between them; DDP averages
their gradients, so N processes take the steps one process would (up to the order of float sums).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lmpress.distill.losses import hidden_state_loss, logit_divergence
from lmpress.distill.student import apply_masks, norm_parameters
from lmpress.distill.teacher import TeacherCache, TeacherOutputs, teacher_forward
from lmpress.errors import LmpressInputError
from lmpress.memory import trim_c_heap
from lmpress.metrics import token_nll
from lmpress.placement import naming_out_of_memory
from lmpress.progress import QUIET, Bars

if TYPE_CHECKING:
    from lmpress.distill.config import DistillConfig


@dataclass
class TrainingWindows:
    """Token windows ``(n, seq_len)`` to train on, and held-out windows of the same text to evaluate on."""

    train: torch.Tensor
    held_out: torch.Tensor

    def rows(self, step: int, batch_size: int, seed: int) -> torch.Tensor:
        """Indices of the windows of global batch ``step``: epoch by epoch through a seeded permutation."""
        n = self.train.shape[0]
        per_epoch = n // batch_size  # a partial batch at an epoch's end is dropped
        epoch, position = divmod(step, per_epoch)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        return order[position * batch_size : (position + 1) * batch_size]


def split_windows(ids: torch.Tensor, seq_len: int, held_out: int, batch_size: int) -> TrainingWindows:
    """Non-overlapping windows of ``ids``; the last ``held_out`` are kept out of training."""
    n = ids.numel() // seq_len
    windows = ids[: n * seq_len].reshape(n, seq_len)
    if n - held_out < batch_size:
        raise LmpressInputError(
            f"stage distill: the training text makes {n} windows of {seq_len} tokens ({held_out} held out for "
            f"evaluation), fewer than one batch of {batch_size}: use more text, a shorter seq_len or a smaller batch"
        )
    return TrainingWindows(windows[: n - held_out], windows[n - held_out :])


def warmup_cosine(warmup: int, total: int, floor: float) -> Any:
    """lr multiplier at step s: linear warm-up to 1 over ``warmup`` steps, then cosine down to ``floor``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def distillation_loss(
    student: nn.Module, ids: torch.Tensor, teacher: TeacherOutputs, config: DistillConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    """The recipe's weighted sum: logit divergence, cross-entropy on the text, mapped hidden states."""
    hidden = config.hidden
    out = student(ids, use_cache=False, output_hidden_states=hidden is not None)
    parts: dict[str, torch.Tensor] = {}
    if config.logit_weight:
        kl = logit_divergence(out.logits, teacher.logits, config.loss, config.temperature)
        parts[config.loss] = config.logit_weight * kl
    if config.ce_weight:
        logprobs = torch.log_softmax(out.logits[:, :-1].float(), dim=-1)
        nll = -logprobs.gather(-1, ids[:, 1:, None]).mean()
        parts["ce"] = config.ce_weight * nll
    if hidden is not None:
        pairs = hidden.layers.items()
        terms = [hidden_state_loss(out.hidden_states[s + 1], teacher.hidden[t], hidden.kind) for s, t in pairs]
        parts[f"hidden_{hidden.kind}"] = hidden.weight * torch.stack(terms).mean()
    total = torch.stack(list(parts.values())).sum()
    return total, {name: float(value.detach()) for name, value in parts.items()}


@torch.no_grad()
def held_out_perplexity(model: nn.Module, windows: torch.Tensor, device: torch.device) -> float:
    was_training = model.training
    model.eval()
    nll, count = 0.0, 0
    for window in windows:
        ids = window[None].to(device)
        nll += token_nll(model(ids, use_cache=False).logits.float(), ids).double().sum().item()
        count += ids.shape[1] - 1
    model.train(was_training)
    return math.exp(nll / max(count, 1))


@dataclass
class TrainingLog:
    step: int = 0
    seconds: float = 0.0  # training time so far, across resumes
    tokens: int = 0
    losses: list[dict[str, float]] = field(default_factory=list)  # per step: total and its parts, lr
    evals: list[dict[str, float]] = field(default_factory=list)  # {"step", "ppl"}


def parameter_groups(student: nn.Module, config: DistillConfig) -> list[dict]:
    """AdamW groups: weights (``lr``, weight decay), quantization scales (``scale_lr``), norms (``norm_lr``)."""
    norms = norm_parameters(student)
    scales, norm, others = [], [], []
    for name, p in student.named_parameters():
        if p.requires_grad:
            (scales if name.endswith(".scales") else norm if p in norms else others).append(p)
    groups = [
        {"params": others, "lr": config.lr, "weight_decay": config.weight_decay},
        {"params": scales, "lr": config.scale_lr or config.lr, "weight_decay": 0.0},
        {"params": norm, "lr": config.norm_lr or config.lr, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def train_student(
    student: nn.Module,
    teacher: nn.Module,
    windows: TrainingWindows,
    config: DistillConfig,
    state_dir: Path,
    checkpoint: Path,
    resume: bool,
    fingerprint: str,
    device: torch.device,
    bars: Bars = QUIET,
) -> TrainingLog:
    """Train ``student`` (in place) towards ``teacher`` for ``config.steps`` optimizer steps.

    ``state_dir`` is this process's (the teacher cache); ``checkpoint`` is the directory every launched
    process saves into and resumes from."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import set_seed

    # accelerate keeps one configuration per process and refuses another mixed precision: each training stage
    # (a recipe may have several, a Python session may run several recipes) sets its own. The launched
    # processes' group (PartialState) stays.
    AcceleratorState._reset_state(reset_partial_state=False)
    # the student and the teacher compute on ``device`` (the stage's, one per launched process), placed here
    # rather than by accelerate, so that every tensor of the stage is where the caller's device says
    accelerator = Accelerator(cpu=device.type == "cpu", mixed_precision=config.mixed_precision, device_placement=False)
    set_seed(config.seed)
    if config.gradient_checkpointing and hasattr(student, "gradient_checkpointing_enable"):
        student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    student.to(device).train()
    teacher.to(device).eval()
    optimizer = torch.optim.AdamW(parameter_groups(student, config), betas=(0.9, 0.95))
    schedule = warmup_cosine(config.warmup_steps, config.steps, config.min_lr_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    student, optimizer = accelerator.prepare(student, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    cache = None
    if config.teacher_logits == "cache":
        cache = TeacherCache(state_dir / "teacher", *windows.train.shape, config.top_k, fingerprint)
    hidden_layers = set(config.hidden.layers.values()) if config.hidden else set()

    log = TrainingLog()
    rank, world = accelerator.process_index, accelerator.num_processes
    if resume and (checkpoint / "trainer.json").exists():
        saved = json.loads((checkpoint / "trainer.json").read_text())
        if saved["fingerprint"] != fingerprint:
            raise LmpressInputError(
                f"--resume: the checkpoint in {checkpoint} was written for another model, text or stage settings"
            )
        if saved.get("processes", 1) != world:
            raise LmpressInputError(
                f"--resume: the checkpoint in {checkpoint} was written by {saved.get('processes', 1)} processes; "
                f"resume with as many (this run has {world})"
            )
        accelerator.load_state(str(checkpoint))
        log = TrainingLog(**saved["log"])
        bars.log(f"distill: resuming at step {log.step} of {config.steps}")

    per_process = config.batch_size // world
    advance = bars.counter("distill", config.steps, completed=log.step)
    began = time.perf_counter() - log.seconds
    while log.step < config.steps:
        if config.max_minutes is not None and out_of_time(accelerator, began, config.max_minutes):
            bars.log(f"distill: stopped at step {log.step} by max_minutes: {config.max_minutes}")
            break
        with naming_out_of_memory(f"step {log.step + 1}", device):
            rows = windows.rows(log.step, config.batch_size, config.seed)[rank * per_process : (rank + 1) * per_process]
            totals: dict[str, float] = {}
            micros = rows.split(max(1, per_process // config.grad_accum))
            for i, micro in enumerate(micros):
                ids = windows.train[micro].to(device)
                if cache is not None:
                    target = cache.get(teacher, windows.train, micro, device)
                else:
                    target = teacher_forward(teacher, ids, hidden_layers)
                # launched processes average their gradients once per step, after the last micro-batch
                with nullcontext() if i == len(micros) - 1 else accelerator.no_sync(student):
                    with accelerator.autocast():
                        loss, parts = distillation_loss(student, ids, target, config)
                    accelerator.backward(loss * micro.numel() / per_process)
                for name, value in {"loss": float(loss.detach()), **parts}.items():
                    totals[name] = totals.get(name, 0.0) + value * micro.numel() / per_process
            if world > 1:  # the logged losses are the global batch's, as in one process
                means = accelerator.reduce(torch.tensor(list(totals.values()), device=accelerator.device), "mean")
                totals = dict(zip(totals, means.tolist(), strict=True))
            if config.max_grad_norm:
                accelerator.clip_grad_norm_(student.parameters(), config.max_grad_norm)
            totals["lr"] = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            apply_masks(student)
            # a step leaves GiBs freed (SmolLM2: 2.2-3.9 at 512-1,024 tokens), handed back at 9-21% of its time
            # (bench/distill_memory.py); the draft head's steps leave 50-75 MiB, kept (TRAINING_FREED_HEAP)
            trim_c_heap()
        log.step += 1
        log.tokens += rows.numel() * windows.train.shape[1] * world
        log.seconds = time.perf_counter() - began
        log.losses.append({k: round(v, 6) for k, v in totals.items()})
        advance(f"distill loss {totals['loss']:.4f}, {log.tokens / log.seconds:,.0f} tok/s")
        if config.eval_every and (log.step % config.eval_every == 0 or log.step == config.steps):
            ppl = held_out_perplexity(student, windows.held_out, device)
            log.evals.append({"step": log.step, "ppl": ppl})
        if config.checkpoint_every and log.step % config.checkpoint_every == 0 and log.step < config.steps:
            save_checkpoint(accelerator, log, checkpoint, fingerprint)
    student = accelerator.unwrap_model(student)
    if config.gradient_checkpointing and hasattr(student, "gradient_checkpointing_disable"):
        student.gradient_checkpointing_disable()
    student.eval()
    return log


def out_of_time(accelerator: Any, began: float, max_minutes: float) -> bool:
    """Whether ``max_minutes`` of training have passed, as the main process's clock says (every launched
    process stops at the same step)."""
    late = torch.tensor([float(time.perf_counter() - began > 60 * max_minutes)], device=accelerator.device)
    if accelerator.num_processes > 1:
        late = accelerator.reduce(late * float(accelerator.is_main_process), "sum")
    return bool(late.item())


def save_checkpoint(accelerator: Any, log: TrainingLog, checkpoint: Path, fingerprint: str) -> None:
    """Write the training state beside ``checkpoint`` and rename it into place (a kill never leaves half of one).

    Every launched process takes part: the main one writes the model, optimizer and scheduler, each its
    own random state."""
    main = accelerator.is_main_process
    tmp = checkpoint.with_name(checkpoint.name + ".tmp")
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), safe_serialization=False)
    accelerator.wait_for_everyone()
    if main:
        record = {"fingerprint": fingerprint, "processes": accelerator.num_processes, "log": vars(log)}
        (tmp / "trainer.json").write_text(json.dumps(record))
        old = checkpoint.with_name(checkpoint.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if checkpoint.exists():
            checkpoint.rename(old)
        tmp.rename(checkpoint)
        shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
