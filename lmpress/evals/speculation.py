"""``eval: speculation``: how well the run's EAGLE-3 draft head (``method: draft_head``) drafts for the scored
model, on held-out text (the eval text, never the calibration text it was trained on).

Each prompt (a window of the eval text) is decoded greedily three times by lmpress's runtime on the scored model:
plainly, speculatively with the head drafting ``k`` tokens every round, and speculatively as ``lmpress generate
--draft-head`` does (an adaptive draft length), each round verified in one multi-row target pass. The outputs must
be identical token for token, or part where the plain decode's two candidates tie within the runtime's rounding (a
verifying pass reads several tokens at once, with kernels that sum in another order); anywhere else the eval fails
as a defect. ``accept_length`` is the mean number of tokens a target pass produces (accepted drafts plus its own)
with ``k`` drafts a round, as serving engines report a head's mean acceptance length (a fixed number of
speculative tokens: the adaptive length shortens its rounds where drafts miss, which lowers tokens per pass and
would mix the policy into the head's score); ``draft_speedup`` the plain decode's seconds over the adaptive
speculative one's, both eager on the run's device. The baseline has no head: both metrics are the candidate's
only.

Sample:

    eval:
      speculation: {prompts: 32, prompt_tokens: 64, new_tokens: 64, k: 3}
    gates:
      - accept_length >= 2.5
"""

from __future__ import annotations

import time
from typing import ClassVar

import torch
from pydantic import Field
from torch import nn

from lmpress.errors import LmpressInputError
from lmpress.evals.agreement import TIE_FACTOR, execution_unit, tolerance
from lmpress.registry import EvalConfig, EvalContext, EvalResult, register_eval
from lmpress.runtime.eagle3 import draft_head_of
from lmpress.runtime.generate import generate
from lmpress.runtime.model import Transformer
from lmpress.runtime.speculative import K_MAX, SpeculativeStats, speculative_decode


class SpeculationConfig(EvalConfig):
    # 32: on one SmolLM2 head 8 prompts scored 1.448 tokens per pass, 16 and 32 scored 1.615 and 1.596
    # (bench/accept_by_length.py, docs/methods/draft-heads.md)
    prompts: int = Field(32, ge=1)
    prompt_tokens: int = Field(64, ge=1)
    new_tokens: int = Field(64, ge=2)
    k: int = Field(3, ge=1, le=K_MAX)  # drafts a round for accept_length (3: the draft_head stage's default steps)
    candidate_only: ClassVar[frozenset[str]] = frozenset({"accept_length", "draft_speedup"})

    def metric_names(self) -> list[str]:
        return ["accept_length", "draft_speedup"]


def eval_prompts(ids: torch.Tensor, count: int, length: int) -> list[list[int]]:
    """``count`` windows of ``length`` tokens spread evenly over the token stream ``ids``."""
    if ids.numel() < count * length:
        raise LmpressInputError(
            f"eval.speculation: the eval text has {ids.numel()} tokens, fewer than {count} prompts of {length}"
        )
    stride = ids.numel() // count
    return [ids[i * stride : i * stride + length].tolist() for i in range(count)]


def check_near_tie(runtime: Transformer, prompt: list[int], plain: list[int], drafted: list[int], unit: float) -> None:
    """Plain and speculative greedy outputs may part only where the plain decode's two candidates tie within the
    runtime's rounding (a verifying pass reads several tokens at once, a decode step one: the kernels' sums differ
    in order, and with int8 activations by up to ``unit``); anywhere else the head changed the output: a defect."""
    k = next(i for i, (a, b) in enumerate(zip(plain, drafted, strict=False)) if a != b)
    with torch.no_grad():
        logits = runtime(torch.tensor([prompt + plain[:k]]), runtime.new_cache(1, len(prompt) + k))[0, -1].double()
    gap = float(logits[plain[k]] - logits[drafted[k]])
    if abs(gap) > TIE_FACTOR * tolerance(unit, unit, float(logits.abs().max())):
        raise RuntimeError(
            f"speculative decoding with the draft head changed the greedy output at new token {k} "
            f"(logit gap {gap:.3g}, not a near tie): a defect"
        )


@register_eval("speculation", SpeculationConfig)
def run_speculation(model: nn.Module, tokenizer, config: SpeculationConfig, ctx: EvalContext) -> EvalResult:
    protocol = {
        "prompts": f"{config.prompts} windows of {config.prompt_tokens} tokens spread over the eval text",
        "decoding": f"greedy, {config.new_tokens} new tokens, plain, with the draft head at k = {config.k} "
        "(accept_length) and with it at an adaptive k (draft_speedup), eager",
    }
    head = draft_head_of(model)
    if head is None:
        if ctx.role == "baseline":
            return EvalResult(metrics={}, protocol=protocol)
        raise LmpressInputError("eval.speculation scores a draft head: add a draft_head stage to the recipe")
    runtime = Transformer.from_hf(model, device=ctx.device)
    unit = execution_unit(model, runtime=True)
    fixed, adaptive = SpeculativeStats(), SpeculativeStats()
    plain_seconds = speculative_seconds = 0.0
    ties = 0
    for prompt in ctx.bars.track(eval_prompts(ctx.ids(), config.prompts, config.prompt_tokens), "speculation"):
        began = time.perf_counter()
        plain = generate(runtime, prompt, max_new_tokens=config.new_tokens)[0]
        middle = time.perf_counter()
        drafted = list(
            speculative_decode(runtime, prompt, draft_head=head, max_new_tokens=config.new_tokens, stats=adaptive)
        )
        plain_seconds += middle - began
        speculative_seconds += time.perf_counter() - middle
        at_k = list(
            speculative_decode(
                runtime, prompt, draft_head=head, max_new_tokens=config.new_tokens, k=config.k, adaptive=False,
                stats=fixed,
            )
        )  # fmt: skip
        for output in {tuple(drafted), tuple(at_k)} - {tuple(plain)}:
            check_near_tie(runtime, prompt, plain, list(output), unit)
        ties += drafted != plain or at_k != plain
    metrics = {"accept_length": fixed.tokens_per_step, "draft_speedup": plain_seconds / speculative_seconds}
    details = {
        "speculation": {
            "outputs_identical": config.prompts - ties,
            "outputs_parting_at_a_near_tie": ties,
            "k": config.k,
            "drafted": fixed.drafted,
            "accepted": fixed.accepted,
            "target_passes": fixed.target_steps,
            "adaptive_tokens_per_pass": adaptive.tokens_per_step,
            "plain_seconds": plain_seconds,
            "speculative_seconds": speculative_seconds,
        }
    }
    return EvalResult(metrics=metrics, details=details, protocol=protocol)
