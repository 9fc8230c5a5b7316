import numpy as np
import pytest
import torch

from lmpress.weights.pack import (
    AWQ_PACK_ORDER,
    awq_pack,
    awq_unpack,
    gptq_pack_qweight,
    gptq_pack_qzeros,
    gptq_unpack_qweight,
    gptq_unpack_qzeros,
    pack_int32,
    unpack_int32,
)


def codes(shape, bits, seed=0):
    return torch.randint(0, 2**bits, shape, generator=torch.Generator().manual_seed(seed))


def as_uint32(words: torch.Tensor) -> np.ndarray:
    return words.numpy().astype(np.int64) & 0xFFFFFFFF


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("length", [7, 32, 96, 100])
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("rows", [5, 1])  # one row: a size-1 dim whose stride torch leaves arbitrary
def test_unpack_inverts_pack(bits, length, dim, rows):
    c = codes((rows, length) if dim == 1 else (length, rows), bits)
    packed = pack_int32(c, bits, dim=dim)
    assert packed.dtype == torch.int32
    assert packed.shape[dim] == -(-length * bits // 32)
    assert torch.equal(unpack_int32(packed, bits, length, dim=dim), c.to(torch.uint8))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_whole_word_widths_put_code_j_at_bit_bits_times_j(bits):
    c = codes((3, 64), bits, seed=1)
    words = as_uint32(pack_int32(c, bits))
    per_word = 32 // bits
    for row in range(3):
        for w in range(words.shape[1]):
            expected = sum(int(c[row, w * per_word + j]) << (bits * j) for j in range(per_word))
            assert words[row, w] == expected


def gptq_3bit_reference(intweight: np.ndarray) -> np.ndarray:
    """GPTQ's 3-bit packing loop (AutoGPTQ / GPTQModel ``pack``), on (in, out) codes."""
    qweight = np.zeros((intweight.shape[0] // 32 * 3, intweight.shape[1]), dtype=np.uint64)
    intweight = intweight.astype(np.uint64)
    i = row = 0
    while row < qweight.shape[0]:
        for j in range(i, i + 10):
            qweight[row] |= intweight[j] << np.uint64(3 * (j - i))
        i += 10
        qweight[row] |= intweight[i] << np.uint64(30)
        row += 1
        qweight[row] |= (intweight[i] >> np.uint64(2)) & np.uint64(1)
        i += 1
        for j in range(i, i + 10):
            qweight[row] |= intweight[j] << np.uint64(3 * (j - i) + 1)
        i += 10
        qweight[row] |= intweight[i] << np.uint64(31)
        row += 1
        qweight[row] |= (intweight[i] >> np.uint64(1)) & np.uint64(3)
        i += 1
        for j in range(i, i + 10):
            qweight[row] |= intweight[j] << np.uint64(3 * (j - i) + 2)
        i += 10
        row += 1
    return (qweight & np.uint64(0xFFFFFFFF)).astype(np.int64)


def test_gptq_3bit_qweight_matches_gptq_packing_loop():
    c = codes((16, 64), 3, seed=2)  # (out, in)
    packed = gptq_pack_qweight(c, 3)
    assert packed.shape == (6, 16)
    assert np.array_equal(as_uint32(packed), gptq_3bit_reference(c.t().numpy()))
    assert torch.equal(gptq_unpack_qweight(packed, 3, 64), c.to(torch.uint8))


def test_gptq_v1_qzeros_store_zero_minus_one():
    zeros = torch.full((16, 2), 8)  # symmetric 4-bit: stored 7 in every nibble
    packed = gptq_pack_qzeros(zeros, 4, v1=True)
    assert packed.shape == (2, 2)
    assert (as_uint32(packed) == 0x77777777).all()
    assert torch.equal(gptq_unpack_qzeros(packed, 4, 16, v1=True), zeros.to(torch.int16))
    v2 = gptq_pack_qzeros(zeros, 4, v1=False)
    assert (as_uint32(v2) == 0x88888888).all()


def test_awq_word_holds_columns_in_interleaved_order():
    row = torch.arange(8)[None, :]  # column c holds code c
    word = int(as_uint32(awq_pack(row))[0, 0])
    nibbles = [(word >> (4 * i)) & 0xF for i in range(8)]
    assert nibbles == list(AWQ_PACK_ORDER)
    c = codes((4, 24), 4, seed=3)
    assert torch.equal(awq_unpack(awq_pack(c)), c.to(torch.uint8))


def test_out_of_range_codes_and_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="out of range"):
        pack_int32(torch.tensor([[16]]), 4)
    with pytest.raises(ValueError, match="cannot pack 5-bit"):
        pack_int32(torch.zeros(1, 8, dtype=torch.long), 5)
    with pytest.raises(ValueError, match="cannot hold exactly"):
        unpack_int32(torch.zeros(1, 2, dtype=torch.int32), 4, 8)
    with pytest.raises(ValueError, match="multiple of 8"):
        awq_pack(torch.zeros(1, 12, dtype=torch.long))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_words_equal_compressed_tensors_pack_to_int32(bits, dim):
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    c = codes((6, 70) if dim == 1 else (70, 6), bits, seed=4)
    signed = (c - 2 ** (bits - 1)).to(torch.int8)  # compressed-tensors packs signed codes
    assert torch.equal(pack_int32(c, bits, dim=dim), helpers.pack_to_int32(signed, bits, packed_dim=dim))
