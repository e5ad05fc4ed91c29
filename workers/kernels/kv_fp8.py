"""The FP8 KV cache (``--kv-cache-dtype fp8``): e4m3 codes with a power-of-two scale per
(position, KV head).

A layer's K (or V) pool is one run of bytes: the codes of every slot, [slots, kv_heads,
head_dim] as a float8_e4m3fn view (rows aligned as a bfloat16 cache's), then one
exponent byte E per (slot, KV head): the head's values at that slot are
``code * 2^(E - 127)``. The scale is the
smallest power of two that brings the head's largest value within e4m3's 448, so its
rounding is e4m3's alone (relative 2^-4) and no value saturates; one byte a head keeps
the cache at 2 * D / (D + 1) of bfloat16's capacity (1.98x at D = 128). A scale per
position (not per tensor) needs no calibration and follows each token's own range; a
power of two is exact to apply and to undo.

The kernels read a tile's codes as e4m3 (the hardware conversion), and multiply each
key's scale into its column of scores and each value's into its probability column,
never into the tile. They write codes with ``encode`` (round to nearest even, in integer
operations: Triton's CPU interpreter rounds e4m3 stores wrongly).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

E4M3_MAX = 448.0


def slot_bytes(kv_heads: int, head_dim: int) -> int:
    """Bytes of one slot of one layer's K (or V) pool: its codes and its exponents."""
    return kv_heads * (head_dim + 1)


def codes_view(pool: torch.Tensor, slots: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """The codes of a uint8 pool of ``slots * slot_bytes`` bytes: float8_e4m3fn
    [slots, Hkv, D] (the exponents follow them: ``exponents``)."""
    return pool[:slots * kv_heads * head_dim].view(torch.float8_e4m3fn).view(
        slots, kv_heads, head_dim)


def exponents(cache: torch.Tensor) -> torch.Tensor:
    """The exponent bytes after ``cache``'s codes (a ``codes_view``): uint8 [slots, Hkv]."""
    slots, kv_heads, head_dim = cache.shape
    if not cache.is_contiguous():
        raise ValueError("an FP8 cache is a contiguous run of codes (kv_fp8.codes_view)")
    return torch.as_strided(cache.view(torch.uint8), (slots, kv_heads), (kv_heads, 1),
                            cache.storage_offset() + slots * kv_heads * head_dim)


def codes(cache: torch.Tensor) -> torch.Tensor:
    """What a kernel takes for ``cache``: its codes as bytes (the kernels decode them)."""
    return cache.view(torch.uint8)


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.float8_e4m3fn


def dequantize(cache: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Every slot's values, [slots, Hkv, D] in ``dtype`` (the reference the tests read)."""
    scale = torch.exp2(exponents(cache).float() - 127)
    return (cache.float() * scale[:, :, None]).to(dtype)


@triton.jit
def exponent_of(amax):
    """The biased exponent E (uint8 range) of the least power of two >= amax / 448."""
    u = (amax * (1.0 / 448.0)).to(tl.int32, bitcast=True)
    e = (u >> 23) + ((u & 0x7FFFFF) != 0).to(tl.int32)
    return tl.minimum(tl.maximum(e, 1), 253)


@triton.jit
def scale_of(e):
    """2^(E - 127) as float32, for biased exponents E in 1..254."""
    return (e.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def encode(x, e):
    """x / 2^(E - 127) (|x| / scale <= 448) rounded to the nearest e4m3 (ties to even),
    as its bit pattern in uint8; ``e`` broadcasts against ``x``."""
    y = x.to(tl.float32) * ((254 - e.to(tl.int32)) << 23).to(tl.float32, bitcast=True)
    a = tl.abs(y)
    # Below 2^-6, e4m3 is subnormal: multiples of 2^-9, code = round(a * 512) (8 = 2^-6,
    # the first normal code, so the two ranges meet). Adding 2^23 rounds to an integer.
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    bits = a.to(tl.int32, bitcast=True)
    rounded = bits + 0x7FFFF + ((bits >> 20) & 1)  # to 3 mantissa bits, ties to even
    normal = tl.minimum((rounded >> 20) - (120 << 3), 126)  # exponent - 127 + 7; 126 = 448
    code = tl.where(a < 0.015625, sub, normal)
    return (code | tl.where(y < 0, 128, 0)).to(tl.uint8)


@triton.jit
def decode(codes, dtype: tl.constexpr):
    """uint8 e4m3 bit patterns -> ``dtype`` values (unscaled)."""
    return codes.to(tl.float8e4nv, bitcast=True).to(dtype)
