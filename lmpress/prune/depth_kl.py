"""Which decoder layers to remove, by what their removal does to the model's next-token distribution.

The angular criterion (``structured.py``) ranks each layer once, by how little it changes its
own input; layers that look idle one at a time can matter together. This criterion is the
perplexity criterion of Kim et al. 2024 ("Shortened LLaMA", §3.2: remove the block whose
removal costs the least perplexity on calibration text), with the KL divergence from the unpruned model's
distribution in place of perplexity, and re-scored after every removal (greedy, one layer at
a time): removing ``n`` of ``L`` layers takes about ``n·L`` forward passes over the
calibration samples, so it is meant for small models (drafts, students).

A candidate's pass starts where the layer sits: the hidden state that enters it is recorded
once per round and fed to the layer after it, so the layers before it do not run again.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lmpress.anatomy import decoder_layers, get_anatomy
from lmpress.calib.hooks import check_finite, first_input
from lmpress.metrics import exact_kld
from lmpress.progress import QUIET, Bars


def _replace_input(hidden: torch.Tensor) -> Callable:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    return hook


def _record_inputs(store: list[torch.Tensor]) -> Callable:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        store.append(first_input(args, kwargs).detach())

    return hook


@torch.no_grad()
def greedy_kl_layer_drop(
    model: nn.Module, samples: torch.Tensor, n_remove: int, bars: Bars = QUIET
) -> tuple[list[int], list[float]]:
    """The ``n_remove`` decoder layers to remove (original indices, sorted) and the KL after each removal.

    ``samples``: ``(n, seq_len)`` token ids on the model's device. The model is left as it was.
    """
    layers = decoder_layers(model)
    original = list(layers)
    final_norm = model.get_submodule(get_anatomy(model).final_norm)
    rows = [row[None] for row in samples]
    reference = [model(ids, use_cache=False).logits.float().log_softmax(-1) for ids in rows]
    for i, ref in enumerate(reference):
        check_finite(ref, f"the model's log-probabilities on calibration sample {i}")
    kept = list(range(len(original)))
    trace: list[float] = []
    candidates = sum(len(original) - r for r in range(n_remove))
    advance = bars.counter("layers by KL", total=candidates)
    try:
        for _ in range(n_remove):
            entering = _inputs_of_each_layer(model, layers, [original[i] for i in kept], rows)
            scores = []
            for position in range(len(kept)):
                after = [original[i] for i in kept[position + 1 :]]
                scores.append(_score_without(model, layers, after, final_norm, rows, entering[position], reference))
                advance(f"layers by KL: {len(trace)}/{n_remove} removed")
            best = min(range(len(kept)), key=scores.__getitem__)
            trace.append(scores[best])
            kept.pop(best)
    finally:
        layers.__init__(original)
    return sorted(set(range(len(original))) - set(kept)), trace


def _inputs_of_each_layer(
    model: nn.Module, layers: nn.ModuleList, current: list[nn.Module], rows: list
) -> list[list[torch.Tensor]]:
    """entering[p][s]: the hidden state entering the current model's layer ``p`` on sample ``s``."""
    layers.__init__(current)
    stores: list[list[torch.Tensor]] = [[] for _ in current]
    handles = [
        m.register_forward_pre_hook(_record_inputs(s), with_kwargs=True) for m, s in zip(current, stores, strict=True)
    ]
    try:
        for ids in rows:
            model(ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return stores


def _score_without(
    model: nn.Module,
    layers: nn.ModuleList,
    after: list[nn.Module],
    final_norm: nn.Module,
    rows: list,
    entering: list[torch.Tensor],
    reference: list[torch.Tensor],
) -> float:
    """KL of the model whose layers are ``after`` alone, fed what entered the removed layer."""
    layers.__init__(after)
    first = after[0] if after else final_norm
    total = 0.0
    for ids, hidden, ref in zip(rows, entering, reference, strict=True):
        handle = first.register_forward_pre_hook(_replace_input(hidden), with_kwargs=True)
        try:
            total += float(exact_kld(ref, model(ids, use_cache=False).logits.float().log_softmax(-1)).mean())
        finally:
            handle.remove()
    return total / len(rows)
