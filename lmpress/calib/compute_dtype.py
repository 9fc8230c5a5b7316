"""The dtype a decoder layer computes in while it is calibrated on a CPU.

A 16-bit checkpoint is loaded in its own dtype (half the memory of float32), but a CPU without 16-bit matrix
instructions (no AVX-512 BF16 / FP16, no AMX: every AVX2-only host, AMD's Zen 2 and Zen 3 among them) multiplies
bfloat16 matrices on PyTorch's fallback path: 20 GFLOPS against 163 in float32 for a 2048 x 4096 by 4096 x 14336
product on a 2-vCPU AMD EPYC (AVX2), 8x slower. There each layer computes in float32 while the engine holds it
(one layer at a time, so its float32 copy is the only memory added) and goes back to its dtype when it is done.
The quantizers compute in float32 either way (``compute_qparams``, GPTQ's solve); what changes is that the
layer's activations are no longer rounded to 16 bits between its operations.

The evals do the same on such a CPU (:func:`layers_in_float32`): each decoder layer and the output layer are
widened to float32 around their forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from lmpress.calib.pages import drop_file_pages

SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def has_16bit_matmul(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies ``dtype`` matrices through oneDNN (AVX-512 or AMX) rather than the slow path."""
    check = "_is_mkldnn_bf16_supported" if dtype == torch.bfloat16 else "_is_mkldnn_fp16_supported"
    try:
        return bool(getattr(torch.ops.mkldnn, check)())
    except (AttributeError, RuntimeError):  # a build without oneDNN: nothing better to switch to
        return True


def calibration_compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """float32 for a 16-bit model calibrated on a CPU without that dtype's matrix instructions, else ``dtype``."""
    if device.type == "cpu" and dtype in SIXTEEN_BIT and not has_16bit_matmul(dtype):
        return torch.float32
    return dtype


def widens_to_float32(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a ``dtype`` model on ``device`` computes in float32 (:func:`calibration_compute_dtype`)."""
    return calibration_compute_dtype(dtype, device) != dtype


def upcast_layer(layer: nn.Module, dtype: torch.dtype, drop_pages: bool = True) -> dict[str, torch.Tensor]:
    """Turn ``layer``'s ``dtype`` tensors (parameters and buffers) float32 in place; returns the originals by
    name, for :func:`restore_layer_dtype`. With ``drop_pages``, an original in a memory-mapped checkpoint gives its
    resident pages back meanwhile (read again from the page cache if it is restored)."""
    originals = {}
    for name, tensor in [*layer.named_parameters(), *layer.named_buffers()]:
        if tensor.dtype == dtype:
            originals[name] = tensor.data
            tensor.data = tensor.data.float()
            if drop_pages:
                drop_file_pages(originals[name])
    return originals


def model_dtype(model: nn.Module) -> tuple[torch.dtype, torch.device]:
    """The dtype of ``model``'s first floating-point parameter (float32 if none) and that parameter's device."""
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    return (torch.float32, torch.device("cpu")) if param is None else (param.dtype, param.device)


def widened_head(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """An output layer's weight or bias as :func:`layers_in_float32` computes with it: float32 where it widens that
    dtype on that device, else as it is."""
    if tensor is None or not widens_to_float32(tensor.dtype, tensor.device):
        return tensor
    return tensor.float()


@contextmanager
def layers_in_float32(model: nn.Module) -> Iterator[bool]:
    """While the block runs, a 16-bit model on a CPU without that dtype's matrix unit (``calibration_compute_dtype``)
    computes in float32: the embeddings' output is widened, and each decoder layer's and the output layer's 16-bit
    tensors are float32 copies during that module's forward only (one module's copy at a time; the originals are
    put back after it). KLD recomputes the logits so (``widened_head``). Yields whether it does; elsewhere (a GPU, a
    CPU with AVX-512 BF16 or AMX, a float32 model, a family without an anatomy in ``lmpress.anatomy``) it changes
    nothing."""
    from lmpress.anatomy import decoder_layers
    from lmpress.errors import LmpressInputError

    dtype, device = model_dtype(model)
    try:
        layers = decoder_layers(model) if widens_to_float32(dtype, device) else None
    except LmpressInputError:  # a family without an anatomy: it computes as it is
        layers = None
    if layers is None:
        yield False
        return
    held: dict[nn.Module, dict[str, torch.Tensor]] = {}

    def widen(layer: nn.Module, args: tuple) -> None:
        held[layer] = upcast_layer(layer, dtype, drop_pages=False)

    def put_back(layer: nn.Module, args: tuple, output: object) -> None:
        current = dict(layer.named_parameters()) | dict(layer.named_buffers())
        for name, original in held.pop(layer).items():
            current[name].data = original

    hooks = [model.get_input_embeddings().register_forward_hook(lambda m, args, out: out.float())]
    head = model.get_output_embeddings()
    for module in [*layers, *([head] if head is not None else [])]:
        hooks += [module.register_forward_pre_hook(widen), module.register_forward_hook(put_back)]
    try:
        yield True
    finally:
        for hook in hooks:
            hook.remove()
        for layer in list(held):  # a forward that raised inside a layer
            put_back(layer, (), None)


def restore_layer_dtype(layer: nn.Module, originals: dict[str, torch.Tensor], biases: dict[str, torch.Tensor]) -> None:
    """Put ``layer``'s tensors back in their dtype after :func:`upcast_layer`: an unchanged tensor gets its original
    storage back (a memory-mapped checkpoint's pages stay file pages), a changed one is rounded to the dtype (its
    original may be a file page dropped since, holding the checkpoint's value, so the comparison decides), and a
    tensor whose module was replaced (a quantized linear's float weight) is left to go. ``biases`` (the session's
    saved biases of quantized linears, by linear name) are rounded alike."""
    current = dict(layer.named_parameters()) | dict(layer.named_buffers())
    for name, original in originals.items():
        tensor = current.get(name)
        if tensor is None or tensor.dtype != torch.float32:  # replaced, or a replacement's own kind (FP8)
            continue
        back = tensor.data.to(original.dtype)
        tensor.data = original if torch.equal(back, original) else back
    for linear, bias in biases.items():
        original = originals.get(f"{linear}.bias")
        if original is not None:
            biases[linear] = bias.to(original.dtype)
