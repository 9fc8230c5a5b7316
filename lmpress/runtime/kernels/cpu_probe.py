"""Per-host choices for lmpress's CPU kernels (``cpu_int.cpp``'s int8-activation ones, ``cpu_half.cpp``'s
half-precision weights, ``cpu_kv_attention.cpp``'s cache attention), probed at first use.

Two hosts with the same instruction sets want different kernels: AVX-512's outputs-in-lanes tiles were tuned on
Intel Xeons, where 512-bit operations run at full width, while AMD's cores before Zen 5 split them in two; and
how far ahead of the weights a kernel should prefetch, and how many weight rows it should stream at once (the
half-precision op: four interleaved rows read a Zen 4 EPYC's memory at 17-23 GB/s, one row at a time at 28-30),
depend on the memory system. So the first load of a weight shape on a host times every candidate (instruction set
level, prefetch distance, the half op's rows at once) on that shape, for
decode's one input row, over copies of the weight totalling ``PROBE_BYTES`` (past a core's caches, though a
large shared last-level cache may hold part of them, as it holds part of a small model in decode), rounds
interleaved. The fastest is kept in lmpress's tuning cache (``kernels/tuning.py``) under the CPU model and flags,
thread count and versions, and later loads read it; the defaults (the host's best level, the op's own distance)
stay unless another candidate is ``MARGIN`` faster, in the probe and again timed alone beside the default
(``confirmed_times``). Every candidate computes the same outputs as the others of its
instruction set level, bit for bit (prefetching moves no arithmetic, and a row's sum is the same chain however many
rows share the pass), and within the kernels' tolerance of the
other level (tests/runtime/test_cpu_probe.py). What the probe costs and chooses per host: bench/cpu_probe.py.

Weights under ``PROBED_MIN_BYTES`` (the tiny test models') and the ``off`` tune space take the defaults: the
host's best level and the op's default distance.

The cache attention op has one choice, its instruction set level, per stored type (float32, int8 and FP8 codes):
on a Zen 4 EPYC its AVX2 body read float32 and int8 caches of 4,000 slots in 0.89x and 0.91x the time of its
AVX-512 one, and FP8 codes in 1.09x (bench/kv_attention_op.py --isa 1). It is timed over ``KV_PROBE_SLOTS`` slots
of the layer's shape, copies of the cache totalling ``PROBE_BYTES``.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import math
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmpress.runtime.kernels import cpu_half, cpu_int, cpu_kv_attention
from lmpress.runtime.kernels.tuning import tune_space, tuned_choice

DEFAULT_PREFETCH = cpu_int.DEFAULT_PREFETCH
HALF_DEFAULT_PREFETCH = cpu_half.DEFAULT_PREFETCH
# The default wins unless another candidate is this much faster: rounds on a shared virtual machine differ by a few
# percent, and distances within a few KiB of each other time alike on the hosts measured (bench/cpu_probe.py).
MARGIN = 0.05
PROBE_BYTES = 64 * 2**20  # the copies of a weight one timed round streams: well past a core's L2
PROBED_MIN_BYTES = 32 * 2**10  # the tiny test models' weights are smaller; SmolLM2's smallest (k, v) 54 KiB
MAX_COPIES = 256  # a small weight's copies stop here (SmolLM2's k and v: 14 of the 64 MiB): each is a call of
# some microseconds of Python and dispatch, and timing 1,200 of them per candidate and round cost 2.4 s of the probe
ROUNDS = 6  # the first warms up; the median of the rest counts
KV_PROBE_SLOTS = 1024  # a cache's filled slots the attention op's levels are timed over
# the cache entries the attention op reads, in ``kv_attention_levels``' order, and what each is stored as (INT4:
# codes two a byte, KIVI's grouped keys alike)
KV_STORED = ("float32", "int8", "fp8", "int4")
KV_STORED_DTYPES = (torch.float32, torch.int8, torch.float8_e4m3fn, torch.uint8)
NOT_PROBED = (-1,) * len(KV_STORED)


@functools.cache
def cpu_model() -> str:
    """This CPU's model name and a digest of its feature flags (``/proc/cpuinfo`` on Linux; else what
    ``platform`` says): the host a timed choice was made on. Virtual machines often name only the family
    ("AMD EPYC"), which covers AVX2-only and AVX-512 hosts alike; the flags tell them apart."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().splitlines()[:64] if ":" in line)
        info = {k.strip(): v.strip() for k, v in info.items()}
        flags = hashlib.sha256(info.get("flags", "").encode()).hexdigest()[:8]
        return f"{info.get('model name', platform.machine())} (flags {flags})"
    except OSError:
        return platform.processor() or platform.machine()


@dataclass(frozen=True)
class KernelChoice:
    """How a kernel runs: instruction set level (``cpu_int.ISA_NAMES``), prefetch distance in bytes and, for the
    half-precision op, weight rows at once (``cpu_half.ROWS_PER_PASS``; None for the int8 kernels)."""

    isa: int
    prefetch: int
    rows: int | None = None

    def candidate(self) -> list[int]:
        """This choice as ``candidates`` lists it."""
        return [self.isa, self.prefetch] + ([] if self.rows is None else [self.rows])


def candidates(host_isa: int, default_prefetch: int = DEFAULT_PREFETCH, rows: tuple[int, ...] = ()) -> list[list[int]]:
    """``[isa, prefetch]`` pairs a host of level ``host_isa`` tries, the default first, each with every count of
    ``rows`` appended where the op has that choice (``[isa, prefetch, rows]``): AVX-512 hosts also their AVX2
    kernels; distances none, 1 KiB, the op's default and 4 and 16 times it; the portable C++ path has no prefetch
    or rows to choose."""
    levels = (2, 1) if host_isa == 2 else (host_isa,)
    distances = (default_prefetch, 0, 1024, 4 * default_prefetch, 16 * default_prefetch)
    pairs = [[isa, prefetch] for isa in levels for prefetch in (distances if isa else (default_prefetch,))]
    if not rows:
        return pairs
    return [[isa, prefetch, count] for isa, prefetch in pairs for count in (rows if isa else rows[:1])]


def choose_kernel(
    kernel: str,
    shape: dict[str, int],
    weight_bytes: int,
    make: Callable[[int], nn.Module],
    default_prefetch: int,
    rows: tuple[int, ...] = (),
) -> KernelChoice:
    """The fastest variant of ``kernel`` on this host for a weight of ``shape``: from this process's memory, the
    tuning cache, or probed now on modules ``make(isa)`` builds."""
    tried = candidates(cpu_int.host_isa(), default_prefetch, rows)
    if tune_space() == "off" or weight_bytes < PROBED_MIN_BYTES:
        return KernelChoice(*tried[0])
    shape = shape | {"threads": torch.get_num_threads()}
    timed = functools.partial(time_candidates, make, shape["in"], weight_bytes)
    times = functools.cache(lambda: confirmed_times(timed, tried, tuple))

    def seconds(candidate: list[int]) -> float:
        return times()[tuple(candidate)] * ((1 - MARGIN) if candidate == tried[0] else 1)

    return KernelChoice(*tuned_choice(cpu_model(), f"{kernel}-probe", shape, tried, seconds))


def choose_int8_kernel(
    kernel: type[cpu_int.Int8ActivationLinear], out_features: int, in_features: int, groups: int
) -> KernelChoice:
    """``choose_kernel`` for an ``(out_features, in_features)`` weight of ``kernel`` (W4A8 or W8A8) with ``groups``
    scales per row."""
    bits = 4 if kernel is cpu_int.W4A8Linear else 8

    def make(isa: int) -> nn.Module:
        generator = torch.Generator().manual_seed(0)
        codes = torch.randint(0, 2**bits, (out_features, in_features), generator=generator, dtype=torch.uint8)
        scales = torch.rand(out_features, groups, generator=generator) * 0.01
        return kernel(codes, scales, torch.full((out_features, groups), float(2 ** (bits - 1))), None, isa=isa)

    shape = {"out": out_features, "in": in_features, "groups": groups}
    return choose_kernel(kernel.KERNEL, shape, out_features * in_features * bits // 8, make, DEFAULT_PREFETCH)


def choose_half_kernel(out_features: int, in_features: int, dtype: torch.dtype) -> KernelChoice:
    """``choose_kernel`` for an ``(out_features, in_features)`` bfloat16 or float16 weight of ``HalfWeightLinear``."""

    def make(isa: int) -> nn.Module:
        weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
        return cpu_half.HalfWeightLinear(weight, isa=isa)

    shape = {"out": out_features, "in": in_features, "dtype": str(dtype).removeprefix("torch.")}
    weight_bytes = out_features * in_features * 2
    return choose_kernel("cpu-half", shape, weight_bytes, make, HALF_DEFAULT_PREFETCH, cpu_half.ROWS_PER_PASS)


def confirmed_times(timed: Callable[[list], dict], tried: list, key: Callable[[list], Any]) -> dict:
    """``timed(tried)`` (seconds by ``key(candidate)``), the default ``tried[0]`` kept unless a challenger that beat
    it by ``MARGIN`` does so again when the two are timed alone side by side; else the challengers count as never
    finishing. One busy moment on a 2-vCPU Xeon made AVX2 bodies of the heads look 4-17% faster than the default;
    timed again beside it they ran at 0.87x and 0.68x its speed, and the probe's choice is kept for the host."""
    times = timed(tried)
    default = key(tried[0])
    challenger = min(tried, key=lambda candidate: times[key(candidate)])
    if key(challenger) == default or times[key(challenger)] >= (1 - MARGIN) * times[default]:
        return times
    again = timed([challenger, tried[0]])
    if again[key(challenger)] < (1 - MARGIN) * again[default]:
        return times
    return {name: seconds if name == default else math.inf for name, seconds in times.items()}


@torch.no_grad()
def time_candidates(
    make: Callable[[int], nn.Module], in_features: int, weight_bytes: int, tried: list[list[int]]
) -> dict[tuple[int, ...], float]:
    """Seconds per product of one input row for each candidate in ``tried``: the median of ``ROUNDS``
    rounds (the first dropped), each over copies of ``make(isa)``'s weight totalling ``PROBE_BYTES`` (at most
    ``MAX_COPIES``)."""
    copies_needed = min(MAX_COPIES, max(1, -(-PROBE_BYTES // weight_bytes)))
    layers = {}
    for isa in dict.fromkeys(candidate[0] for candidate in tried):
        first = make(isa)
        layers[isa] = [first, *(copy.deepcopy(first) for _ in range(copies_needed - 1))]
    x = torch.randn(1, in_features, generator=torch.Generator().manual_seed(1))
    samples: dict[tuple[int, ...], list[float]] = {tuple(candidate): [] for candidate in tried}
    order = random.Random(0)
    for _ in range(ROUNDS):
        # In an order of its own each round: a candidate timed right after another level's copies finds fewer of
        # its own in a shared last-level cache than one timed after its own level's (a fixed order favoured the
        # later candidates of each level by up to 25% on a 260 MiB-L3 Xeon).
        for candidate in order.sample(tried, len(tried)):
            isa, prefetch, *rows = candidate
            for layer in layers[isa]:
                layer.prefetch = prefetch
                if rows:
                    layer.rows = rows[0]
            began = time.perf_counter()
            for layer in layers[isa]:
                layer(x)
            samples[tuple(candidate)].append((time.perf_counter() - began) / copies_needed)
    return {candidate: statistics.median(seconds[1:]) for candidate, seconds in samples.items()}


def kv_attention_levels(kv_heads: int, rows: int, head_dim: int) -> tuple[int, ...]:
    """The cache attention op's instruction set level on this host for each of ``KV_STORED`` (float32 entries, int8,
    FP8 and INT4 codes), for a layer of ``kv_heads`` KV heads of ``head_dim`` and ``rows`` query rows per KV head: from
    this process's memory, the tuning cache, or probed now; -1 (the best level) where it is not probed (the ``off``
    tune space, an AVX2 host, the tests' tiny caches of under 128 floats a slot)."""
    tried = [[2], [1]] if cpu_int.host_isa() == 2 else [[-1]]
    if tune_space() == "off" or len(tried) == 1 or kv_heads * head_dim < 128 or not cpu_kv_attention.available():
        return NOT_PROBED
    levels = []
    for stored in KV_STORED:
        shape = {"kv_heads": kv_heads, "rows": rows, "dim": head_dim, "stored": stored}
        shape |= {"slots": KV_PROBE_SLOTS, "threads": torch.get_num_threads()}
        timed = functools.partial(time_kv_attention, kv_heads, rows, head_dim, stored)
        times = functools.cache(lambda timed=timed: confirmed_times(timed, tried, lambda candidate: candidate[0]))

        def seconds(candidate: list[int], times=times) -> float:
            return times()[candidate[0]] * ((1 - MARGIN) if candidate == tried[0] else 1)

        levels.append(tuned_choice(cpu_model(), "cpu-kv-attention-probe", shape, tried, seconds)[0])
    return tuple(levels)


@torch.no_grad()
def time_kv_attention(kv_heads: int, rows: int, head_dim: int, stored: str, tried: list[list[int]]) -> dict[int, float]:
    """Seconds per call of the cache attention op at each level of ``tried`` over ``KV_PROBE_SLOTS`` filled slots
    of ``stored`` entries: the median of ``ROUNDS`` rounds (the first dropped), each over copies of a cache totalling
    ``PROBE_BYTES``, the levels in an order of their own each round (as ``time_candidates``)."""
    generator = torch.Generator().manual_seed(0)
    shape = (1, kv_heads, KV_PROBE_SLOTS, head_dim)
    width = {"float32": 4, "int8": 1, "fp8": 1, "int4": 0.5}[stored]
    copies = min(MAX_COPIES, max(1, math.ceil(PROBE_BYTES / (2 * width * kv_heads * KV_PROBE_SLOTS * head_dim))))

    def cache() -> tuple[torch.Tensor, ...]:
        keys, values = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
        if stored == "float32":
            return keys, values, None, None
        if stored == "int8":
            scales = torch.full((1, kv_heads, KV_PROBE_SLOTS, 1), 0.02)
            return keys.mul(40).round().clamp(-127, 127).to(torch.int8), values.to(torch.int8), scales, scales
        if stored == "int4":  # [step, minimum] per slot
            codes = [torch.randint(0, 256, (*shape[:3], head_dim // 2), generator=generator).to(torch.uint8)] * 2
            steps = torch.tensor([0.1, -0.75], dtype=torch.float16).expand(*shape[:3], 2).contiguous()
            return codes[0], codes[1].clone(), steps, steps
        one = torch.ones(kv_heads)
        return keys.to(torch.float8_e4m3fn), values.to(torch.float8_e4m3fn), one, one

    caches = [cache() for _ in range(copies)]
    q = torch.randn(1, kv_heads * rows, 1, head_dim, generator=generator)
    mask = torch.ones(1, 1, 1, KV_PROBE_SLOTS, dtype=torch.bool)
    samples: dict[int, list[float]] = {candidate[0]: [] for candidate in tried}
    order = random.Random(0)
    for _ in range(ROUNDS):
        for (isa,) in order.sample(tried, len(tried)):
            began = time.perf_counter()
            for keys, values, key_scales, value_scales in caches:
                cpu_kv_attention.kv_slots_attention(
                    q, keys, values, mask, head_dim**-0.5, key_scales, value_scales, isa
                )
            samples[isa].append((time.perf_counter() - began) / copies)
    return {isa: statistics.median(seconds[1:]) for isa, seconds in samples.items()}
