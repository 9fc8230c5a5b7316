"""Which kernel runs each layer (select.py), tinygemm's scale-and-zero conversion, FP8 through ``_scaled_mm``,
W8A8 through ``_int_mm``, and the on-disk cache of tuned choices: all on the CPU.

SQNR bounds. tinygemm and its CPU twin hold the scale and ``(8 - zero) * scale`` in bf16 (unit roundoff
u = 2**-8, relative error rms at most u / sqrt(3) per rounding) and round the activation and the output to
bf16. The scale's rounding, the offset's (``|8 - z|`` is 0 for symmetric layers and, for RTN's asymmetric
grids, no larger than the codes' spread around z, so its error is at most the scale's), the activation's
and the output's: at most 5 roundings of relative power u**2 / 3, so SQNR >= -10 log10(5 u**2 / 3) = 45.9
dB; 42 dB leaves a margin for the sampling spread (measured: 50.6-51.7 dB over the 12 cases). A
scale-and-zero convention off by anything (zero not folded, q - 8 against q, groups transposed) lands
near 0 dB (``test_a_wrong_fold_of_the_zero_point_is_caught``).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from lmpress.runtime.kernels import build_kernel, kernel_of, linear_kernel, tuning
from lmpress.runtime.kernels.select import DeviceCase, LayerCase, kernel_candidates, select_kernel
from lmpress.runtime.kernels.tinygemm import TinyGemmLinear, inner_k_tiles, nibble_pairs, tinygemm_linear, unpaired
from lmpress.weights.qlinear import QuantizedLinear
from lmpress.weights.scheme import QuantScheme, quantize_weight_rtn

TINYGEMM_MIN_DB = 42.0
H100 = DeviceCase("cuda", torch.bfloat16, (9, 0))
H100_GEMLITE = DeviceCase("cuda", torch.bfloat16, (9, 0), frozenset({"gemlite"}))


def sqnr_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    reference, other = reference.double(), other.double()
    return float(10 * torch.log10(reference.pow(2).sum() / (reference - other).pow(2).sum().clamp_min(1e-300)))


def w4_layer(n: int, k: int, group: int, symmetric: bool, act_order: bool = False, bias: bool = False, seed=0):
    torch.manual_seed(seed)
    qw = quantize_weight_rtn(torch.randn(n, k) * 0.02, QuantScheme(4, group, symmetric))
    if act_order:  # a GPTQ act-order layout: equal groups, columns assigned to them in a shuffled order
        qw.g_idx = (torch.randperm(k) // qw.scheme.group_width(k)).to(torch.int32)
    return QuantizedLinear.from_quantized_weight(qw, torch.randn(n) * 0.1 if bias else None)


# Selection ---------------------------------------------------------------------------------


def case(bits=4, group=128, k=4096, n=4096, **kw) -> LayerCase:
    return LayerCase(bits, k if group == -1 else group, k, n, **kw)


@pytest.mark.parametrize(
    ("layer", "device", "expected"),
    [
        (case(group=128), H100, "tinygemm"),  # W4 g128 symmetric or not: tinygemm
        (case(group=32, n=6144), H100, "tinygemm"),
        (case(group=-1), H100, "tinygemm"),  # per-channel: scales repeated over groups of 256
        (case(act_order=True), H100, "tinygemm"),  # equal groups: activations permuted
        (case(act_order=True, equal_groups=False), H100, "dense"),  # neither kernel takes unequal groups
        (case(), DeviceCase("cuda", torch.float16, (9, 0)), "triton"),  # tinygemm takes bf16 only
        (case(), DeviceCase("cuda", torch.bfloat16, (7, 5)), "triton"),  # tinygemm needs sm80+
        (case(n=4100), H100, "triton"),  # N % 8
        (case(group=48, k=4608), H100, "dense"),  # neither a multiple of 32 for tinygemm nor a power of two
        (case(bits=8, group=-1), H100, "triton"),  # W8 weight-only
        (case(bits=8, group=-1), H100_GEMLITE, "gemlite"),
        (case(bits=3, group=128), H100, "dense"),  # no kernel packs 3 bits
        (case(bits=2, group=64), H100_GEMLITE, "gemlite"),
        (case(act_order=True), H100_GEMLITE, "tinygemm"),  # gemlite has no act-order
        (case(bits=8, group=-1, activations="int8"), H100, "int8-mm"),
        (case(bits=8, group=-1, activations="fp8"), H100, "fp8-scaled-mm"),
        (case(bits=8, group=-1, activations="fp8"), DeviceCase("cuda", torch.bfloat16, (8, 9)), "fp8-scaled-mm"),
        (case(bits=8, group=-1, activations="fp8"), DeviceCase("cuda", torch.bfloat16, (8, 0)), "fp8-simulated"),
        (case(bits=8, group=-1, k=4104, activations="fp8"), H100, "fp8-simulated"),  # K % 16
        (case(group=128), DeviceCase("cpu", torch.float32), "cpu-w4a8"),
        (case(group=32), DeviceCase("cpu", torch.float32), "cpu-int4"),  # groups narrower than the 64-blocks
        (case(act_order=True), DeviceCase("cpu", torch.float32), "cpu-int4"),
        (case(bits=8, group=-1), DeviceCase("cpu", torch.float32), "cpu-w8a8"),
        (case(bits=8, group=-1, k=4100), DeviceCase("cpu", torch.float32), "cpu-int8"),  # K % 64
        # W8A8: lmpress's int8 x int8 kernel with per-token activations where it holds the layer, else torch's
        (case(bits=8, group=-1, activations="int8"), DeviceCase("cpu", torch.float32), "cpu-w8a8"),
        (case(bits=8, group=-1, k=4100, activations="int8"), DeviceCase("cpu", torch.float32), "int8-mm"),
        # W4A8: no int8 matmul holds group scales; on the CPU lmpress's int4 x int8 kernel with per-token activations,
        # elsewhere the per-token simulation it was scored with, weight dequantized once
        (case(group=64, activations="int8"), DeviceCase("cpu", torch.float32), "cpu-w4a8"),
        (case(group=32, activations="int8"), DeviceCase("cpu", torch.float32), "int8-simulated"),
        (case(group=64, activations="int8"), H100, "int8-simulated"),
        (case(bits=8, group=-1, activations="fp8"), DeviceCase("cpu", torch.float32), "fp8-simulated"),
        (case(bits=3, group=128), DeviceCase("cpu", torch.float32), "dense"),
    ],
)
def test_kernel_selection_table(layer, device, expected):
    assert select_kernel(layer, device) == expected
    fallbacks = ("dense", "int8-mm", "fp8-simulated", "int8-simulated", "fp4-simulated")
    assert kernel_candidates(layer, device)[-1] in fallbacks


def test_tinygemm_and_gemlite_are_measured_only_when_both_hold():
    asked = []

    def measure(names):
        asked.append(names)
        return "gemlite"

    assert select_kernel(case(), H100_GEMLITE, measure) == "gemlite"
    assert asked == [("tinygemm", "gemlite")]
    assert select_kernel(case(), H100, measure) == "tinygemm"  # one contender: nothing to time
    assert len(asked) == 1


def test_layer_case_of_a_quantized_layer():
    layer = w4_layer(32, 256, 64, False, act_order=True)
    assert LayerCase.of(layer) == LayerCase(4, 64, 256, 32, act_order=True, equal_groups=True, symmetric=False)
    assert LayerCase.of(w4_layer(32, 256, 64, True)).act_order is False


# tinygemm's scale-and-zero, checked through torch's CPU int4 kernel -------------------------------


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_tinygemm_conversion_matches_the_dequantized_weight(group, symmetric, act_order):
    """lmpress's (q - zero) * scale, folded into tinygemm's [scale, (8 - zero) * scale], run by
    ``_weight_int4pack_mm_for_cpu`` (the same convention as CUDA's ``_weight_int4pack_mm``)."""
    layer = w4_layer(96, 512, group, symmetric, act_order, bias=True)
    module = tinygemm_linear(layer)
    assert isinstance(module, TinyGemmLinear) and module.group == group and (module.perm is not None) == act_order
    x = torch.randn(5, 512)
    reference = x.double() @ layer.dequantized_weight(torch.float64).T + layer.bias.double()
    assert sqnr_db(reference, module(x)) >= TINYGEMM_MIN_DB
    # the scale-and-zero tensor itself: one bf16 (groups, N, 2) of [scale, (8 - zero) * scale]
    sz = module.scale_and_zero.float()
    assert sz.shape == (512 // group, 96, 2)
    torch.testing.assert_close(sz[..., 0], layer.scales.float().T.to(torch.bfloat16).float())
    offset = ((8 - layer.zeros.float()) * layer.scales.float()).T
    torch.testing.assert_close(sz[..., 1], offset.to(torch.bfloat16).float())


@pytest.mark.parametrize("act_order", [False, True])
def test_tinygemm_prefill_dequantizes_and_matches_the_kernel(act_order, monkeypatch):
    """From ``DEQUANT_MIN_ROWS`` rows on the layer multiplies its dequantized codes (an H200 ran tinygemm at
    2048 rows 26x slower than bf16 cuBLAS); the product is the kernel's, to bf16 rounding."""
    from lmpress.runtime.kernels import tinygemm

    layer = w4_layer(96, 512, 64, False, act_order, bias=True)
    module = tinygemm_linear(layer)
    x = torch.randn(tinygemm.DEQUANT_MIN_ROWS, 512)
    reference = x.double() @ layer.dequantized_weight(torch.float64).T + layer.bias.double()
    kernel_calls = []
    real = torch.ops.aten._weight_int4pack_mm_for_cpu
    monkeypatch.setattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", lambda *a: kernel_calls.append(1) or real(*a))
    prefill = module(x)
    assert kernel_calls == [] and sqnr_db(reference, prefill) >= TINYGEMM_MIN_DB
    decode = torch.cat([module(x[i : i + 8]) for i in range(0, len(x), 8)])  # below the threshold: the kernel
    assert len(kernel_calls) == len(x) // 8
    assert float((prefill - decode).abs().max()) <= 0.02 * float(decode.abs().max())
    # the dequantized weight is the layer's, in the codes' order (act-order sorted by group)
    perm = module.perm if act_order else torch.arange(512)
    want = layer.dequantized_weight(torch.float32)[:, perm].to(torch.bfloat16)
    torch.testing.assert_close(module.dequantized_weight(torch.bfloat16), want, atol=0.02, rtol=0.01)


def test_tinygemm_repeats_wide_groups_and_per_channel_scales():
    for group, kernel_group in ((256, 256), (-1, 256), (192, 64)):
        layer = w4_layer(32, 768 if group == 192 else 1024, group, False)
        module = tinygemm_linear(layer)
        assert module.group == kernel_group
        x = torch.randn(3, layer.in_features)
        assert sqnr_db(x.double() @ layer.dequantized_weight(torch.float64).T, module(x)) >= TINYGEMM_MIN_DB


def test_a_wrong_fold_of_the_zero_point_is_caught():
    """The check can fail: scale-and-zero with the zero left out (offset 0) is far off."""
    layer = w4_layer(64, 256, 64, False)
    module = tinygemm_linear(layer)
    module.scale_and_zero[..., 1] = 0
    x = torch.randn(4, 256)
    assert sqnr_db(x.double() @ layer.dequantized_weight(torch.float64).T, module(x)) < 10


def test_nibble_pairs_and_inner_k_tiles():
    codes = torch.randint(0, 16, (8, 64))
    pairs = nibble_pairs(codes)
    assert pairs.dtype == torch.uint8 and pairs.shape == (8, 32)
    assert int(pairs[0, 0]) == int(codes[0, 0]) * 16 + int(codes[0, 1])  # even column in the high nibble
    assert torch.equal(unpaired(pairs), codes.to(torch.int32))
    assert [inner_k_tiles(k) for k in (4096, 14336, 576, 96)] == [8, 8, 4, 2]


def test_tinygemm_module_keeps_its_bf16_scales_through_a_cast():
    module = tinygemm_linear(w4_layer(32, 256, 64, False))
    before = module.scale_and_zero.clone()
    module.to(torch.float16)
    assert module.scale_and_zero.dtype == torch.bfloat16 and torch.equal(module.scale_and_zero, before)


# FP8 through _scaled_mm, W8A8 through _int_mm ------------------------------------------------------


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_fp8_scaled_mm_module_against_the_dequantized_product(strategy):
    """``_scaled_mm`` (torch's CPU op here, cuBLASLt on a GPU) computes Fp8Linear's function: E4M3 codes of x
    per token times E4M3 W, both scales after. The reference multiplies the same E4M3 values in float64;
    the module's only extra rounding is its bf16 output (u = 2**-8: >= 45 dB with margin)."""
    from lmpress.weights.float8 import Fp8Linear, quantize_fp8_per_token

    torch.manual_seed(1)
    linear = torch.nn.Linear(256, 64).requires_grad_(False)
    fp8 = Fp8Linear.from_linear(linear, strategy)
    module = build_kernel("fp8-scaled-mm", fp8, torch.bfloat16)
    assert kernel_of(module) == "fp8-scaled-mm"
    x = torch.randn(7, 256)
    codes, x_scale = quantize_fp8_per_token(x)
    reference = (codes.double() * x_scale.double()) @ fp8.dequantized_weight(torch.float64).T + linear.bias.double()
    assert sqnr_db(reference, module(x)) >= 45
    assert sqnr_db(fp8(x), module(x)) >= 45  # the evals' simulated FP8 layer agrees


def test_w8a8_runs_int8_times_int8_in_every_family_but_reference():
    """Every family but "reference" runs a CPU W8A8 layer on lmpress's int8 kernel with per-token activations (where it
    builds), else torch._int_mm: the W8A8 function either way."""
    from lmpress.runtime.kernels import cpu_int
    from lmpress.weights.int8_linear import w8a8_reference

    torch.manual_seed(2)
    qw = quantize_weight_rtn(torch.randn(48, 128) * 0.02, QuantScheme(8, -1, True, activations="int8"))
    layer = QuantizedLinear.from_quantized_weight(qw)
    for family in ("cpu", "triton"):
        module = linear_kernel(family)(layer, torch.float32)
        assert kernel_of(module) == ("cpu-w8a8" if cpu_int.available() else "int8-mm")
        x = torch.randn(3, 128)
        codes = (layer.codes().to(torch.int16) - 128).float()
        expected = w8a8_reference(x, codes, layer.scales[:, 0].float())
        assert sqnr_db(expected, module(x)) >= 60
    assert kernel_of(linear_kernel("reference")(layer, torch.float32)) == "int8-mm"


# The on-disk cache of tuned choices ------------------------------------------------------------


@pytest.fixture
def tune_file(tmp_path, monkeypatch):
    path = tmp_path / "tuning.json"
    monkeypatch.setenv("LMPRESS_TUNE_CACHE", str(path))
    tuning.forget_in_memory()
    yield path
    tuning.forget_in_memory()


class FakeTuner:
    """Times candidates by a table, counting every timing."""

    def __init__(self, times):
        self.times, self.calls = times, []

    def __call__(self, candidate):
        self.calls.append(candidate)
        value = self.times[json.dumps(candidate, sort_keys=True)]
        if value is None:
            raise RuntimeError("does not compile here")
        return value


def test_a_second_process_reads_the_tuned_choice_instead_of_tuning(tune_file):
    configs = [{"BN": 64}, {"BN": 128}, {"BN": 256}]
    tuner = FakeTuner({'{"BN": 64}': 3.0, '{"BN": 128}': 1.0, '{"BN": 256}': None})
    shape = {"N": 4096, "K": 4096}
    assert tuning.tuned_choice("NVIDIA H100 80GB HBM3", "triton_gemv_row", shape, configs, tuner) == {"BN": 128}
    assert len(tuner.calls) == 3  # every candidate timed once; the one that fails is not chosen
    assert tuning.tuned_choice("NVIDIA H100 80GB HBM3", "triton_gemv_row", shape, configs, tuner) == {"BN": 128}
    assert len(tuner.calls) == 3  # same process: from memory

    tuning.forget_in_memory()  # a new `lmpress generate`
    second = FakeTuner({})  # would raise KeyError if asked to time anything
    assert tuning.tuned_choice("NVIDIA H100 80GB HBM3", "triton_gemv_row", shape, configs, second) == {"BN": 128}
    assert second.calls == []
    assert json.loads(tune_file.read_text())["format"] == tuning.FORMAT


@pytest.mark.parametrize("change", ["device", "kernel", "shape", "candidates", "version"])
def test_the_key_holds_gpu_kernel_shape_candidates_and_versions(tune_file, monkeypatch, change):
    args = ["NVIDIA H100 80GB HBM3", "weight_only_kernel", {"N": 4096, "K": 14336}, ["tinygemm", "gemlite"]]
    tuning.tuned_choice(*args, FakeTuner({'"tinygemm"': 2.0, '"gemlite"': 1.0}))
    tuning.forget_in_memory()
    if change == "device":
        args[0] = "NVIDIA H200"
    elif change == "kernel":
        args[1] = "triton_gemm"
    elif change == "shape":
        args[2] = {"N": 14336, "K": 4096}
    elif change == "candidates":
        args[3] = ["tinygemm", "gemlite", "triton"]
    else:
        real = tuning.versions()
        monkeypatch.setattr(tuning, "versions", lambda: {**real, "triton": "99.0"})
    again = FakeTuner({'"tinygemm"': 1.0, '"gemlite"': 2.0, '"triton"': 3.0})
    assert tuning.tuned_choice(*args, again) == "tinygemm"  # tuned afresh, not read from the other entry
    assert again.calls


def test_a_launch_looks_its_tuned_config_up_once(tune_file, monkeypatch):
    """An H200 visit timed the Triton GEMV at 1.4-2.4 ms a call, whatever the shape: each launch built
    ``tune_key``'s JSON of every candidate and read four package versions (about 2 ms here), so eager
    decode and the kernel selection's timing saw that, not the kernel. A launch must cost a dict lookup."""
    pytest.importorskip("triton")
    from lmpress.runtime.kernels import triton as triton_kernels

    keyed, timed = [], []
    real_key = tuning.tune_key
    monkeypatch.setattr(tuning, "tune_key", lambda *a: keyed.append(a) or real_key(*a))
    monkeypatch.setattr(triton_kernels, "_device_name", lambda device: "NVIDIA H200")

    class Kernel:  # times each config by its tile width
        def __getitem__(self, grid):
            return lambda *args, BN, **config: timed.append(BN)

    monkeypatch.setattr("triton.testing.do_bench", lambda launch, **kw: launch() or 1.0 / timed[-1])
    shape = {"N": 4096, "KW": 512, "G": 64, "BM": 1, "C": 2, "BITS": 4}
    grid = lambda config: (1, 1)  # noqa: E731
    first = triton_kernels._tuned_config("gemv_row", Kernel(), grid, (), {}, shape, torch.device("cpu"))
    assert first["BN"] == max(c["BN"] for c in triton_kernels.configs_for("gemv_row", 4096, 64))
    for _ in range(50):
        assert triton_kernels._tuned_config("gemv_row", Kernel(), grid, (), {}, shape, torch.device("cpu")) == first
    assert len(keyed) == 1
    versions = tuning.versions()
    assert tuning.versions() is versions  # read once per process


def test_an_unreadable_cache_is_tuned_over_and_a_single_candidate_never_timed(tune_file):
    tune_file.write_text("{not json")
    tuner = FakeTuner({'"a"': 2.0, '"b"': 1.0})
    assert tuning.tuned_choice("gpu", "k", {}, ["a", "b"], tuner) == "b"
    assert json.loads(tune_file.read_text())["choices"]
    lone = FakeTuner({})
    assert tuning.tuned_choice("gpu", "k2", {}, ["only"], lone) == "only" and lone.calls == []


def test_autotune_space_setting(monkeypatch):
    monkeypatch.setattr(tuning, "_space", tuning.tune_space())
    tuning.set_tune_space("small")
    assert tuning.tune_space() == "small"
    with pytest.raises(ValueError, match="full, small, off"):
        tuning.set_tune_space("fast")
    assert tuning.tune_space() == "small"


def test_sqnr_bound_derivation():
    assert -10 * math.log10(5 * 2.0**-16 / 3) > TINYGEMM_MIN_DB + 3


def test_a_decode_step_reads_tinygemms_codes_once():
    """Bytes per token count what a decode step reads: on a GPU the tensor-core layout, not the nibble pairs kept
    beside it for prefill (a W4 row would report about 1.7x its bytes); on the CPU the two are one tensor."""
    from lmpress.runtime.throughput import weight_bytes

    class Holder(torch.nn.Module):
        def __init__(self, linear):
            super().__init__()
            self.linear = linear

    module = tinygemm_linear(w4_layer(96, 512, 64, True))
    codes = module.pairs.numel()
    sz = module.scale_and_zero.numel() * module.scale_and_zero.element_size()
    assert module.weight is module.pairs and weight_bytes(Holder(module)) == codes + sz
    module.weight = torch.zeros(96 // 8, 512 // (16 * 8), 32, 4, dtype=torch.int32)  # as on a GPU: its own layout
    assert weight_bytes(Holder(module)) == module.weight.numel() * 4 + sz == codes + sz


def test_on_a_gpu_the_codes_live_once_in_tinygemms_layout(monkeypatch):
    """Packed for a GPU, a layer keeps only tinygemm's layout (its nibble pairs read back out of it for prefill,
    checked on its own codes first); had torch packed another way, it would keep the pairs and say so. Here torch's
    CUDA packing is stood in for by the transcribed layout (``int4pack_layout``, tested against the kernel's
    source); the GPU visit compares the two on CUDA."""
    from lmpress.runtime.kernels import int4pack_layout, tinygemm
    from lmpress.runtime.throughput import weight_bytes

    layer = w4_layer(96, 512, 64, False)
    module = tinygemm_linear(layer)
    before = module.dequantized_weight(torch.float32)
    monkeypatch.setattr(torch.ops.aten, "_convert_weight_to_int4pack", int4pack_layout.pack_int4_tensor_core)
    module.weight, module.pairs = module.pack_for_gpu(module.pairs)
    assert module.pairs is None and module.weight.shape == (96 // 8, 512 // 128, 32, 4)
    assert torch.equal(module.dequantized_weight(torch.float32), before)  # prefill's weight, from the layout
    sz = module.scale_and_zero.numel() * module.scale_and_zero.element_size()
    holder = torch.nn.Sequential(module)
    assert weight_bytes(holder) == module.weight.numel() * 4 + sz == 96 * 256 + sz  # the codes once
    tinygemm._warn_layout_unread.cache_clear()

    def another_layout(pairs, tiles):
        return int4pack_layout.pack_int4_tensor_core(pairs.flip(0), tiles)

    monkeypatch.setattr(torch.ops.aten, "_convert_weight_to_int4pack", another_layout)
    pairs = tinygemm_linear(layer).pairs
    with pytest.warns(UserWarning, match="keep a second copy of their codes"):
        _, kept = module.pack_for_gpu(pairs)
    assert kept is pairs
