"""KV-cache write: scatter each token's k and v rows into its cache slot.

Reference: ``k_cache.index_copy_(0, slot_mapping, k)`` and the same for v, two
launches; this is one launch for both. A negative slot means "write nothing"
(padding rows, e.g. a CUDA graph padded past the real batch). An FP8 cache
(``kv_fp8.py``) gets each head's codes and exponent byte.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import kv_fp8


@triton.jit
def _kv_write_kernel(K, V, KCache, VCache, KExp, VExp, Slots,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kc_slot, stride_kc_h, stride_vc_slot, stride_vc_h, stride_e,
                     NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(Slots + token).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < NUM_HEADS) & (dims < HEAD_DIM)
        k = tl.load(K + token.to(tl.int64) * stride_kt + heads * stride_kh + dims, mask=mask,
                    other=0.0)
        v = tl.load(V + token.to(tl.int64) * stride_vt + heads * stride_vh + dims, mask=mask,
                    other=0.0)
        if FP8:  # per head: its exponent, then its codes
            ek = kv_fp8.exponent_of(tl.max(tl.abs(k.to(tl.float32)), 1))
            ev = kv_fp8.exponent_of(tl.max(tl.abs(v.to(tl.float32)), 1))
            head_ok = tl.arange(0, BLOCK_H) < NUM_HEADS
            tl.store(KExp + slot * stride_e + tl.arange(0, BLOCK_H), ek.to(tl.uint8),
                     mask=head_ok)
            tl.store(VExp + slot * stride_e + tl.arange(0, BLOCK_H), ev.to(tl.uint8),
                     mask=head_ok)
            k, v = kv_fp8.encode(k, ek[:, None]), kv_fp8.encode(v, ev[:, None])
        tl.store(KCache + slot * stride_kc_slot + heads * stride_kc_h + dims, k, mask=mask)
        tl.store(VCache + slot * stride_vc_slot + heads * stride_vc_h + dims, v, mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D] (any row/head strides, unit dim stride); caches [slots, Hkv, D]
    (FP8 ones quantized per head, ``kv_fp8.py``)."""
    tokens, heads, dim = k.shape
    if tokens == 0:
        return
    for t in (k, v, k_cache, v_cache):
        if t.stride(-1) != 1:
            raise ValueError("kv_write needs a unit stride along head_dim")
    fp8 = kv_fp8.is_fp8(k_cache)
    exps = (kv_fp8.exponents(k_cache), kv_fp8.exponents(v_cache)) if fp8 else (k_cache, v_cache)
    if fp8:
        k_cache, v_cache = kv_fp8.codes(k_cache), kv_fp8.codes(v_cache)
    _kv_write_kernel[(tokens,)](
        k, v, k_cache, v_cache, *exps, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        exps[0].stride(0), NUM_HEADS=heads, HEAD_DIM=dim, BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_D=triton.next_power_of_2(dim), FP8=fp8, num_warps=4 if heads * dim >= 2048 else 1)
