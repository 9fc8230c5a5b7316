"""GGML's block layouts lmpress writes and reads: Q4_0, Q8_0, Q4_K and MXFP4, as pure array functions.

Byte for byte what llama.cpp's ``ggml-quants.c`` (``block_q4_0``, ``block_q8_0``,
``block_q4_K``, ``block_mxfp4``) and the ``gguf`` package's ``quants.py`` read; which lmpress weights map onto
which block is ``gguf.py``'s business.
"""

from __future__ import annotations

import numpy as np
import torch

from lmpress.weights.kquant import GROUPS_PER_SUPER_BLOCK, SUPER_BLOCK

BLOCK = 32  # columns per Q4_0 / Q8_0 block
Q4_0_BYTES = 2 + BLOCK // 2
Q8_0_BYTES = 2 + BLOCK
K_SCALE_BYTES = 12  # eight 6-bit scales and eight 6-bit mins
Q4_K_BYTES = 2 + 2 + K_SCALE_BYTES + SUPER_BLOCK // 2
MXFP4_BYTES = 1 + BLOCK // 2  # one E8M0 exponent, 32 E2M1 codes


def pack_q4_0(codes: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """Q4_0 blocks of ``codes`` (uint8 ``(rows, cols)`` in [0, 15]) with float16 ``scales`` ``(rows, cols/32)``.

    Each block: ``d`` (float16, little-endian), then byte ``j`` holds code ``j`` in its low
    nibble and code ``j + 16`` in its high nibble. Returns uint8 ``(rows, cols/32*18)``.
    """
    rows, cols = codes.shape
    q = codes.to(torch.uint8).reshape(rows, cols // BLOCK, BLOCK).numpy()
    nibbles = q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << np.uint8(4))
    d = scales.to(torch.float16).reshape(rows, cols // BLOCK, 1).numpy().astype("<f2").view(np.uint8)
    return np.concatenate([d, nibbles], axis=-1).reshape(rows, -1)


def unpack_q4_0(blocks: np.ndarray, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 ``(rows, cols)``, float16 scales ``(rows, cols/32)``) of Q4_0 ``blocks``."""
    b = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1, cols // BLOCK, Q4_0_BYTES)
    d = b[..., :2].copy().view("<f2")[..., 0]
    nibbles = b[..., 2:]
    q = np.concatenate([nibbles & np.uint8(0x0F), nibbles >> np.uint8(4)], axis=-1)
    return torch.from_numpy(q.reshape(-1, cols).copy()), torch.from_numpy(d.astype(np.float16))


def pack_q8_0(codes: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """Q8_0 blocks of ``codes`` (uint8 ``(rows, cols)``, zero point 128) with float16 ``scales``."""
    rows, cols = codes.shape
    q = (codes.to(torch.int16) - 128).to(torch.int8).reshape(rows, cols // BLOCK, BLOCK).numpy().view(np.uint8)
    d = scales.to(torch.float16).reshape(rows, cols // BLOCK, 1).numpy().astype("<f2").view(np.uint8)
    return np.concatenate([d, q], axis=-1).reshape(rows, -1)


def unpack_q8_0(blocks: np.ndarray, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 ``(rows, cols)`` with zero point 128, float16 scales) of Q8_0 ``blocks``."""
    b = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1, cols // BLOCK, Q8_0_BYTES)
    d = b[..., :2].copy().view("<f2")[..., 0]
    q = b[..., 2:].copy().view(np.int8).astype(np.int16) + 128
    return torch.from_numpy(q.reshape(-1, cols).astype(np.uint8)), torch.from_numpy(d.astype(np.float16))


def pack_q4_k(
    codes: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, m: torch.Tensor
) -> np.ndarray:
    """Q4_K blocks: ``codes`` uint8 ``(rows, cols)`` in [0, 15]; per 256 columns float16 ``d`` and ``dmin``
    ``(rows, cols/256)`` and 6-bit ``sc``, ``m`` ``(rows, cols/256, 8)``. Returns uint8 ``(rows, cols/256*144)``.

    Each block: ``d``, ``dmin`` (float16, little-endian); 12 bytes of scales as llama.cpp's
    ``get_scale_min_k4`` reads them (bytes 0-3: ``sc_0..3`` in the low 6 bits, the top 2 bits of
    ``sc_4..7`` above; bytes 4-7: the same for the mins; bytes 8-11: the low 4 bits of ``sc_4..7``,
    the low 4 bits of ``m_4..7`` above); then per 64 columns 32 bytes, the first 32 codes in the
    low nibbles and the next 32 in the high nibbles.
    """
    rows, cols = codes.shape
    n = rows * (cols // SUPER_BLOCK)
    q = codes.to(torch.uint8).numpy().reshape(n, SUPER_BLOCK // 64, 2, 32)
    nibbles = (q[:, :, 0] | (q[:, :, 1] << np.uint8(4))).reshape(n, SUPER_BLOCK // 2)
    sc8 = sc.to(torch.uint8).numpy().reshape(n, GROUPS_PER_SUPER_BLOCK)
    m8 = m.to(torch.uint8).numpy().reshape(n, GROUPS_PER_SUPER_BLOCK)
    high = np.uint8(4)
    scales = np.concatenate(
        [
            sc8[:, :4] | ((sc8[:, 4:] >> high) << np.uint8(6)),
            m8[:, :4] | ((m8[:, 4:] >> high) << np.uint8(6)),
            (sc8[:, 4:] & np.uint8(0x0F)) | ((m8[:, 4:] & np.uint8(0x0F)) << high),
        ],
        axis=-1,
    )
    halves = [t.to(torch.float16).reshape(n, 1).numpy().astype("<f2").view(np.uint8) for t in (d, dmin)]
    return np.concatenate([*halves, scales, nibbles], axis=-1).reshape(rows, -1)


def unpack_q4_k(
    blocks: np.ndarray, cols: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8 ``(rows, cols)``, ``d``, ``dmin`` float16 ``(rows, cols/256)``, ``sc``, ``m`` uint8
    ``(rows, cols/256, 8)``) of Q4_K ``blocks``: the inverse of ``pack_q4_k``."""
    b = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1, Q4_K_BYTES)
    per_row = cols // SUPER_BLOCK
    d = b[:, 0:2].copy().view("<f2")[:, 0].astype(np.float16)
    dmin = b[:, 2:4].copy().view("<f2")[:, 0].astype(np.float16)
    packed = b[:, 4 : 4 + K_SCALE_BYTES]
    low, mid, mixed = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    six = np.uint8(0x3F)
    sc = np.concatenate([low & six, (mixed & np.uint8(0x0F)) | ((low >> np.uint8(2)) & np.uint8(0x30))], axis=-1)
    m = np.concatenate([mid & six, (mixed >> np.uint8(4)) | ((mid >> np.uint8(2)) & np.uint8(0x30))], axis=-1)
    nibbles = b[:, 4 + K_SCALE_BYTES :].reshape(-1, SUPER_BLOCK // 64, 1, 32)
    q = np.concatenate([nibbles & np.uint8(0x0F), nibbles >> np.uint8(4)], axis=2).reshape(-1, cols)
    shape = (-1, per_row)
    return (
        torch.from_numpy(q.copy()),
        torch.from_numpy(d.reshape(shape)),
        torch.from_numpy(dmin.reshape(shape)),
        torch.from_numpy(sc.reshape(*shape, GROUPS_PER_SUPER_BLOCK).copy()),
        torch.from_numpy(m.reshape(*shape, GROUPS_PER_SUPER_BLOCK).copy()),
    )


def pack_mxfp4(codes: torch.Tensor, exponents: torch.Tensor) -> np.ndarray:
    """MXFP4 blocks of E2M1 ``codes`` (uint8 ``(rows, cols)``, ``sign << 3 | magnitude index``) with E8M0
    ``exponents`` (uint8 ``(rows, cols/32)``, scale ``2**(e - 127)``). Returns uint8 ``(rows, cols/32*17)``.

    Each block: the exponent byte, then byte ``j`` holds code ``j`` in its low nibble and code ``j + 16`` in
    its high nibble (Q4_0's order). ggml's table ``kvalues_mxfp4`` holds the E2M1 values doubled (0, 1, 2, 3, 4,
    6, 8, 12 and their negatives, by the same code) and halves the scale (``ggml_e8m0_to_fp32_half``), so a
    block means exactly ``e2m1(code) * 2**(e - 127)``, what compressed-tensors' ``mxfp4-pack-quantized`` means.
    """
    rows, cols = codes.shape
    q = codes.to(torch.uint8).reshape(rows, cols // BLOCK, BLOCK).numpy()
    nibbles = q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << np.uint8(4))
    e = exponents.to(torch.uint8).reshape(rows, cols // BLOCK, 1).numpy()
    return np.concatenate([e, nibbles], axis=-1).reshape(rows, -1)


def unpack_mxfp4(blocks: np.ndarray, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(E2M1 codes uint8 ``(rows, cols)``, E8M0 exponents uint8 ``(rows, cols/32)``) of MXFP4 ``blocks``."""
    b = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1, cols // BLOCK, MXFP4_BYTES)
    nibbles = b[..., 1:]
    q = np.concatenate([nibbles & np.uint8(0x0F), nibbles >> np.uint8(4)], axis=-1)
    return torch.from_numpy(q.reshape(-1, cols).copy()), torch.from_numpy(b[..., 0].copy())
