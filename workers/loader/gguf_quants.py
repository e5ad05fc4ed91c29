"""Dequantization of GGML block formats to float32, vectorized with numpy.

Every quantized tensor is a run of fixed-size blocks; each function here takes
all blocks of a tensor at once as a ``(n_blocks, block_bytes)`` uint8 array and
returns ``(n_blocks, block_elements)`` float32, with no Python loop over blocks.
Layouts follow ggml's ``block_*`` structs (ggml-common.h); results are
bit-exact with ``gguf.quants.dequantize`` (the tests check it).

numpy rather than torch: these are a dozen short element-wise passes per
tensor, and each torch op is a parallel region that, on a busy 2-core machine
(the tokenizer stage starts at the same time), waits a scheduler slice for its
second thread -- 10x slower loads. numpy runs them on the calling thread.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

QK_K = 256  # elements per super-block of the k-quants

# ggml type id -> (name, elements per block, bytes per block); None size = known but unsupported.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", QK_K, 84), 11: ("Q3_K", QK_K, 110), 12: ("Q4_K", QK_K, 144),
    13: ("Q5_K", QK_K, 176), 14: ("Q6_K", QK_K, 210), 15: ("Q8_K", QK_K, 292),
    16: ("IQ2_XXS", QK_K, 66), 17: ("IQ2_XS", QK_K, 74), 18: ("IQ3_XXS", QK_K, 98),
    19: ("IQ1_S", QK_K, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", QK_K, 110),
    22: ("IQ2_S", QK_K, 82), 23: ("IQ4_XS", QK_K, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", QK_K, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", QK_K, 54), 35: ("TQ2_0", QK_K, 66), 39: ("MXFP4", 32, 17),
}

# The non-linear 4-bit code book of IQ4_NL / IQ4_XS (ggml-common.h kvalues_iq4nl).
_IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                       dtype=np.float32)


def type_name(ggml_type: int) -> str:
    return GGML_TYPES.get(ggml_type, (f"type {ggml_type}",))[0]


def _shifts(*values: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.array(values, dtype=np.uint8).reshape(shape)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte ``at`` of every block, as an (n, 1) float32 column."""
    return np.ascontiguousarray(blocks[:, at:at + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, m) bytes -> (n, 2m): all low nibbles, then all high nibbles (the q4_0 layout)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _bit_planes(bits: np.ndarray, width: int) -> np.ndarray:
    """(n, width) bytes -> (n, 8, width): plane k holds bit k of every byte."""
    return (bits.reshape(-1, 1, width) >> _shifts(*range(8), shape=(1, 8, 1))) & 1


def _bits_le(bits: np.ndarray) -> np.ndarray:
    """(n, m) bytes of a little-endian bit field -> (n, 8m): bit j of the field at column j."""
    n, m = bits.shape
    return ((bits.reshape(n, m, 1) >> _shifts(*range(8), shape=(1, 1, 8))) & 1).reshape(n, 8 * m)


def _scaled(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """q (any integer type) * scale in float32, in one pass over the output."""
    return np.multiply(q, scale, dtype=np.float32)


# ----------------------------------------------------------------- 32-element blocks


def _q8_0(b: np.ndarray) -> np.ndarray:  # f16 d | int8 q[32]
    return _scaled(b[:, 2:].view(np.int8), _f16(b, 0))


def _q4_0(b: np.ndarray) -> np.ndarray:  # f16 d | q[16] nibbles; value = d * (q - 8)
    return _scaled(_nibbles(b[:, 2:]).view(np.int8) - np.int8(8), _f16(b, 0))


def _q4_1(b: np.ndarray) -> np.ndarray:  # f16 d | f16 m | q[16] nibbles; value = d * q + m
    return _scaled(_nibbles(b[:, 4:]), _f16(b, 0)) + _f16(b, 2)


def _q5_0(b: np.ndarray) -> np.ndarray:  # f16 d | u32 high bits | q[16]; value = d * (q - 16)
    q = _nibbles(b[:, 6:]) | (_bits_le(b[:, 2:6]) << 4)
    return _scaled(q.view(np.int8) - np.int8(16), _f16(b, 0))


def _q5_1(b: np.ndarray) -> np.ndarray:  # f16 d | f16 m | u32 high bits | q[16]
    q = _nibbles(b[:, 8:]) | (_bits_le(b[:, 4:8]) << 4)
    return _scaled(q, _f16(b, 0)) + _f16(b, 2)


def _iq4_nl(b: np.ndarray) -> np.ndarray:  # f16 d | q[16] indices into the code book
    return _f16(b, 0) * _IQ4_LEVELS[_nibbles(b[:, 2:])]


# ----------------------------------------------------------------- 256-element k-quants


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eight 6-bit scales and mins packed in 12 bytes (q4_K/q5_K get_scale_min_k4)."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = np.concatenate([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], axis=1)
    mins = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return scales, mins


def _q2_k(b: np.ndarray) -> np.ndarray:
    # u8 scales[16] (low nibble scale, high nibble min) | q[64] 2-bit | f16 d | f16 dmin
    n, sc = b.shape[0], b[:, 0:16]
    q = (b[:, 16:80].reshape(n, 2, 1, 32) >> _shifts(0, 2, 4, 6, shape=(1, 1, 4, 1))) & 3
    scale = _scaled(sc & 0x0F, _f16(b, 80))[:, :, None]
    shift = _scaled(sc >> 4, _f16(b, 82))[:, :, None]
    return (_scaled(q.reshape(n, 16, 16), scale) - shift).reshape(n, QK_K)


def _q3_k(b: np.ndarray) -> np.ndarray:
    # hmask[32] | q[64] 2-bit | 16 6-bit scales in 12 bytes | f16 d
    n, sc = b.shape[0], b[:, 96:108]
    low = np.concatenate([sc[:, 0:8] & 0x0F, sc[:, 0:8] >> 4], axis=1)
    high = ((sc[:, 8:12].reshape(n, 1, 4) >> _shifts(0, 2, 4, 6, shape=(1, 4, 1))) & 3).reshape(n, 16)
    scale = (low | (high << 4)).view(np.int8) - np.int8(32)
    ql = (b[:, 32:96].reshape(n, 2, 1, 32) >> _shifts(0, 2, 4, 6, shape=(1, 1, 4, 1))) & 3
    # a clear hmask bit means "subtract 4"
    qh = (_bit_planes(b[:, 0:32], 32) ^ 1) << 2
    q = ql.reshape(n, QK_K).view(np.int8) - qh.reshape(n, QK_K).view(np.int8)
    return _scaled(q.reshape(n, 16, 16), _scaled(scale, _f16(b, 108))[:, :, None]).reshape(n, QK_K)


def _q4_k(b: np.ndarray) -> np.ndarray:
    # f16 d | f16 dmin | scales[12] | q[128]: four 32-byte runs, low nibbles then high
    n = b.shape[0]
    scales, mins = _k_scales(b[:, 4:16])
    q = ((b[:, 16:144].reshape(n, 4, 1, 32) >> _shifts(0, 4, shape=(1, 1, 2, 1))) & 0x0F)
    scale = _scaled(scales, _f16(b, 0))[:, :, None]
    shift = _scaled(mins, _f16(b, 2))[:, :, None]
    return (_scaled(q.reshape(n, 8, 32), scale) - shift).reshape(n, QK_K)


def _q5_k(b: np.ndarray) -> np.ndarray:
    # f16 d | f16 dmin | scales[12] | qh[32] (bit k -> sub-block k) | q[128]
    n = b.shape[0]
    scales, mins = _k_scales(b[:, 4:16])
    ql = ((b[:, 48:176].reshape(n, 4, 1, 32) >> _shifts(0, 4, shape=(1, 1, 2, 1))) & 0x0F)
    q = ql.reshape(n, 8, 32) | (_bit_planes(b[:, 16:48], 32) << 4)
    scale = _scaled(scales, _f16(b, 0))[:, :, None]
    shift = _scaled(mins, _f16(b, 2))[:, :, None]
    return (_scaled(q, scale) - shift).reshape(n, QK_K)


def _q6_k(b: np.ndarray) -> np.ndarray:
    # ql[128] low nibbles | qh[64] 2-bit highs | int8 scales[16] | f16 d; value = d * s * (q - 32)
    n = b.shape[0]
    ql = ((b[:, 0:128].reshape(n, 2, 1, 64) >> _shifts(0, 4, shape=(1, 1, 2, 1))) & 0x0F)
    qh = ((b[:, 128:192].reshape(n, 2, 1, 32) >> _shifts(0, 2, 4, 6, shape=(1, 1, 4, 1))) & 3)
    q = (ql.reshape(n, 8, 32) | (qh.reshape(n, 8, 32) << 4)).view(np.int8) - np.int8(32)
    scale = _scaled(b[:, 192:208].view(np.int8), _f16(b, 208))
    return _scaled(q.reshape(n, 16, 16), scale[:, :, None]).reshape(n, QK_K)


def _q8_k(b: np.ndarray) -> np.ndarray:  # f32 d | int8 q[256] | int16 bsums[16]
    return _scaled(b[:, 4:260].view(np.int8), np.ascontiguousarray(b[:, 0:4]).view(np.float32))


def _iq4_xs(b: np.ndarray) -> np.ndarray:
    # f16 d | u16 scales_h | scales_l[4] | q[128]; 6-bit scale per 32 = low nibble | 2 high bits
    n = b.shape[0]
    low = ((b[:, 4:8].reshape(n, 4, 1) >> _shifts(0, 4, shape=(1, 1, 2))) & 0x0F).reshape(n, 8)
    scales_h = np.ascontiguousarray(b[:, 2:4]).view("<u2").astype(np.int32)
    high = (scales_h >> np.arange(0, 16, 2, dtype=np.int32)) & 3
    scale = _scaled((low.astype(np.int32) | (high << 4)) - 32, _f16(b, 0))
    qs = b[:, 8:136].reshape(n, 8, 16)
    levels = _IQ4_LEVELS[np.concatenate([qs & 0x0F, qs >> 4], axis=2)]
    return (scale[:, :, None] * levels).reshape(n, QK_K)


_BLOCK_DEQUANT: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    2: _q4_0, 3: _q4_1, 6: _q5_0, 7: _q5_1, 8: _q8_0, 10: _q2_k, 11: _q3_k, 12: _q4_k,
    13: _q5_k, 14: _q6_k, 15: _q8_k, 20: _iq4_nl, 23: _iq4_xs,
}

SUPPORTED_TYPES = frozenset(_BLOCK_DEQUANT) | {0, 1, 30}


def dequantize(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    """A tensor's raw bytes (1-D uint8) -> its values as a new 1-D float32 array.

    Raises KeyError for a type outside SUPPORTED_TYPES (the caller names the tensor).
    """
    if ggml_type == 0:
        return raw.view("<f4").copy()
    if ggml_type == 1:
        return np.ascontiguousarray(raw).view("<f2").astype(np.float32)
    if ggml_type == 30:  # bfloat16: the high half of a float32
        return (np.ascontiguousarray(raw).view("<u2").astype(np.uint32) << 16).view(np.float32)
    _, _, block_bytes = GGML_TYPES[ggml_type]
    return _BLOCK_DEQUANT[ggml_type](raw.reshape(-1, block_bytes)).reshape(-1)
