"""Float32 rows times bfloat16 or float16 weights (kernels/cpu_half.py) against float64, and float32 CPU builds
keeping a checkpoint's half-precision weights as stored."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmpress.runtime.kernels import cpu_half, cpu_int
from lmpress.runtime.kernels.cpu_half import HalfWeightLinear

pytestmark = pytest.mark.skipif(not cpu_half.available(), reason="needs the C++ library and AVX2 or AVX-512")
# Every instruction set level this host runs (1 AVX2, 2 AVX-512): each is tested where it can run.
ISAS = [isa for isa in (1, 2) if cpu_half.available() and isa <= cpu_int.host_isa()]


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.double() @ weight.double().t()


HALVES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("out_features", [1, 6, 67])
def test_matches_float64_products_of_the_widened_weight(rows, out_features, half, isa):
    """Every row count the op splits into passes of 4, weight rows in fours and one at a time (67 = 16 x 4 + 3),
    with each instruction set's vectors (96 columns: three 32-column blocks, each two halves on AVX2)."""
    g = torch.Generator().manual_seed(rows * 100 + out_features)
    x = torch.randn(rows, 96, generator=g)
    weight = torch.randn(out_features, 96, generator=g).to(half)
    y = torch.ops.lmpress_cpu.half_linear(x, weight, isa)
    assert y.dtype == torch.float32 and y.shape == (rows, out_features)
    torch.testing.assert_close(y.double(), reference(x, weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("rows", [1, 3, 4, 7])
def test_one_weight_row_at_a_time_computes_what_four_at_once_do_bit_for_bit(rows, half, isa):
    """The probe's choice of weight rows at once (cpu_probe.py) moves no arithmetic: each row's sum is the same
    chain, whatever shares its pass (67 rows: four at once leave 3 to the one-row loop)."""
    g = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 160, generator=g), torch.randn(67, 160, generator=g).to(half)
    four = torch.ops.lmpress_cpu.half_linear(x, weight, isa, 4608, 4)
    one = torch.ops.lmpress_cpu.half_linear(x, weight, isa, 4608, 1)
    assert torch.equal(one, four)
    assert torch.equal(four, torch.ops.lmpress_cpu.half_linear(x, weight, isa))  # four: the op's default


@pytest.mark.parametrize("half", HALVES)
def test_the_op_traces_for_the_compiled_step(half):
    """Schema, fake (meta) implementation and autograd registration agree with the kernel, as torch.compile needs."""
    x, weight = torch.randn(2, 64), torch.randn(8, 64).to(half)
    for args in [(x, weight, ISAS[-1]), (x, weight, ISAS[-1], 1024, 1)]:  # the defaults, and every argument given
        torch.library.opcheck(torch.ops.lmpress_cpu.half_linear.default, args)


def test_refuses_shapes_and_instruction_sets_it_cannot_compute():
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.lmpress_cpu.half_linear(torch.randn(1, 48), torch.randn(4, 48).bfloat16(), 1)
    with pytest.raises(RuntimeError, match="bfloat16 or float16"):
        torch.ops.lmpress_cpu.half_linear(torch.randn(1, 64), torch.randn(4, 64), 1)
    with pytest.raises(RuntimeError, match="instruction set level 0"):
        torch.ops.lmpress_cpu.half_linear(torch.randn(1, 64), torch.randn(4, 64).bfloat16(), 0)
    with pytest.raises(RuntimeError, match="1 or 4 weight rows at once, not 3"):
        torch.ops.lmpress_cpu.half_linear(torch.randn(1, 64), torch.randn(4, 64).bfloat16(), 1, 0, 3)


def test_the_layer_runs_the_hosts_widest_vectors():
    layer = HalfWeightLinear(torch.zeros(8, 64, dtype=torch.bfloat16))
    assert layer.isa == cpu_int.host_isa() >= 1


@pytest.mark.parametrize("rows", [1, 4, HalfWeightLinear.FEW_ROWS + 1])
def test_layer_adds_its_bias_for_any_row_count(rows, monkeypatch):
    """Few rows run the op, more (a prefill) the weight widened 16 of its rows at a time here (3 blocks, the last
    short); both add the float32 bias."""
    monkeypatch.setattr(HalfWeightLinear, "WIDENED_BYTES", 16 * 64 * 4)
    g = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(40, 64, generator=g).bfloat16(), torch.randn(40, generator=g)
    layer = HalfWeightLinear(weight, bias)
    x = torch.randn(1, rows, 64, generator=g)
    expected = F.linear(x.double(), weight.double(), bias.double())
    assert layer.weight.dtype == torch.bfloat16 and layer.bias.dtype == torch.float32
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("family", "half"), [("qwen2", torch.bfloat16), ("mistral", torch.bfloat16), ("qwen2", torch.float16)]
)
def test_a_half_precision_checkpoint_keeps_its_weights_and_gives_the_widened_models_logits(tmp_path, family, half):
    """A bfloat16 (float16) checkpoint read in float32: its float layers and embedding stay as stored (half the
    bytes), a tied head shares the embedding's one tensor, and the logits are those of the same weights widened to
    float32. Qwen2 has biases and a tied head, Mistral an untied one."""
    from lmpress.runtime.checkpoint import load_checkpoint
    from lmpress.runtime.model import Transformer
    from tests.runtime.conftest import tiny_hf_model

    hf = tiny_hf_model(family, seed=5).to(half)
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path, torch.float32)
    dense = [m for m in model.modules() if isinstance(m, HalfWeightLinear)]
    assert len(dense) == 2 * 4 + 1  # per layer: q/k/v fused, o, gate/up fused, down; and the head
    assert model.tok_embeddings.weight.dtype == half
    if family == "qwen2":
        assert model.output.weight is model.tok_embeddings.weight
    widened = Transformer.from_hf(hf.float())
    assert all(p.dtype == torch.float32 for p in widened.parameters())
    tokens = torch.tensor([[3, 17, 99, 250, 4, 8]])
    with torch.inference_mode():
        torch.testing.assert_close(
            model(tokens, model.new_cache(1, 16)), widened(tokens, widened.new_cache(1, 16)), rtol=1e-4, atol=1e-4
        )


def test_a_float32_build_of_a_float32_checkpoint_is_unchanged(tmp_path):
    """Only half-precision weights stay as stored: a float32 checkpoint's layers are float32 as before."""
    from lmpress.runtime.checkpoint import load_checkpoint
    from tests.runtime.conftest import tiny_hf_model

    tiny_hf_model("llama", seed=5).save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path, torch.float32)
    assert not any(isinstance(m, HalfWeightLinear) for m in model.modules())
    assert model.tok_embeddings.weight.dtype == torch.float32


def test_a_draft_head_cut_to_part_of_the_vocabulary_keeps_bfloat16():
    """FR-Spec's cut (speculative.restrict_vocabulary) keeps the layer's kind and its rows' products."""
    from lmpress.runtime.kernels.cpu import output_rows

    g = torch.Generator().manual_seed(9)
    layer = HalfWeightLinear(torch.randn(50, 64, generator=g).bfloat16())
    rows = torch.tensor([0, 7, 31, 49])
    cut = output_rows(layer, rows)
    x = torch.randn(1, 64, generator=g)
    assert isinstance(cut, HalfWeightLinear)
    torch.testing.assert_close(cut(x), layer(x)[:, rows])


def test_only_float32_cpu_builds_keep_half_precision_weights():
    """GPU builds (their own kernels), the reference kernels and bfloat16 or float16 builds widen or cast as before;
    a width the op cannot take (not a multiple of 32) is widened too."""
    from lmpress.runtime.linears import Build

    weight = torch.zeros(8, 64, dtype=torch.bfloat16)
    assert Build(torch.float32, "cpu").dense_dtype(weight) == torch.bfloat16
    assert Build(torch.float32, "cuda").dense_dtype(weight) == torch.float32
    assert Build(torch.float32, "reference").dense_dtype(weight) == torch.float32
    assert Build(torch.float16, "cpu").dense_dtype(weight) == torch.float16
    assert Build(torch.float32, "cpu").dense_dtype(torch.zeros(8, 48, dtype=torch.bfloat16)) == torch.float32
    assert Build(torch.float32, "cpu").dense_dtype(weight.half()) == torch.float16
