"""Where lmpress computes: the one place that turns a device choice into a device, moves modules there
and back, gives the device's memory back, names an out-of-memory failure by what was running, and (for
tests and the GPU check) guards that every forward runs where it should.

The model rests in CPU memory between stages; a stage takes what it computes with (a decoder layer, the
whole model, the teacher) to the compute device, and returns it when it ends (:func:`on_device`). Commands
(``lmpress run``'s ``model.device``, ``generate``/``bench``/``eval --device``) resolve their choice here
(:func:`resolve_device`): ``cuda`` where torch has no CUDA is an input error before any work.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from lmpress.errors import LmpressInputError
from lmpress.memory import return_freed_memory

DEVICE_CHOICES = ("cpu", "cuda", "auto")
CPU = torch.device("cpu")


def resolve_device(choice: str | None, where: str) -> torch.device:
    """The device ``choice`` (cpu | cuda | auto; None is auto) names, where ``where`` is the setting's name
    in messages (``model.device``, ``--device``). ``cuda`` without a CUDA GPU is an input error naming the
    fix; a CUDA device carries its index (the current device) so that every tensor placed on it compares
    equal to it."""
    choice = "auto" if choice is None else choice
    if choice not in DEVICE_CHOICES:
        raise LmpressInputError(f"{where}: {choice!r} is not one of {', '.join(DEVICE_CHOICES)}")
    if choice == "cuda" and not torch.cuda.is_available():
        fix = f"use {where} cpu" if where.startswith("--") else f"set {where}: cpu (or auto)"
        raise LmpressInputError(
            f"{where}: cuda, but no CUDA GPU is available here (torch.cuda.is_available() is False); {fix}"
        )
    if choice == "cpu" or not torch.cuda.is_available():
        return CPU
    return torch.device("cuda", torch.cuda.current_device())


def gpu_capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA compute capability of ``device`` (None off CUDA)."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def require_capability(device: torch.device, minimum: tuple[int, int], what: str) -> None:
    """Refuse (input error) to run ``what`` on a CUDA ``device`` older than compute capability ``minimum``."""
    have = gpu_capability(device)
    if have is not None and tuple(have) < minimum:
        name = torch.cuda.get_device_name(device)
        raise LmpressInputError(
            f"{what} needs a GPU of compute capability {minimum[0]}.{minimum[1]} or newer; {name} is "
            f"{have[0]}.{have[1]}: run it with --device cpu, or export another format"
        )


def release_memory(device: torch.device) -> None:
    """Give what the caching allocator of ``device`` holds and no tensor uses back to the device, and the host's
    freed heap back to the OS: a stage's transient buffers below glibc's mmap threshold (which rises to 32 MiB)
    stay resident behind anything allocated after them (tests/test_placement.py)."""
    return_freed_memory()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def module_device(module: nn.Module) -> torch.device:
    """The device of ``module``'s first parameter or buffer (the CPU for a module with neither)."""
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return CPU


@contextmanager
def on_device(device: torch.device, *modules: nn.Module) -> Iterator[None]:
    """``modules`` on ``device`` inside; back on the CPU after (also when it raises), the device's memory
    given back."""
    try:
        for module in modules:
            module.to(device)
        yield
    finally:
        for module in modules:
            module.to(CPU)
        if device != CPU:
            release_memory(device)


class OutOfDeviceMemory(LmpressInputError):
    """The compute device ran out of memory; the message names what was running (stage, layer, step)."""


@contextmanager
def naming_out_of_memory(what: str, device: torch.device, advice: str = "") -> Iterator[None]:
    """An out-of-memory error inside becomes one line naming ``what`` (nested: outer first, "stage 1 (gptq),
    layer 3"), then ``advice`` (said by the outermost)."""
    try:
        yield
    except OutOfDeviceMemory as e:
        inner = str(e)
        raise OutOfDeviceMemory(f"{what}, {inner}" if advice == "" else f"{what}, {inner}; {advice}") from e
    except torch.OutOfMemoryError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else "out of memory"
        release_memory(device)
        message = f"{what}: out of memory on {device} ({first})"
        raise OutOfDeviceMemory(message if advice == "" else f"{message}; {advice}") from e


class MisplacedTensor(AssertionError):
    """A forward ran with an input, parameter or buffer off the compute device (placement_guard)."""


def _misplaced(module: nn.Module, inputs: tuple, device: torch.device) -> str | None:
    for name, tensor in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)):
        if tensor.device != device:
            return f"{type(module).__name__}'s {name} is on {tensor.device}"
    for i, value in enumerate(inputs):
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.device != device:
            return f"{type(module).__name__}'s input {i} is on {value.device}"
    return None


@contextmanager
def placement_guard(device: torch.device) -> Iterator[None]:
    """Inside, every module's forward asserts that its own parameters and buffers and its positional tensor
    inputs lie on ``device`` (else :class:`MisplacedTensor`): a stage that computes anything on the wrong
    device fails loudly, on a GPU and under the CPU's placement test device alike."""
    if isinstance(device, str):
        device = torch.device(device)

    def check(module: nn.Module, inputs: tuple) -> None:
        problem = _misplaced(module, inputs, device)
        if problem is not None:
            raise MisplacedTensor(f"placement: computing on {device}, but {problem}")

    handle = nn.modules.module.register_module_forward_pre_hook(check)
    try:
        yield
    finally:
        handle.remove()
