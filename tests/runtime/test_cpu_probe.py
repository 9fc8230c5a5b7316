"""The per-host probe of the CPU kernels (kernels/cpu_probe.py): every candidate it may choose computes what the
others do, the choice is one of them and is kept per host, and small weights are not timed."""

from __future__ import annotations

import pytest
import torch

from lmpress.runtime.kernels import cpu_half, cpu_int, cpu_probe, tuning

pytestmark = pytest.mark.skipif(not cpu_int.available(), reason="the C++ kernels do not build on this host")


def layer(kind: str, out: int, k: int, **variant: int) -> torch.nn.Module:
    if kind == "half":
        w = torch.randn(out, k, generator=torch.Generator().manual_seed(0)).bfloat16()
        return cpu_half.HalfWeightLinear(w, **variant)
    kernel = cpu_int.W4A8Linear if kind == "w4" else cpu_int.W8A8RowLinear
    return kernel(*weight(kind, out, k), None, **variant)


def weight(kind: str, out: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    bits, groups = (4, k // 64) if kind == "w4" else (8, 1)
    codes = torch.randint(0, 2**bits, (out, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(out, groups, generator=g) * 0.05 + 0.01
    zeros = torch.randint(0, 2**bits, (out, groups), generator=g).float()
    return codes, scales, zeros


@pytest.mark.parametrize("kind", ["w4", "w8", "half"])
def test_every_candidate_computes_the_same_outputs(kind):
    # Rows of weights past one prefetch distance and a partial last tile (200 rows: not a multiple of the half op's
    # 4 at once): a prefetch past the end never faults, and within a level neither the distance nor the weight rows
    # at once move any arithmetic, so the outputs are equal bit for bit.
    if kind == "half" and not cpu_half.available():
        pytest.skip("the half-precision op needs AVX2")
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
    outputs = {}
    half_rows = cpu_half.ROWS_PER_PASS if kind == "half" else ()
    for isa, prefetch, *rows_at_once in cpu_probe.candidates(cpu_int.host_isa(), rows=half_rows):
        at_once = {"rows": rows_at_once[0]} if rows_at_once else {}
        variant = layer(kind, 200, 512, isa=isa, prefetch=prefetch, **at_once)
        for rows in (1, 3):
            outputs[(isa, prefetch, *rows_at_once, rows)] = variant(x[:rows])
    default_rows = half_rows[:1]
    for (isa, prefetch, *rows_at_once, rows), y in outputs.items():
        same_level = outputs[(isa, cpu_probe.DEFAULT_PREFETCH, *default_rows, rows)]
        assert torch.equal(y, same_level), (isa, prefetch, rows_at_once, rows)
        first = outputs[(cpu_int.host_isa(), cpu_probe.DEFAULT_PREFETCH, *default_rows, rows)]
        torch.testing.assert_close(y, first, rtol=1e-4, atol=1e-4)
    if half_rows:  # the layer's own default is the op's four rows at once
        assert layer(kind, 8, 512).rows == half_rows[0] == 4


def test_the_ops_reject_a_negative_prefetch():
    wrong = layer("w4", 16, 64, isa=1 if cpu_int.host_isa() >= 1 else 0, prefetch=-1)
    with pytest.raises(RuntimeError, match="prefetch: 0 to 1 MiB ahead"):
        wrong(torch.randn(1, 64))


def test_the_probe_chooses_a_candidate_once_per_host_and_shape(tmp_path, monkeypatch):
    monkeypatch.setenv("LMPRESS_TUNE_CACHE", str(tmp_path / "tuning.json"))
    monkeypatch.setattr(cpu_probe, "PROBE_BYTES", 2**20)  # a short probe: the choice, not its speed, is tested
    tuning.forget_in_memory()
    timed = []
    real = cpu_probe.time_candidates
    monkeypatch.setattr(cpu_probe, "time_candidates", lambda *a: timed.append(a[1:3]) or real(*a))
    chosen = cpu_probe.choose_int8_kernel(cpu_int.W4A8Linear, 1024, 576, 9)  # 288 KiB of codes: probed
    assert [chosen.isa, chosen.prefetch] in cpu_probe.candidates(cpu_int.host_isa())
    assert set(timed) == {(576, 1024 * 576 // 2)} and len(timed) in (1, 2)  # twice where a challenger won
    probes = len(timed)
    assert tuning.cache_path() == tmp_path / "tuning.json" and tuning.cache_path().is_file()
    tuning.forget_in_memory()  # a new process: read from the cache, not timed again
    assert cpu_probe.choose_int8_kernel(cpu_int.W4A8Linear, 1024, 576, 9) == chosen
    assert len(timed) == probes
    if cpu_half.available():  # the half-precision head's own probe, kept beside it
        head = cpu_probe.choose_half_kernel(256, 576, torch.bfloat16)
        tried = cpu_probe.candidates(cpu_int.host_isa(), cpu_probe.HALF_DEFAULT_PREFETCH, cpu_half.ROWS_PER_PASS)
        assert head.rows in cpu_half.ROWS_PER_PASS and head.candidate() in tried
        assert timed[-1] == (576, 256 * 576 * 2)
    tuning.forget_in_memory()


def test_the_runtime_builds_its_layers_with_the_probed_choice(monkeypatch):
    """Where the runtime puts a 4-bit layer on the int8 kernel (or keeps a bfloat16 weight for the half op), the
    module runs the variant the probe chose for its shape."""
    from lmpress.runtime.kernels.cpu import int8_activation_kernel
    from lmpress.runtime.linears import Build
    from lmpress.weights.qlinear import QuantizedLinear
    from lmpress.weights.scheme import QuantScheme, quantize_weight_rtn

    picked = cpu_probe.KernelChoice(1 if cpu_int.host_isa() >= 1 else 0, 1024)
    picked_half = cpu_probe.KernelChoice(picked.isa, 1024, 1)
    asked = []
    monkeypatch.setattr(cpu_probe, "choose_int8_kernel", lambda *a: asked.append(a) or picked)
    monkeypatch.setattr(cpu_probe, "choose_half_kernel", lambda *a: asked.append(a) or picked_half)
    import lmpress.runtime.kernels.cpu as cpu_kernels

    monkeypatch.setattr(cpu_kernels, "choose_int8_kernel", cpu_probe.choose_int8_kernel)
    scheme = QuantScheme(bits=4, group_size=64, symmetric=True)
    weight = torch.randn(128, 256, generator=torch.Generator().manual_seed(0))
    layer = QuantizedLinear.from_quantized_weight(quantize_weight_rtn(weight, scheme))
    module = int8_activation_kernel(layer, None, "int8")
    assert (module.isa, module.prefetch) == (picked.isa, picked.prefetch)
    assert asked[-1] == (cpu_int.W4A8Linear, 128, 256, 4)
    if cpu_half.available():
        half = Build(torch.float32).dense(weight.bfloat16(), None)
        assert (half.isa, half.prefetch, half.rows) == (picked.isa, 1024, 1)
        assert asked[-1] == (128, 256, torch.bfloat16)


def test_small_weights_and_the_off_space_take_the_defaults(monkeypatch):
    monkeypatch.setattr(cpu_probe, "time_candidates", lambda *a: pytest.fail("timed"))
    small = layer("w8", 64, 128)
    assert (small.isa, small.prefetch) == (cpu_int.host_isa(), cpu_probe.DEFAULT_PREFETCH)
    monkeypatch.setattr(tuning, "_space", "off")
    big = cpu_probe.choose_int8_kernel(cpu_int.W8A8RowLinear, 4096, 576, 1)
    assert big == cpu_probe.KernelChoice(cpu_int.host_isa(), cpu_probe.DEFAULT_PREFETCH)
    head = cpu_probe.choose_half_kernel(49152, 576, torch.bfloat16)
    assert head == cpu_probe.KernelChoice(cpu_int.host_isa(), cpu_probe.HALF_DEFAULT_PREFETCH, 4)


def test_the_cache_attention_level_is_probed_per_stored_type_once_per_host(tmp_path, monkeypatch):
    """On an AVX-512 host each stored type (float32, int8, FP8, INT4) gets the faster of the op's two bodies, kept in
    the tuning cache (a new process reads it); the default (AVX-512) unless the other is MARGIN faster."""
    if cpu_int.host_isa() != 2:
        pytest.skip("only an AVX-512 host has two levels to choose from")
    monkeypatch.setenv("LMPRESS_TUNE_CACHE", str(tmp_path / "tuning.json"))
    tuning.forget_in_memory()
    timed = []
    fake = {"float32": {2: 1.0, 1: 0.9}, "int8": {2: 1.0, 1: 0.97}, "fp8": {2: 1.0, 1: 1.1}, "int4": {2: 1, 1: 0.8}}
    monkeypatch.setattr(cpu_probe, "time_kv_attention", lambda *a: timed.append(a[3]) or fake[a[3]])
    assert cpu_probe.kv_attention_levels(3, 3, 64) == (1, 2, 2, 1)  # AVX2 wins float32 and INT4
    probed = ["float32", "float32", "int8", "fp8", "int4", "int4"]  # each winner timed again beside the default
    assert timed == probed
    tuning.forget_in_memory()  # a new process: read from the cache, not timed again
    assert cpu_probe.kv_attention_levels(3, 3, 64) == (1, 2, 2, 1)
    assert timed == probed
    tuning.forget_in_memory()


def test_the_cache_attention_probe_times_each_level_over_every_stored_type(monkeypatch):
    """The real timing: every candidate level of every stored type is timed (seconds, positive)."""
    if cpu_int.host_isa() != 2:
        pytest.skip("only an AVX-512 host has two levels to choose from")
    monkeypatch.setattr(cpu_probe, "PROBE_BYTES", 2**20)
    for stored in cpu_probe.KV_STORED:
        times = cpu_probe.time_kv_attention(3, 3, 64, stored, [[2], [1]])
        assert set(times) == {1, 2} and all(0 < t < 1 for t in times.values()), (stored, times)


def test_the_cache_attention_level_defaults_where_nothing_is_probed(monkeypatch):
    monkeypatch.setattr(cpu_probe, "time_kv_attention", lambda *a: pytest.fail("timed"))
    assert cpu_probe.kv_attention_levels(2, 2, 16) == (-1, -1, -1, -1)  # the tests' tiny caches
    monkeypatch.setattr(tuning, "_space", "off")
    assert cpu_probe.kv_attention_levels(3, 3, 64) == (-1, -1, -1, -1)


def test_the_static_step_runs_the_cache_attention_at_the_probed_level(monkeypatch):
    """attend hands the op the level the layer's probe chose for what its cache stores."""
    from lmpress.runtime import attention
    from lmpress.runtime.kernels import cpu_kv_attention
    from lmpress.runtime.kv_cache import StaticSlots

    if not cpu_kv_attention.available():
        pytest.skip("the cache attention op needs AVX2")
    levels = []
    real = cpu_kv_attention.kv_slots_attention
    monkeypatch.setattr(cpu_kv_attention, "kv_slots_attention", lambda *a: levels.append(a[7]) or real(*a))
    kernel = attention.SlotsKernel(True, True, levels=(1, -1, -1, -1))
    q, keys, values = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    slots = StaticSlots([keys], [values], torch.tensor([7]), ([], [], []), None, None)
    mask = torch.ones(1, 1, 1, 8, dtype=torch.bool)
    out = attention.slots_attention(q, mask, slots, 0, slots_kernel=kernel)
    assert levels == [1] and out.shape == (1, 4, 1, 16)
    expected = attention.pointwise_attention(q, keys, values, mask, 16**-0.5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("again", "kept"), [({"fast": 0.8, "default": 1.0}, "fast"), ({"fast": 0.97, "default": 1.0}, "default")]
)
def test_a_challenger_is_kept_only_if_it_wins_again_beside_the_default(again, kept):
    """A candidate that beat the default by MARGIN in the probe is timed again alone beside it: a busy moment's win
    that does not hold there leaves the default."""
    calls = []

    def timed(candidates):
        calls.append([c[0] for c in candidates])
        return {"default": 1.0, "fast": 0.8, "slow": 1.2} if len(calls) == 1 else again

    tried = [["default"], ["fast"], ["slow"]]
    times = cpu_probe.confirmed_times(timed, tried, lambda candidate: candidate[0])
    assert calls == [["default", "fast", "slow"], ["fast", "default"]]
    assert min(tried, key=lambda candidate: times[candidate[0]])[0] == kept
    calls.clear()  # a default that wins, or a challenger under MARGIN, is not timed again
    close = {"default": 1.0, "fast": 0.97, "slow": 1.2}
    cpu_probe.confirmed_times(lambda c: calls.append(c) or close, tried, lambda candidate: candidate[0])
    assert len(calls) == 1
