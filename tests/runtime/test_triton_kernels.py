"""Triton kernels against dequantize-then-matmul in float32.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set here
before triton is imported) on CPU tensors; on a CUDA machine the same tests run compiled
on the GPU, and the ``gpu`` test adds Llama-3-8B-sized layers.

SQNR bounds are derived, not tuned. Rounding a value to a float format with unit
roundoff ``u`` leaves a relative error of rms at most ``u / sqrt(3)`` (uniform error of
half an ulp, ulp <= 2u relative). The kernels round the scales to fp16 (u = 2**-11) and
the output to the activation dtype (u = 2**-8 for bf16, 2**-11 for fp16); the GEMM also
rounds each dequantized weight to the activation dtype before ``tl.dot``. fp32
accumulation adds ~K * 2**-24, negligible here. With independent errors the noise powers
add, relative to the signal: SQNR >= -10 log10(sum of u**2 / 3); a 3 dB margin covers
the sampling spread of the few dozen outputs per case. On a GPU that gives 49.9 dB (GEMV)
and 46.9 dB (GEMM) for bf16, 65.0 and 63.2 dB for fp16. Triton's interpreter (3.9)
truncates fp32 -> bf16 instead of rounding to nearest: error below one ulp, rms up to
``2u / sqrt(3)``, so interpreted bf16 bounds are 43.9 and 40.9 dB.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (pip install 'lmpress[dev]')")

from lmpress.runtime.kernels import triton as tk
from lmpress.weights.qlinear import QuantizedLinear
from lmpress.weights.scheme import QuantScheme, quantize_weight_rtn
from tests.weights.test_qlinear import act_order_weight  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
MARGIN_DB = 3.0
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
SCALE_ROUNDOFF = 2.0**-11


@pytest.fixture(autouse=True)
def fixed_tiles(monkeypatch):
    """Correctness needs no autotuning (the bench checks every tuned config it times): compile once per shape."""
    monkeypatch.setattr(tk, "AUTOTUNE", False)


def rounding(dtype: torch.dtype) -> float:
    """Largest relative error of one fp32 -> ``dtype`` conversion in the kernels (see the module docstring)."""
    return UNIT_ROUNDOFF[dtype] * (2 if INTERPRETED and dtype == torch.bfloat16 else 1)


def sqnr_bound(dtype: torch.dtype, rows: int) -> float:
    u = rounding(dtype)
    roundings = [SCALE_ROUNDOFF, u] + ([u] if rows > tk.DECODE_MAX_ROWS else [])
    return -10 * math.log10(sum(r * r / 3 for r in roundings)) - MARGIN_DB


def sqnr_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    noise = (reference - other.float()).pow(2).sum().clamp_min(1e-30)
    return float(10 * torch.log10(reference.pow(2).sum() / noise))


def make_layer(n: int, k: int, scheme: QuantScheme, act_order: bool = False, bias: bool = False, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    qw = act_order_weight(w, scheme, seed) if act_order else quantize_weight_rtn(w, scheme)
    b = torch.randn(n, generator=gen) if bias else None
    return QuantizedLinear.from_quantized_weight(qw, b).to(DEVICE)


def reference(x: torch.Tensor, layer: QuantizedLinear) -> torch.Tensor:
    bias = None if layer.bias is None else layer.bias.float()
    return torch.nn.functional.linear(x.float(), layer.dequantized_weight(torch.float32), bias)


def check(
    layer: QuantizedLinear, m: int, dtype: torch.dtype, lead: tuple[int, ...] = (), path: str | None = None
) -> None:
    bits = layer.scheme.bits
    packed = tk.prepare_w4a16(layer) if bits == 4 else tk.prepare_w8a16(layer)
    matmul = tk.w4a16_matmul if bits == 4 else tk.w8a16_matmul
    x = torch.randn(*lead, m, layer.in_features, generator=torch.Generator().manual_seed(m)).to(DEVICE, dtype)
    y = matmul(x, packed, path)
    assert y.dtype == dtype and y.shape == (*lead, m, layer.out_features)
    got, bound = sqnr_db(reference(x, layer), y), sqnr_bound(dtype, x.numel() // layer.in_features)
    assert got >= bound, f"SQNR {got:.1f} dB < {bound:.1f} dB"


# (bits, N, K, group size, symmetric, act-order): N and K off the block sizes; per-channel K=96 pads to 128.
LAYOUTS = [
    (4, 48, 96, 32, True, False),
    (4, 48, 96, 32, False, False),
    (4, 40, 128, 64, False, False),
    (4, 24, 256, 128, True, False),
    (4, 48, 96, -1, False, False),
    (4, 48, 96, 32, False, True),
    (8, 48, 96, 32, False, False),
    (8, 40, 128, 64, True, False),
    (8, 24, 256, 128, False, False),
    (8, 48, 96, -1, True, False),
    (8, 48, 96, 32, True, True),
]


@pytest.mark.long
@pytest.mark.parametrize("bits,n,k,group,symmetric,act_order", LAYOUTS)
@pytest.mark.parametrize("m", [1, 3, 8, 17])
def test_matmul_matches_dequantized_reference_bf16(bits, n, k, group, symmetric, act_order, m):
    check(make_layer(n, k, QuantScheme(bits, group, symmetric), act_order), m, torch.bfloat16)


@pytest.mark.long
@pytest.mark.parametrize("bits,n,k,group,symmetric,act_order", LAYOUTS[::2])
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_split_k(monkeypatch, bits, n, k, group, symmetric, act_order, split, m):
    """Both GEMVs (one row; 2-8 rows) with K in 1 or 3 slices (the default tiles use 2)."""
    monkeypatch.setitem(tk.DEFAULT_GEMV, "SPLIT_K", split)
    monkeypatch.setitem(tk.DEFAULT_GEMV, "NB", 1)
    check(make_layer(n, k, QuantScheme(bits, group, symmetric), act_order), m, torch.bfloat16)


def test_split_k_leaves_its_counters_at_zero_and_repeats_bit_for_bit():
    packed = tk.prepare_w4a16(make_layer(40, 256, QuantScheme(4, 32, False)))
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16)
    first = tk.w4a16_matmul(x, packed)
    _, count = tk._SPLIT_WORKSPACE[x.device]
    assert int(count.abs().sum()) == 0
    for _ in range(3):
        assert torch.equal(tk.w4a16_matmul(x, packed), first)


@pytest.mark.parametrize("bits,n,k,group,symmetric,act_order", LAYOUTS)
def test_dequantize_then_cublas_path(bits, n, k, group, symmetric, act_order):
    check(
        make_layer(n, k, QuantScheme(bits, group, symmetric), act_order, bias=True), 9, torch.bfloat16, path="dequant"
    )


def test_dequantized_path_in_row_chunks(monkeypatch):
    """A layer larger than the scratch matrix is dequantized and multiplied a chunk of rows at a time."""
    monkeypatch.setattr(tk, "SCRATCH_ELEMENTS", 20 * 128)
    monkeypatch.setattr(tk, "_SCRATCH", {})
    check(make_layer(48, 96, QuantScheme(4, 32, False), act_order=True, bias=True), 9, torch.float16, path="dequant")


@pytest.mark.parametrize("bits,group,act_order", [(4, 32, True), (8, -1, False), (4, 64, False)])
def test_dequantize_writes_the_sorted_weight(bits, group, act_order):
    layer = make_layer(24, 192, QuantScheme(bits, group, False), act_order)
    packed = tk.prepare_w4a16(layer) if bits == 4 else tk.prepare_w8a16(layer)
    expected = layer.dequantized_weight(torch.float32)
    if packed.perm is not None:
        expected = expected[:, packed.perm.long()]
    got = tk.dequantize(packed, torch.float32)
    assert got.shape == (24, packed.n_blocks * packed.block)
    # Only the scales' rounding to fp16 (relative 2**-11) separates the two.
    torch.testing.assert_close(got[:, :192], expected, rtol=SCALE_ROUNDOFF, atol=1e-7)


def test_default_paths_by_rows_and_bad_paths():
    assert [tk.matmul_path(m) for m in (1, 8, 9, tk.DEQUANT_MIN_ROWS)] == ["gemv", "gemv", "gemm", "dequant"]
    packed = tk.prepare_w4a16(make_layer(16, 64, QuantScheme(4, 32, True)))
    x = torch.randn(9, 64, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="at most 8 rows"):
        tk.w4a16_matmul(x, packed, path="gemv")
    with pytest.raises(ValueError, match="unknown path 'marlin'"):
        tk.w4a16_matmul(x, packed, path="marlin")


def test_autotune_pruning_keeps_splits_that_fit():
    configs = tk.GEMV_ROW_CONFIGS
    kept = tk._splits_that_fit(configs, 4096, 8, 1)
    splits = {(c["SPLIT_K"], c["NB"]) for c in kept}
    assert (8, 1) in splits and (8, 2) not in splits and (4, 2) in splits  # 8 blocks: >= NB blocks per slice
    assert all(c["SPLIT_K"] * c["NB"] <= 8 for c in kept if c["SPLIT_K"] > 1)
    huge = tk._splits_that_fit(configs, 2**20, 1024, 8)  # partials over SPLIT_PARTIALS
    assert {c["SPLIT_K"] for c in huge} == {1}


def test_small_autotune_space_is_a_fixed_few(monkeypatch):
    """Tune space ``small`` (the GPU visit's setting) tunes 2-3 configs per kernel, not the full 40."""
    from lmpress.runtime.kernels import tuning

    monkeypatch.setattr(tuning, "_space", "small")
    assert len(tk.configs_for("gemv_row", 4096, 128, 1)) == 3 and len(tk.configs_for("gemm")) == 2
    monkeypatch.setattr(tuning, "_space", "full")
    assert len(tk.configs_for("gemv_row", 4096, 128, 1)) == len(tk.GEMV_ROW_CONFIGS)
    monkeypatch.setattr(tuning, "_space", "off")
    assert not tk._autotuning()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [2, 33])
def test_fp16_bias_and_leading_shape(bits, m):
    layer = make_layer(48, 96, QuantScheme(bits, 32, False), act_order=True, bias=True)
    check(layer, m, torch.float16, lead=(2,))


@pytest.mark.parametrize("bits,group,act_order", [(4, 32, False), (4, 32, True), (8, 64, False), (4, -1, False)])
def test_packed_words_hold_the_codes_interleaved_within_blocks(bits, group, act_order):
    layer = make_layer(16, 192, QuantScheme(bits, group, False), act_order)
    packed = tk.prepare_w4a16(layer) if bits == 4 else tk.prepare_w8a16(layer)
    per, c = 32 // bits, packed.block
    t = c // per
    words = packed.words.long() & 0xFFFFFFFF
    codes = (words[..., None] >> (torch.arange(per, device=words.device) * bits)) & (2**bits - 1)
    # (N, block, r, j) -> column j * T + r of the block
    codes = codes.reshape(16, -1, t, per).transpose(2, 3).reshape(16, -1)[:, :192]
    expected = layer.codes().long()
    if packed.perm is not None:
        expected = expected[:, packed.perm.long()]
        assert torch.equal(layer.g_idx[packed.perm.long()].long(), torch.arange(192, device=DEVICE) // group)
    assert torch.equal(codes, expected)
    assert (packed.zeros is None) == (packed.zero >= 0)


def test_symmetric_weights_use_one_compile_time_zero():
    packed = tk.prepare_w4a16(make_layer(16, 64, QuantScheme(4, 32, True)))
    assert packed.zeros is None and packed.zero == 8 and packed.scales.dtype == torch.float16


def test_bad_inputs_are_rejected():
    layer4 = make_layer(16, 64, QuantScheme(4, 32, True))
    with pytest.raises(ValueError, match="8-bit weight, got W4"):
        tk.prepare_w8a16(layer4)
    packed = tk.prepare_w4a16(layer4)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        tk.w4a16_matmul(torch.randn(1, 64, device=DEVICE), packed)
    with pytest.raises(ValueError, match="features"):
        tk.w4a16_matmul(torch.randn(1, 32, device=DEVICE, dtype=torch.bfloat16), packed)
    with pytest.raises(ValueError, match="8-bit"):
        tk.w8a16_matmul(torch.randn(1, 64, device=DEVICE, dtype=torch.bfloat16), packed)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [96, 100])
def test_rms_norm_matches_torch_formula(dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(2, 5, hidden, generator=gen) * 3).to(DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(DEVICE, dtype)
    y = tk.rms_norm(x, weight, 1e-6)
    assert y.dtype == dtype and y.shape == x.shape
    # One rounding of the fp32 result to the output format.
    torch.testing.assert_close(y.float(), rms_norm_reference(x, weight, 1e-6), rtol=rounding(dtype), atol=1e-6)


def test_rms_norm_with_residual_returns_the_sum_and_its_norm():
    gen = torch.Generator().manual_seed(0)
    x, r = (torch.randn(3, 130, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(2))
    weight = torch.rand(130, generator=gen).to(DEVICE, torch.bfloat16)
    y, h = tk.rms_norm(x, weight, 1e-5, residual=r)
    u = rounding(torch.bfloat16)
    if INTERPRETED:
        torch.testing.assert_close(h.float(), x.float() + r.float(), rtol=u, atol=0)
    else:
        assert torch.equal(h, x + r)
    torch.testing.assert_close(y.float(), rms_norm_reference(h, weight, 1e-5), rtol=u, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled Triton)")
@pytest.mark.parametrize("bits,group,symmetric", [(4, 128, True), (4, 64, False), (8, -1, True)])
def test_gpu_llama_shapes(bits, group, symmetric):
    layer = make_layer(4096, 4096, QuantScheme(bits, group, symmetric), bias=False)
    for m in (1, 4, 2048):
        check(layer, m, torch.bfloat16)
    check(layer, 2048, torch.bfloat16, path="gemm")
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    weight = torch.rand(4096, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(
        tk.rms_norm(x, weight, 1e-5).float(), rms_norm_reference(x, weight, 1e-5), rtol=2**-8, atol=1e-6
    )


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled Triton)")
@pytest.mark.parametrize("n,k", [(4096, 14336), (14336, 4096)])
def test_gpu_autotuned_split_k_gemv_is_right_every_time(monkeypatch, n, k):
    """Every config the autotuner keeps, run concurrently on the GPU: right and bit-identical across 50 calls."""
    monkeypatch.setattr(tk, "AUTOTUNE", True)
    layer = make_layer(n, k, QuantScheme(4, 128, True))
    packed = tk.prepare_w4a16(layer)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    ref = reference(x, layer)
    for config in tk.configs_for("gemv_row", n, packed.n_blocks, 1):
        monkeypatch.setattr(tk, "DEFAULT_GEMV", config)
        monkeypatch.setattr(tk, "AUTOTUNE", False)
        first = tk.w4a16_matmul(x, packed)
        assert sqnr_db(ref, first) >= sqnr_bound(torch.bfloat16, 1), config
        outs = [tk.w4a16_matmul(x, packed) for _ in range(50)]
        assert all(torch.equal(o, first) for o in outs), f"{config}: results differ between calls (a race)"


@pytest.mark.long
@pytest.mark.parametrize(("bits", "group_size", "act_order"), [(4, 32, False), (4, 32, True), (8, -1, False)])
def test_runtime_model_on_triton_kernels_matches_dequantized_reference(bits, group_size, act_order):
    """The decoder built for CUDA (Triton linears and RMSNorm) against the CPU runtime on dequantized weights."""
    from lmpress.runtime.kernels.cuda import TritonLinear
    from lmpress.runtime.model import Transformer
    from tests.runtime.conftest import tiny_hf_model
    from tests.runtime.test_model import _dequantized_copy, sqnr_db

    hf = tiny_hf_model("llama", seed=5, num_hidden_layers=1)  # the interpreter runs ~1 s per layer and call
    scheme = QuantScheme(bits, group_size, symmetric=bits == 4)
    for i, layer in enumerate(hf.model.layers):
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    w = child.weight.data
                    qw = act_order_weight(w, scheme, seed=i) if act_order else quantize_weight_rtn(w, scheme)
                    setattr(parent, name, QuantizedLinear.from_quantized_weight(qw, bias=child.bias))
    model = Transformer.from_hf(hf, dtype=torch.float16, device=DEVICE, kernels="triton")
    first = model.layers[0].attention.wqkv.parts[0]
    assert isinstance(first, TritonLinear) and (first.perm is not None) == act_order
    reference = _dequantized_copy(hf)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids, reference.new_cache(2, 12))
        cache = model.new_cache(2, 12)
        prefill = model(ids[:, :10], cache)  # 20 rows: the GEMM kernel
        decode = [model(ids[:, i : i + 1], cache) for i in (10, 11)]  # 2 rows: the GEMV kernel
    actual = torch.cat([prefill, *decode], dim=1).float().cpu()
    # fp16 activations between layers: ~3 significant digits per matmul.
    assert sqnr_db(expected, actual) > 30


def test_a_cuda_build_adds_the_residual_inside_the_next_norm(monkeypatch):
    """Each block's two residual adds ride in the norm after them (``lmpress::triton_add_rms_norm``, one launch
    for the add and the norm): per forward 2 x layers fused launches (the first norm has nothing to add) and one
    plain norm, and the logits those of the same model on the CPU's unfused ops."""
    from lmpress.runtime.kernels import cuda
    from lmpress.runtime.model import Transformer
    from tests.runtime.conftest import tiny_hf_model
    from tests.runtime.test_model import sqnr_db

    hf = tiny_hf_model("llama", seed=6, num_hidden_layers=2)
    calls = {"fused": 0, "plain": 0}
    fused, plain = cuda.triton_add_rms_norm, cuda.triton_rms_norm
    monkeypatch.setattr(
        cuda, "triton_add_rms_norm", lambda *a: calls.__setitem__("fused", calls["fused"] + 1) or fused(*a)
    )
    monkeypatch.setattr(cuda, "triton_rms_norm", lambda *a: calls.__setitem__("plain", calls["plain"] + 1) or plain(*a))
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model = Transformer.from_hf(hf, dtype=torch.float16, device=DEVICE, kernels="triton")
        actual = model(ids, model.new_cache(1, 8)).float().cpu()
        assert calls == {"fused": 4, "plain": 1}
        unfused = Transformer.from_hf(hf, dtype=torch.float32)
        expected = unfused(ids, unfused.new_cache(1, 8))
    assert sqnr_db(expected, actual) > 35
