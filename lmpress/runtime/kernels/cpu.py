"""CPU matmuls for quantized weights: torch's packed int4/int8 kernels, weights repacked once at load.

``_weight_int4pack_mm_for_cpu`` and ``_weight_int8pack_mm`` are vectorized for
bfloat16 activations only (see ``QuantizedLinear``'s docstring for the measurements),
so these modules cast their input to bfloat16 and their output back. Unlike
``QuantizedLinear`` they run the kernel for every batch size (prefill included) and
keep only the repacked weight, not the original packed codes. Float weights run in
``DenseLinear``.
"""

from __future__ import annotations

import functools
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from lmpress.errors import LmpressInputError
from lmpress.runtime.kernels import cpu_int
from lmpress.runtime.kernels.cpu_half import HalfWeightLinear
from lmpress.runtime.kernels.cpu_int import DEFAULT_CPU_ACTIVATIONS, W4A8Linear, W8A8RowLinear, finish_output
from lmpress.runtime.kernels.cpu_probe import choose_int8_kernel, cpu_model
from lmpress.runtime.kernels.dense import Int8ActivationsLinear, dense_linear, linear_over
from lmpress.runtime.kernels.tuning import default_cache, tune_key
from lmpress.weights.qlinear import QuantizedLinear


class DenseLinear(nn.Linear):
    """A float32 linear layer that, for up to ``FEW_ROWS`` input rows, computes ``(W @ x.T).T`` where that is faster.

    Which of ``x @ W.T`` (``F.linear``) and ``(W @ x.T).T`` (one row doubled into two) is faster
    depends on the CPU, its BLAS and the weight's shape. So each weight shape is timed once per
    process, for one row (decode) and for four (speculative verification), streaming copies of a
    weight of that shape from memory (``weight_left_is_faster``); the weight goes left only where
    it wins by 10% or more. SmolLM2's FP32 forward on a 2-core AMD EPYC (``bench/dense_matmul.py``):
    one token 37.8 ms with ``F.linear`` everywhere, 21.4 ms as probed; three tokens 82.7 vs 25.0 ms.
    Other dtypes, devices and row counts run ``F.linear``.
    """

    FEW_ROWS = 16

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__(in_features, out_features, bias=bias, dtype=dtype, device=device)
        float32 = self.weight.dtype == torch.float32
        self.left_for_one, self.left_for_few = (
            weight_left_is_faster(out_features, in_features, torch.get_num_threads()) if float32 else (False, False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        rows = flat.shape[0]
        left = self.left_for_one if rows == 1 else self.left_for_few and rows <= self.FEW_ROWS
        if not left or x.device.type != "cpu" or self.weight.dtype != torch.float32:
            return F.linear(x, self.weight, self.bias)
        # Row-major rows, so that flat.t() is a transposed view: BLAS multiplies W by a contiguous (in, rows)
        # matrix 2-4x slower (bench/dense_matmul.py), and a previous DenseLinear's output is exactly such a view.
        # One row is doubled into two and three padded to four: BLAS is slower over 3 columns than over 4
        # (bench/dense_matmul.py).
        flat = torch.cat((flat, flat[:1])) if rows in (1, 3) else flat.contiguous()
        y = (self.weight @ flat.t())[:, :rows].t()
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


STREAMED_BYTES = 128 * 2**20  # well past a server CPU's last-level cache per core complex (32 MiB on EPYC)
# Smaller weights are not timed and run F.linear: a product of one costs microseconds either way, while
# streaming 128 MiB of its copies meant hundreds of thousands of timed calls (a MoE router's 1 x 128 gate: 58 s).
PROBED_MIN_BYTES = 256 * 2**10


@functools.cache
def weight_left_is_faster(out_features: int, in_features: int, threads: int) -> tuple[bool, bool]:
    """Whether ``(W @ x.T).T`` beats ``F.linear`` by >= 10% on an (out, in) float32 weight: for 1 row, for 4 rows.

    Timed as decoding runs them: over copies of the weight totalling ``STREAMED_BYTES``, so each
    product reads its weight from memory, not from a cache that one small weight would fit in
    (a single cache-resident copy favoured ``F.linear`` where it loses by 2-3x in the model,
    bench/dense_matmul.py); the two forms alternate, medians of 5 passes. Timed once per CPU model, shape,
    thread count and torch version, then read from lmpress's tuning cache (``kernels/tuning.py``): a model's
    dozen shapes cost about a second of every load otherwise.
    """
    if out_features * in_features * 4 < PROBED_MIN_BYTES:
        return False, False
    shape = {"out": out_features, "in": in_features, "threads": threads, "streamed": STREAMED_BYTES}
    key = tune_key(cpu_model(), "dense-weight-left", shape, ["F.linear", "weight-left"])
    stored = default_cache().get(key)
    if isinstance(stored, list) and len(stored) == 2:
        return bool(stored[0]), bool(stored[1])
    copies = max(1, -(-STREAMED_BYTES // (out_features * in_features * 4)))
    weights = [torch.full((out_features, in_features), 0.01) for _ in range(copies)]
    one, four = torch.full((1, in_features), 0.01), torch.full((4, in_features), 0.01)

    def left_wins(x: torch.Tensor) -> bool:
        right = torch.cat((x, x)).t() if len(x) == 1 else x.t()
        products = {"linear": lambda w: F.linear(x, w), "left": lambda w: w @ right}
        times: dict[str, list[float]] = {name: [] for name in products}
        for _ in range(6):
            for name, product in products.items():
                began = time.perf_counter()
                for weight in weights:
                    product(weight)
                times[name].append(time.perf_counter() - began)
        linear, left = (statistics.median(times[name][1:]) for name in products)  # the first pass warms up
        return left < 0.9 * linear

    chosen = left_wins(one), left_wins(four)
    default_cache().put(key, list(chosen))
    return chosen


class Int4Linear(nn.Module):
    """``(q - zero) * scale`` with 4-bit codes in the CPU int4pack layout, groups of ``group`` columns."""

    KERNEL = "cpu-int4"

    def __init__(self, prepared: tuple, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        _, packed, group, scale_offset, perm = prepared
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.register_buffer("packed", packed)
        self.register_buffer("scale_offset", scale_offset)
        self.register_buffer("perm", perm)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if self.perm is not None:
            flat = flat[:, self.perm]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat.contiguous(), self.packed, self.group, self.scale_offset)
        return finish_output(y, x, self.bias, self.out_features)

    def extra_repr(self) -> str:
        act = ", act-order" if self.perm is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 g{self.group}{act}"


class Int8Linear(nn.Module):
    """Per-row 8-bit weights: ``(q - 128) * scale`` through ``_weight_int8pack_mm``, plus the zero-point offset."""

    KERNEL = "cpu-int8"

    def __init__(self, prepared: tuple, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        _, weight, scale, offset = prepared
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)
        self.register_buffer("offset", offset)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int8pack_mm(flat, self.weight, self.scale)
        if self.offset is not None:
            # (q - zero) * s = (q - 128) * s + (128 - zero) * s: the second term is sum(x) * offset per row.
            y = y + flat.sum(dim=-1, keepdim=True) * self.offset
        return finish_output(y, x, self.bias, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def cpu_linear(layer: QuantizedLinear, dtype: torch.dtype, activations: str = DEFAULT_CPU_ACTIVATIONS) -> nn.Module:
    """The fastest CPU module for ``layer``: a packed kernel, else its weight dequantized once into ``DenseLinear``.

    With ``activations="int8"``, first lmpress's int8-activation kernels (``cpu_int.py``) where they hold the layer
    (4 bits in groups of 64k columns, 8 bits per row, no act-order) and build on this host; then (and with
    ``"bf16"``, only) torch's packed kernels, which take bfloat16 activations. A layer whose scheme quantizes its
    activations to int8 (W4A8, W8A8) never takes a weight-only kernel: where lmpress's does not hold it, W8A8 runs
    torch's int8 matmul (``kernels/int8.py``) and others their weight dequantized once with the activations
    fake-quantized per token (``Int8ActivationsLinear``).
    Layouts the packed kernels cannot run (2/3 bits, grouped 8 bits, 4 bits with
    out_features not a multiple of 16, act-order groups of unequal size) fall back to
    a dense ``dtype`` weight: as fast as an unquantized layer, without the memory saving.
    """
    bias = None if layer.bias is None else layer.bias.detach().float().clone()
    dot = int8_activation_kernel(layer, bias, activations)
    if dot is not None:
        return dot
    if layer.scheme.int8_matmul_holds:  # W8A8 where lmpress's kernel does not build: torch's int8 matmul
        from lmpress.runtime.kernels.int8 import W8A8Linear

        return W8A8Linear(layer)
    if per_token_activations(layer):  # a weight-only kernel would drop the activations' quantization
        return dense_linear(layer, dtype, Int8ActivationsLinear)
    prepared = layer._prepare_kernel()  # the same repacking QuantizedLinear's own kernel path uses
    if prepared is not None and prepared[0] == "int4":
        return Int4Linear(prepared, layer.in_features, layer.out_features, bias)
    if prepared is not None and prepared[0] == "int8":
        return Int8Linear(prepared, layer.in_features, layer.out_features, bias)
    return dense_linear(layer, dtype, DenseLinear)


def per_token_activations(layer: QuantizedLinear) -> bool:
    """Whether ``layer``'s own scheme quantizes its activations (W4A8, W8A8: one int8 scale per token)."""
    return layer.scheme.activations == "int8"


def int8_activation_kernel_fits(layer: QuantizedLinear, activations: str) -> bool:
    """Whether lmpress's int8-activation kernel runs ``layer`` on the CPU: ``activations`` "int8", a layout it
    holds, built on this host; a W4A8 or W8A8 layer's own int8 activations (per token) too."""
    from lmpress.weights.qlinear import trivial_g_idx

    scheme, k = layer.scheme, layer.in_features
    act_order = not trivial_g_idx(layer.g_idx, k, scheme)
    width = scheme.group_width(k)
    if activations != "int8" or scheme.activations not in (None, "int8"):
        return False
    if layer.qweight.device.type != "cpu":
        return False
    fits = (scheme.bits == 4 and cpu_int.w4_fits(k, width, act_order)) or (
        scheme.bits == 8 and cpu_int.w8_fits(k, width, act_order, per_token_activations(layer))
    )
    return fits and cpu_int.available()


def int8_activation_kernel(layer: QuantizedLinear, bias: torch.Tensor | None, activations: str) -> nn.Module | None:
    """``layer`` on lmpress's int8-activation kernel (a W4A8 layer's activations quantized per token, as its scheme
    says, others' per 4 values), or None where it does not hold the layer or ``activations`` is not "int8"."""
    if not int8_activation_kernel_fits(layer, activations):
        return None
    kernel = cpu_int.W4A8Linear if layer.scheme.bits == 4 else cpu_int.W8A8RowLinear
    scales = layer.scales.detach()
    choice = choose_int8_kernel(kernel, layer.out_features, layer.in_features, scales.reshape(len(scales), -1).shape[1])
    per_token = per_token_activations(layer)
    return kernel(layer.codes(), scales, layer.zeros.float(), bias, choice.isa, choice.prefetch, per_token)


@torch.no_grad()
def output_rows(layer: nn.Module, rows: torch.Tensor) -> nn.Module:
    """A copy of ``layer`` that computes only its output rows ``rows`` (the int8 or float kernel it had)."""
    bias = getattr(layer, "bias", None)
    bias = None if bias is None else bias[rows].clone()
    if isinstance(layer, Int8Linear):
        offset = None if layer.offset is None else layer.offset[rows].contiguous()
        prepared = ("int8", layer.weight[rows].contiguous(), layer.scale[rows].contiguous(), offset)
        return Int8Linear(prepared, layer.in_features, len(rows), bias)
    if isinstance(layer, W8A8RowLinear):
        return layer.rows(rows)
    if isinstance(layer, HalfWeightLinear):
        return HalfWeightLinear(layer.weight[rows].contiguous(), bias, layer.isa, layer.prefetch, layer.rows)
    if isinstance(layer, nn.Linear):
        return linear_over(DenseLinear, layer.weight[rows].contiguous(), bias)
    raise LmpressInputError(
        f"only an int8 or float output layer can be cut to part of the vocabulary; this one is {kernel_name(layer)}"
    )


def kernel_name(module: nn.Module) -> str:
    """ "int4", "int8" or "dense" for a module ``cpu_linear`` returned (or a plain ``nn.Linear``)."""
    if isinstance(module, (Int4Linear, W4A8Linear)):
        return "int4"
    if isinstance(module, (Int8Linear, W8A8RowLinear)):
        return "int8"
    return "dense"
