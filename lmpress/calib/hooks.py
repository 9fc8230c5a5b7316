"""The forward hooks and stand-ins the calibration engine's passes use.

Stop a batch once the needed inputs are seen (:class:`StopForward`), record a
block's output or a linear's input per batch, replay them in later passes, stand
a linear or the attention kernel in by zeros when its result is never read, and
shortcut a block to its output linear.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lmpress.calib.activations import BatchStore, map_tensors
from lmpress.errors import LmpressInputError


class StopForward(Exception):
    """Raised from a hook to leave a forward pass once the needed inputs are seen."""


def check_finite(x: torch.Tensor, where: str) -> None:
    # One reduction decides the common case; a non-finite sum may still be an overflow of finite values.
    if torch.isfinite(x.sum(dtype=torch.float32)) or torch.isfinite(x).all():
        return
    bad = "NaN" if torch.isnan(x).any() else "inf"
    raise LmpressInputError(
        f"{bad} in the calibration activations at {where}: the model's float weights or the "
        "calibration text produce non-finite values there (check the checkpoint and dtype; float16 "
        "models overflow more easily than bfloat16/float32)"
    )


def first_input(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def move_to(obj: Any, device: torch.device) -> Any:
    return map_tensors(obj, lambda t: t.to(device))


def has_submodule(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


class SharedInput:
    """Watches the watched modules' inputs in a calibration pass's first batch: ``same`` while every
    one of them has read the very tensor the first one read, unmodified (its version unchanged) and
    as its only argument."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.seen = 0
        self.same = expected > 1
        self.proven = False
        self._first: tuple[torch.Tensor, int] | None = None

    def observe(self, x: torch.Tensor, args: tuple, kwargs: dict) -> None:
        self.seen += 1
        alone = len(args) + len(kwargs) == 1
        if self._first is None:
            self._first = (x, x._version)
            self.same = self.same and alone
        else:
            first, version = self._first
            self.same = self.same and alone and x is first and x._version == version

    def complete(self) -> bool:
        """Whether the first batch showed it: every watched module seen once, all reading that tensor."""
        self._first = None
        return self.same and self.seen == self.expected


_IGNORED = torch.empty(0)


def shortcut_to_output(block: nn.Module, linear: nn.Module, replace_forward: Callable) -> list:
    """Hooks that watch ``block``'s first call: when it returns ``linear``'s output itself (alone, or
    first in a tuple of Nones), the block's forward is replaced by a call of ``linear``, whose
    pre-hook feeds it its recorded input; everything else the block computes is discarded anyway."""
    last = {}

    def remember(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        last["output"] = output

    def check(module: nn.Module, args: tuple, output: Any) -> None:
        produced = last.pop("output", None)
        for handle in handles:
            handle.remove()
        if produced is None:
            return
        if output is produced:
            replace_forward(block, lambda *args, **kwargs: linear(_IGNORED))
        elif isinstance(output, tuple) and output and output[0] is produced and all(o is None for o in output[1:]):
            rest = output[1:]
            replace_forward(block, lambda *args, **kwargs: (linear(_IGNORED), *rest))

    handles = [linear.register_forward_hook(remember), block.register_forward_hook(check)]
    return handles


DISCARDED_ATTENTION = "lmpress_discarded"


def zeros_attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
) -> tuple[torch.Tensor, None]:
    """An attention kernel whose result is never read: zeros in the (batch, q_len, heads, head_dim) layout."""
    batch, heads, q_len, _ = query.shape
    return query.new_zeros(batch, q_len, heads, value.shape[-1]), None


@contextmanager
def attention_discarded(attention: nn.Module) -> Iterator[None]:
    """Run ``attention`` (a transformers attention module) with :func:`zeros_attention` as its kernel."""
    config = getattr(attention, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        yield
        return
    from transformers import AttentionInterface

    AttentionInterface.register(DISCARDED_ATTENTION, zeros_attention)
    before = config._attn_implementation
    config._attn_implementation = DISCARDED_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before


def zeros_like_output(linear: nn.Module) -> Callable:
    """A forward returning zeros of ``linear``'s output shape (a module without ``out_features``, a MoE experts
    block: its input's)."""
    width = getattr(linear, "out_features", None)

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return x.new_zeros(*x.shape[:-1], width or x.shape[-1])

    return forward


def recorder(store: BatchStore, current: list[int]) -> Callable:
    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        store[current[0]] = output

    return hook


def input_recorder(store: BatchStore, current: list[int]) -> Callable:
    def hook(module: nn.Module, args: tuple) -> None:
        store[current[0]] = args[0]

    return hook


def input_from(store: BatchStore, current: list[int], device: torch.device, dtype: torch.dtype) -> Callable:
    def hook(module: nn.Module, args: tuple) -> tuple:
        return (store[current[0]].to(device, dtype), *args[1:])

    return hook


def replay_from(store: BatchStore, current: list[int], device: torch.device, dtype: torch.dtype) -> Callable:
    def forward(*args: Any, **kwargs: Any) -> Any:
        return map_tensors(store[current[0]], lambda t: t.to(device, dtype) if t.is_floating_point() else t.to(device))

    return forward


def set_submodule(module: nn.Module, name: str, child: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(module.get_submodule(parent_name) if parent_name else module, attr, child)
