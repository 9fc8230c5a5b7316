"""Integer codes <-> int32 words, in the layouts the checkpoint formats use.

Every format here packs codes as one little-endian bit stream per row: code ``i``
of a row occupies bits ``i*bits .. i*bits+bits-1`` of the stream, and word ``w``
holds stream bits ``32*w .. 32*w+31``. For 2, 4 and 8 bits that is "32/bits codes
per word, lowest bits first"; for 3 bits, codes 10 and 21 of every 32 straddle two
words, which is how GPTQ (AutoGPTQ, GPTQModel) and compressed-tensors pack them.

The formats differ in which axis is packed and in what codes mean:

- GPTQ: ``qweight`` ``(in*bits/32, out)`` packed along the input axis; ``qzeros``
  ``(n_groups, ceil(out*bits/32))`` packed along the output axis; checkpoint
  format ``gptq`` (v1) stores ``zero - 1``, ``gptq_v2`` stores ``zero``.
- AWQ GEMM (4-bit): ``qweight`` ``(in, out/8)`` and ``qzeros`` ``(n_groups, out/8)``
  packed along the output axis, each word's 8 codes interleaved in the order
  ``AWQ_PACK_ORDER``.
- compressed-tensors pack-quantized: ``weight_packed`` ``(out, ceil(in*bits/32))``
  along the input axis and ``weight_zero_point`` ``(ceil(out*bits/32), n_groups)``
  along the output axis; its signed codes ``c - 2**(bits-1)`` pack to the same
  words as the unsigned codes ``c`` used here.

Codes are unsigned integers in ``[0, 2**bits)`` held in any integer dtype.
"""

from __future__ import annotations

import math
import sys

import torch

WORD_BITS = 32
# Position i of an AWQ word holds the code of column AWQ_PACK_ORDER[i] of its 8 columns.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_UNPACK_ORDER = tuple(AWQ_PACK_ORDER.index(c) for c in range(8))
PACKABLE_BITS = (2, 3, 4, 8)


def packed_length(length: int, bits: int) -> int:
    """Number of int32 words that hold ``length`` codes of ``bits`` bits."""
    return math.ceil(length * bits / WORD_BITS)


def _check_bits(bits: int) -> None:
    if bits not in PACKABLE_BITS:
        raise ValueError(f"cannot pack {bits}-bit codes; supported: {PACKABLE_BITS}")


def _to_int32_words(words: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> int32 with the same 32 bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _stream_positions(bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For the 32 codes of one block (``bits`` words): each code's word and bit offset."""
    starts = torch.arange(WORD_BITS, device=device, dtype=torch.int64) * bits
    return starts // WORD_BITS, starts % WORD_BITS


def pack_int32(codes: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """Pack unsigned ``bits``-bit codes of a 2-D tensor into int32 words along ``dim``."""
    _check_bits(bits)
    if codes.dim() != 2:
        raise ValueError(f"pack_int32 expects a 2-D tensor, got shape {tuple(codes.shape)}")
    low, high = map(int, torch.aminmax(codes)) if codes.numel() else (0, 0)
    if low < 0 or high >= 2**bits:
        raise ValueError(f"codes out of range for {bits} bits: [{low}, {high}]")
    if bits == 8 and sys.byteorder == "little":
        # Each byte of a little-endian word is one code, lowest first (no wide temporaries for big layers).
        values = codes.movedim(dim, -1).to(torch.uint8)
        values = torch.nn.functional.pad(values, (0, -values.shape[1] % 4)).contiguous()
        words = values.reshape(-1).view(torch.int32).reshape(values.shape[0], -1)  # flat: strides of size-1 dims
        return words.movedim(-1, dim).contiguous()
    if bits in (2, 4) and sys.byteorder == "little":
        # A little-endian word's bytes hold its codes in order, lowest bits first: pack bytes, view them as words
        # (2.5-3x the speed of the int32 shifts below, one thread).
        per_byte = 8 // bits
        values = codes.movedim(dim, -1).to(torch.uint8)
        values = torch.nn.functional.pad(values, (0, -values.shape[1] % (4 * per_byte)))
        values = values.reshape(values.shape[0], -1, per_byte)
        packed = values[..., 0].clone()
        for k in range(1, per_byte):
            packed |= values[..., k] << (k * bits)
        words = packed.contiguous().reshape(-1).view(torch.int32).reshape(values.shape[0], -1)
        return words.movedim(-1, dim).contiguous()
    if WORD_BITS % bits == 0:
        # No code straddles a word: OR each code, shifted to its place, into its word (int32 throughout;
        # the top code's shift wraps into the sign bit, which is the bit pattern the word needs).
        per_word = WORD_BITS // bits
        values = codes.movedim(dim, -1).to(torch.int32)
        values = torch.nn.functional.pad(values, (0, -values.shape[1] % per_word))
        shifts = torch.arange(0, WORD_BITS, bits, dtype=torch.int32, device=values.device)
        shifted = values.reshape(values.shape[0], -1, per_word) << shifts
        words = shifted[..., 0].clone()
        for k in range(1, per_word):
            words |= shifted[..., k]
        return words.movedim(-1, dim).contiguous()
    values = codes.movedim(dim, -1).to(torch.int64)
    rows, length = values.shape
    padded = math.ceil(length / WORD_BITS) * WORD_BITS
    values = torch.nn.functional.pad(values, (0, padded - length)).reshape(rows, -1, WORD_BITS)
    word, offset = _stream_positions(bits, values.device)
    words = torch.zeros(rows, values.shape[1], bits + 1, dtype=torch.int64, device=values.device)
    # Low part of each code goes to its own word; the bits past bit 31 spill into the next one.
    words.index_add_(2, word, (values << offset) & 0xFFFFFFFF)
    spill = offset + bits > WORD_BITS
    if spill.any():
        words.index_add_(2, word[spill] + 1, values[..., spill] >> (WORD_BITS - offset[spill]))
    words = words[..., :bits].reshape(rows, -1)[:, : packed_length(length, bits)]
    return _to_int32_words(words).movedim(-1, dim).contiguous()


def unpack_int32(packed: torch.Tensor, bits: int, length: int, dim: int = -1) -> torch.Tensor:
    """Inverse of ``pack_int32``: ``length`` codes along ``dim``, as uint8."""
    _check_bits(bits)
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"unpack_int32 expects a 2-D int32 tensor, got {packed.dtype} {tuple(packed.shape)}")
    words = packed.movedim(dim, -1)
    rows, n_words = words.shape
    if n_words != packed_length(length, bits):
        raise ValueError(f"{n_words} words cannot hold exactly {length} codes of {bits} bits")
    if bits == 8 and sys.byteorder == "little":
        # Each byte of a little-endian word is one code, lowest first: the words' bytes are the codes.
        codes = words.contiguous().reshape(-1).view(torch.uint8).reshape(rows, -1)[:, :length]
        return codes.movedim(-1, dim).contiguous()
    if bits in (2, 4) and sys.byteorder == "little":
        # The words' bytes each hold 8 / bits codes, lowest bits first: each code position of every byte is written
        # in one pass into its slot of the output (uint8 throughout; 2.6x a broadcast shift, 3.5x int32 shifts).
        data = words.contiguous().reshape(-1).view(torch.uint8).reshape(rows, -1)
        per_byte, mask = 8 // bits, 2**bits - 1
        codes = torch.empty(rows, data.shape[1], per_byte, dtype=torch.uint8, device=words.device)
        torch.bitwise_and(data, mask, out=codes[..., 0])
        for k in range(1, per_byte):
            torch.bitwise_and(data >> (k * bits), mask, out=codes[..., k])
        return codes.reshape(rows, -1)[:, :length].movedim(-1, dim).contiguous()
    if WORD_BITS % bits == 0:
        # No code straddles a word: shift each word by every code position at once.
        shifts = torch.arange(0, WORD_BITS, bits, dtype=torch.int32, device=words.device)
        codes = (words.unsqueeze(-1) >> shifts) & (2**bits - 1)
        return codes.reshape(rows, -1)[:, :length].to(torch.uint8).movedim(-1, dim).contiguous()
    if bits == 3 and sys.byteorder == "little":
        # 3 bytes of the little-endian stream hold exactly 8 codes: read them a byte triple at a time.
        padded = torch.nn.functional.pad(words, (0, -n_words % 3)).contiguous()
        triples = padded.view(torch.uint8).reshape(rows, -1, 3).to(torch.int32)
        stream = triples[..., 0] | (triples[..., 1] << 8) | (triples[..., 2] << 16)
        shifts = torch.arange(0, 24, 3, dtype=torch.int32, device=words.device)
        codes = (stream.unsqueeze(-1) >> shifts) & 0x7
        return codes.reshape(rows, -1)[:, :length].to(torch.uint8).movedim(-1, dim).contiguous()
    words = words.to(torch.int64) & 0xFFFFFFFF
    n_blocks = math.ceil(n_words / bits)
    words = torch.nn.functional.pad(words, (0, n_blocks * bits - n_words + 1)).reshape(rows, -1)
    word, offset = _stream_positions(bits, words.device)
    index = (torch.arange(n_blocks, device=words.device)[:, None] * bits + word).reshape(-1)
    offset = offset.repeat(n_blocks)
    # Read 64 bits starting at each code's word so a code that straddles two words comes out whole.
    window = words[:, index] | (words[:, index + 1] << WORD_BITS)
    codes = (window >> offset) & (2**bits - 1)
    return codes[:, :length].to(torch.uint8).movedim(-1, dim).contiguous()


# GPTQ ---------------------------------------------------------------------------------------


def gptq_pack_qweight(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``(out, in)`` codes -> GPTQ ``qweight`` ``(in*bits/32, out)``."""
    if codes.shape[1] * bits % WORD_BITS:
        raise ValueError(f"GPTQ qweight needs in_features*bits divisible by 32, got {codes.shape[1]}x{bits}")
    return pack_int32(codes, bits, dim=1).t().contiguous()


def gptq_unpack_qweight(qweight: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """GPTQ ``qweight`` -> ``(out, in)`` uint8 codes."""
    return unpack_int32(qweight.t(), bits, in_features, dim=1)


def gptq_pack_qzeros(zeros: torch.Tensor, bits: int, v1: bool = True) -> torch.Tensor:
    """``(out, n_groups)`` integer zeros -> GPTQ ``qzeros`` ``(n_groups, ceil(out*bits/32))``.

    v1 (checkpoint_format "gptq") stores ``zero - 1``, wrapped to ``bits`` bits as
    GPTQ always did; a zero of 0 therefore cannot be stored in v1.
    """
    stored = zeros.to(torch.int64).t()
    if v1:
        stored = (stored - 1) & (2**bits - 1)
    return pack_int32(stored, bits, dim=1)


def gptq_unpack_qzeros(qzeros: torch.Tensor, bits: int, out_features: int, v1: bool = True) -> torch.Tensor:
    """GPTQ ``qzeros`` -> ``(out, n_groups)`` integer zeros (int16: v1 zeros reach 2**bits)."""
    stored = unpack_int32(qzeros, bits, out_features, dim=1).to(torch.int16)
    return (stored + 1 if v1 else stored).t().contiguous()


# AWQ GEMM -----------------------------------------------------------------------------------


def _awq_order(n_columns: int, order: tuple[int, ...], device: torch.device) -> torch.Tensor:
    if n_columns % 8:
        raise ValueError(f"AWQ GEMM packs 8 output columns per word; {n_columns} is not a multiple of 8")
    base = torch.arange(n_columns, device=device).reshape(-1, 8)
    return base[:, list(order)].reshape(-1)


def awq_pack(codes_in_out: torch.Tensor) -> torch.Tensor:
    """4-bit codes laid out ``(rows, out)`` -> AWQ words ``(rows, out/8)``.

    Used for both ``qweight`` (rows = in_features) and ``qzeros`` (rows = groups).
    """
    interleaved = codes_in_out[:, _awq_order(codes_in_out.shape[1], AWQ_PACK_ORDER, codes_in_out.device)]
    return pack_int32(interleaved, 4, dim=1)


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """AWQ words ``(rows, out/8)`` -> 4-bit codes ``(rows, out)`` as uint8."""
    interleaved = unpack_int32(packed, 4, packed.shape[1] * 8, dim=1)
    return interleaved[:, _awq_order(interleaved.shape[1], AWQ_UNPACK_ORDER, packed.device)].contiguous()


# compressed-tensors pack-quantized ----------------------------------------------------------


def ct_pack_weight(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``(out, in)`` codes -> ``weight_packed`` ``(out, ceil(in*bits/32))``."""
    return pack_int32(codes, bits, dim=1)


def ct_unpack_weight(weight_packed: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    return unpack_int32(weight_packed, bits, in_features, dim=1)


def ct_pack_zero_point(zeros: torch.Tensor, bits: int) -> torch.Tensor:
    """``(out, n_groups)`` unsigned zeros -> ``weight_zero_point`` ``(ceil(out*bits/32), n_groups)``."""
    return pack_int32(zeros.to(torch.int64), bits, dim=0)


def ct_unpack_zero_point(packed: torch.Tensor, bits: int, out_features: int) -> torch.Tensor:
    return unpack_int32(packed, bits, out_features, dim=0)
