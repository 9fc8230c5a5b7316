"""A second device on a CPU-only machine, for placement tests: tensors "on" it report ``device == meta`` but
carry real CPU data, so every stage computes real numbers while torch refuses, as CUDA does, an operation that
mixes them with tensors left on the CPU.

Inside :func:`fake_accelerator`, ``x.to("meta")``, ``module.to("meta")`` and factories given
``device="meta"`` make such tensors; operations on them compute on the CPU data and give such tensors back;
``.to("cpu")`` hands the CPU data back. An operation whose tensor arguments lie partly on the fake device and
partly on the CPU raises torch's own "Expected all tensors to be on the same device" error, with the same
exceptions CUDA makes: 0-dimensional CPU tensors (scalars) and CPU index tensors into a device tensor.
``.numpy()`` of a device tensor is refused, as on CUDA.

Why ``meta`` and not ``cuda``: a CPU-only build of torch aborts when autograd meets a tensor that reports
``cuda``; ``meta`` has a device guard, so training runs too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

FAKE = torch.device("meta")
aten = torch.ops.aten

# operations that move data between devices (a mix of devices is their point)
_MOVES = {aten._to_copy.default, aten.copy_.default, aten.to.device, aten.to.dtype_layout, aten._copy_from.default}
# CUDA takes CPU indices into a device tensor (it moves them), not the other way round
_INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}


class OnFakeDevice(torch.Tensor):
    """A tensor that says it lies on :data:`FAKE` and holds its numbers in ``inner`` (a CPU tensor)."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> OnFakeDevice:
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls,
            inner.shape,
            strides=inner.stride(),
            storage_offset=inner.storage_offset(),
            dtype=inner.dtype,
            layout=inner.layout,
            device=FAKE,
            requires_grad=inner.requires_grad,
        )
        wrapper.inner = inner
        return wrapper

    def __repr__(self) -> str:
        return f"OnFakeDevice({self.inner!r})"

    @property
    def data(self) -> OnFakeDevice:
        return OnFakeDevice(self.inner.detach())

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        if not isinstance(new, OnFakeDevice):
            raise RuntimeError(
                f"placement test device: .data of a tensor on {FAKE} set to a tensor on {new.device} "
                "(on CUDA this silently moves the parameter off the compute device)"
            )
        torch.Tensor.data.__set__(self, new)
        self.inner = new.inner

    def data_ptr(self) -> int:
        return self.inner.data_ptr()

    def tolist(self):  # CUDA tensors copy their numbers to the host for this
        return self.inner.tolist()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


def _is_fake(device) -> bool:
    return device is not None and torch.device(device).type == FAKE.type


def _dispatch(func, args, kwargs):
    on_device, on_cpu = [], []

    def unwrap(t):
        if isinstance(t, OnFakeDevice):
            on_device.append(t)
            return t.inner
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            on_cpu.append(t)
        return t

    plain_args, plain_kwargs = tree_map(unwrap, args), tree_map(unwrap, kwargs)
    to_device = _is_fake(plain_kwargs.get("device"))
    if to_device:
        plain_kwargs["device"] = torch.device("cpu")
    if on_device and on_cpu and func not in _MOVES:
        indices_only = func in _INDEXING and isinstance(args[0], OnFakeDevice)
        if not indices_only:
            raise RuntimeError(
                "Expected all tensors to be on the same device, but found at least two devices, "
                f"{FAKE} and cpu! (in {func}; lmpress's placement test device)"
            )
    out = func(*plain_args, **plain_kwargs)
    if func is aten._to_copy.default or func is aten._copy_from.default:
        wrap = to_device or ("device" not in kwargs and isinstance(args[0], OnFakeDevice))
    elif func._schema.is_mutable:  # in place (or into out=): the numbers changed in the CPU data
        return kwargs["out"] if "out" in kwargs else args[0]
    else:
        wrap = bool(on_device) or to_device
    if not wrap:
        return out
    return tree_map(lambda t: OnFakeDevice(t) if type(t) is torch.Tensor else t, out)


class _FakeDeviceMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


_tensor_factory = torch.tensor


def _tensor(data, *args, device=None, **kwargs):
    # torch.tensor copies to its device below the dispatcher: make it on the CPU and move it through it
    t = _tensor_factory(data, *args, **kwargs)
    return t if device is None else t.to(device)


_inference_mode = torch.inference_mode.__enter__, torch.inference_mode.__exit__


def _no_grad_enter(self) -> None:
    self._grad_before = torch.is_grad_enabled()
    torch.set_grad_enabled(not self.mode and self._grad_before)


def _no_grad_exit(self, *exc) -> None:
    torch.set_grad_enabled(self._grad_before)


@contextmanager
def fake_accelerator() -> Iterator[torch.device]:
    """Inside: :data:`FAKE` is a working device with its own placement rules (the module docstring).

    Inference mode runs as no_grad inside: torch cannot make inference tensors of a tensor subclass's views."""
    torch.tensor = _tensor
    torch.inference_mode.__enter__, torch.inference_mode.__exit__ = _no_grad_enter, _no_grad_exit
    try:
        with _FakeDeviceMode():
            yield FAKE
    finally:
        torch.tensor = _tensor_factory
        torch.inference_mode.__enter__, torch.inference_mode.__exit__ = _inference_mode


def fake_device_self_test() -> None:
    """The rules this module promises, checked (tests/test_placement.py calls it)."""
    with fake_accelerator() as device:
        x = torch.arange(6.0).reshape(2, 3)
        y = x.to(device)
        assert y.device == device and torch.equal((y * 2).to("cpu"), x * 2)
        try:
            x + y
        except RuntimeError as e:
            assert "same device" in str(e)
        else:
            raise AssertionError("a CPU tensor and a device tensor were added")
        assert (y + torch.tensor(1.0)).device == device  # a CPU scalar is allowed, as on CUDA
