"""What a run will need in memory, forecast from the model's config and the recipe before any weight is read.

The forecast is the sum of what stays resident for the whole run and the largest working set of one phase:

- ``process``: Python, torch, transformers and lmpress, and the allocator's arenas (measured, a constant);
- ``weights``: the float model. A safetensors checkpoint read in the dtype it is stored in is memory-mapped:
  a run that only streams layers (one-shot stages, no eval, no training) keeps about one decoder layer of it
  resident at a time (the engine drops a finished layer's pages); anything that reads the whole model (an eval,
  a training stage) or converts its dtype holds all of it;
- ``quantized``: the packed codes, scales and zero points of every linear a quantization stage replaces;
- the largest phase: ``calibration`` (the engine's float16 activation slab of samples x seq_len x hidden, one
  forward's float32 temporaries, and the largest linear's statistics and GPTQ/SparseGPT working copies: its
  Hessian, the damped inverse's factor and float32 copies of the weight), ``eval`` (a perplexity batch's logits
  in float32, their log-softmax and the gathered rows), or ``training`` (student weights, gradients and the
  optimizer's two moments in float32, plus a teacher in the run's dtype).

On a CUDA device the one-shot engine keeps one layer, its statistics and one batch's activations there; the
slab stays in RAM. The figures are checked against measured peaks by ``bench/scale.py`` (docs/scale.md).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from lmpress.errors import LmpressInputError
from lmpress.model import decoder_layers, layer_linears

GIB = 1 << 30
# Measured: RSS after importing torch, transformers and lmpress and running a first forward (oneDNN/MKL buffers,
# the allocator's arenas), on 2.13.0+cpu.
PROCESS_BYTES = 330 << 20
# One forward of a decoder layer holds about this many float32 tensors of (batch, seq_len, intermediate) alive
# (gate, up, their product, the activation) beside the attention's.
FORWARD_TENSORS = 4
# Perplexity: the logits in float32, their log-softmax and the gathered copy.
LOGIT_COPIES = 3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class MemoryForecast:
    """Bytes by part; ``ram_bytes`` / ``device_bytes`` are what the run's peak is forecast to be."""

    parts: dict[str, int] = field(default_factory=dict)
    device_parts: dict[str, int] = field(default_factory=dict)
    phase: str = ""  # the phase whose working set is counted (the largest)

    @property
    def ram_bytes(self) -> int:
        return sum(self.parts.values())

    @property
    def device_bytes(self) -> int:
        return sum(self.device_parts.values())

    def describe(self) -> str:
        parts = ", ".join(f"{name} {size / GIB:.2f}" for name, size in self.parts.items() if size)
        line = f"memory forecast: {self.ram_bytes / GIB:.2f} GiB RAM at peak ({parts} GiB; largest phase: {self.phase})"
        if self.device_parts:
            line += f", {self.device_bytes / GIB:.2f} GiB on the GPU"
        return line


@dataclass(frozen=True)
class ModelShape:
    """The sizes the forecast needs, read off a model built on the meta device."""

    parameters: int  # every parameter, embeddings included
    layer_parameters: int  # the largest decoder layer's
    hidden: int
    vocab: int
    linears: tuple[tuple[str, int, int], ...]  # (full name, out_features, in_features) of every decoder linear

    @classmethod
    def of(cls, model: nn.Module) -> ModelShape:
        layers = decoder_layers(model)
        linears = []
        for index, layer in enumerate(layers):
            for name, linear in layer_linears(layer).items():
                linears.append((f"{index}.{name}", linear.out_features, linear.in_features))
        config = model.config
        return cls(
            parameters=sum(p.numel() for p in model.parameters()),
            layer_parameters=max(sum(p.numel() for p in layer.parameters()) for layer in layers),
            hidden=config.hidden_size,
            vocab=config.vocab_size,
            linears=tuple(linears),
        )

    @property
    def widest_input(self) -> int:
        return max(i for _, _, i in self.linears)

    @property
    def widest_output(self) -> int:
        return max(o for _, o, _ in self.linears)


def stored_dtype(checkpoint: Path) -> str | None:
    """The dtype the checkpoint's safetensors files hold (from its config), or None when they are not safetensors."""
    if not any(checkpoint.glob("*.safetensors")):
        return None
    config = json.loads((checkpoint / "config.json").read_text())
    return str(config.get("dtype") or config.get("torch_dtype") or "float32")


def packed_bytes(rows: int, cols: int, bits: int, group_size: int, symmetric: bool) -> int:
    """Codes (``bits`` per weight) plus a float16 scale (and zero point) per group."""
    groups = rows * (1 if group_size <= 0 else -(-cols // group_size))
    return rows * cols * bits // 8 + groups * 2 * (1 if symmetric else 2)


def calibration_bytes(shape: ModelShape, samples: int, seq_len: int, batch_size: int) -> int:
    """The one-shot engine's peak beyond weights: slab, one forward's temporaries, the largest linear's work."""
    slab = samples * seq_len * shape.hidden * 2
    batch_tokens = min(batch_size, samples) * seq_len
    forward = FORWARD_TENSORS * batch_tokens * shape.widest_output * 4
    # GPTQ / SparseGPT on one linear: the accumulated Hessian, its working copy and the inverse's factor
    # (3 x cols^2), and float32 copies of the weight, its transpose and the codes being written (3 x rows x cols).
    solve = max(3 * cols * cols * 4 + 3 * rows * cols * 4 for _, rows, cols in shape.linears)
    return slab + max(forward, solve)


def forecast_memory(
    model: nn.Module,
    checkpoint: Path,
    dtype: str,
    stages: Sequence,
    samples: int,
    seq_len: int,
    device: torch.device,
    eval_tokens: int = 0,
) -> MemoryForecast:
    """The run's peak memory: ``model`` is the checkpoint's skeleton on the meta device (``model_skeleton``),
    ``stages`` the recipe's stage configs, ``eval_tokens`` the tokens of the largest eval batch (0: no eval)."""
    shape = ModelShape.of(model)
    size = DTYPE_BYTES[dtype]
    training = any(getattr(s, "trains_across_processes", False) for s in stages)
    streams = stored_dtype(checkpoint) == dtype and not eval_tokens and not training
    forecast = MemoryForecast()
    forecast.parts["process"] = PROCESS_BYTES
    forecast.parts["weights"] = (2 * shape.layer_parameters if streams else shape.parameters) * size
    quantizers = [s for s in stages if hasattr(s, "scheme_for")]
    quantized = 0
    for _, rows, cols in shape.linears:
        bits = max((s.bits for s in quantizers), default=0)
        if bits:
            group = min(s.group_size for s in quantizers)
            quantized += packed_bytes(rows, cols, bits, group, all(s.symmetric for s in quantizers))
    forecast.parts["quantized"] = quantized
    if streams and quantized:  # a streamed layer's float weights give way to its codes
        forecast.parts["weights"] = 2 * shape.layer_parameters * size
    phases = {
        "calibration": max(
            (
                calibration_bytes(shape, samples, seq_len, getattr(s, "batch_size", 4))
                for s in stages
                if getattr(s, "calibrates_layerwise", False)
            ),
            default=0,
        ),
        "eval": LOGIT_COPIES * eval_tokens * shape.vocab * 4,
        "training": (4 * 4 + size) * shape.parameters if training else 0,
    }
    forecast.phase = max(phases, key=phases.get)
    forecast.parts[forecast.phase] = phases[forecast.phase]
    if device.type == "cuda":
        layer = 4 * shape.layer_parameters
        forecast.device_parts = {"layer": layer, "work": phases["calibration"] or phases["eval"] or phases["training"]}
    return forecast


def check_fits(forecast: MemoryForecast, available_ram: int, available_device: int | None = None) -> None:
    """Refuse a run whose forecast peak exceeds what the machine has (one line, exit 2)."""
    if forecast.ram_bytes > available_ram:
        raise LmpressInputError(
            f"this run needs about {forecast.ram_bytes / GIB:.1f} GiB of RAM and {available_ram / GIB:.1f} GiB "
            f"is available ({forecast.describe().split(': ', 1)[1]}): use a machine with more memory, fewer "
            "calibration samples or a shorter seq_len"
        )
    if available_device is not None and forecast.device_bytes > available_device:
        raise LmpressInputError(
            f"this run needs about {forecast.device_bytes / GIB:.1f} GiB of GPU memory and "
            f"{available_device / GIB:.1f} GiB is free: use model.device: cpu or a larger GPU"
        )
