"""The float32 operations between the products (cpu_quant/ops.c: RMSNorm with its residual
add, rotary, the gated activations, decode attention), which the torch-free worker's
decode stack and float path call, against the torch references the torch worker runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pocketllm.workers.kernels import cpu_lib
from pocketllm.workers.layers.activation import act_and_mul as torch_act_and_mul
from pocketllm.workers.layers.activation import get_activation
from pocketllm.workers.layers.attention import ScheduledSeq, TorchAttention, build_metadata
from pocketllm.workers.layers.rotary import apply_rotary
from pocketllm.workers.models.config import ACTIVATION_KINDS

pytestmark = pytest.mark.skipif(not cpu_lib.available(),
                                reason=f"CPU kernels: {cpu_lib.unavailable_reason()}")

G = torch.Generator().manual_seed(7)


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=G)


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 2e-6) -> bool:
    return bool(((a - b).abs() <= tol * (1 + b.abs())).all())


def _check(rc: int) -> None:
    cpu_lib.raise_for(rc, None, "ops.c")


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, residual=None):
    """pq_rms_norm over x [A, D] or [A, B, D] (unit last stride): (out, x + residual)."""
    d = x.shape[-1]
    a, b = (x.shape[0], 1) if x.dim() == 2 else (x.shape[0], x.shape[1])
    sb = 0 if x.dim() == 2 else x.stride(1)
    out = torch.empty(x.shape)
    summed = torch.empty(x.shape) if residual is not None else None
    res_ptr, res_stride = (None, 0) if residual is None else (residual.data_ptr(), residual.stride(0))
    _check(cpu_lib.lib().pq_rms_norm(
        x.data_ptr(), a, b, d, x.stride(0), sb, res_ptr, res_stride, 0, w.data_ptr(), eps,
        out.data_ptr(), None if summed is None else summed.data_ptr()))
    return out, summed


@pytest.mark.parametrize("rows", [1, 5])
def test_rms_norm_and_its_residual_add_match_torch(rows):
    x, res, w = rand(rows, 640) * 3, rand(rows, 640), rand(640)
    assert close(rms_norm(x, w, 1e-6)[0], F.rms_norm(x, (640,), w, 1e-6))
    out, summed = rms_norm(x, w, 1e-6, res)
    assert torch.equal(summed, x + res)
    assert close(out, F.rms_norm(x + res, (640,), w, 1e-6))


def test_rms_norm_of_strided_heads():
    # q as the attention sees it: [T, H, D] heads of one qkv row (Gemma's, Qwen3's q norm)
    qkv = rand(3, 6 * 256)
    q = qkv[:, :4 * 256].view(3, 4, 256)
    w = rand(256)
    assert close(rms_norm(q, w, 1e-6)[0], F.rms_norm(q, (256,), w, 1e-6))


def test_rotary_is_the_reference_bit_for_bit_and_in_place():
    qkv = rand(4, 6 * 64)
    q = qkv[:, :4 * 64].view(4, 4, 64)
    cos, sin = rand(4, 1, 32), rand(4, 1, 32)
    want = apply_rotary(q, cos, sin)
    rest = qkv[:, 4 * 64:].clone()
    _check(cpu_lib.lib().pq_rotary(q.data_ptr(), 4, 4, 64, q.stride(0), q.stride(1),
                                   cos.data_ptr(), sin.data_ptr(), 32))
    assert torch.equal(q, want)
    assert torch.equal(qkv[:, 4 * 64:], rest)  # k and v untouched


@pytest.mark.parametrize("act", sorted(ACTIVATION_KINDS))
def test_gated_activations_match_torch(act):
    gate_up = torch.cat([torch.linspace(-30, 30, 2048).view(1, -1), rand(2, 2048) * 4])
    gate_up = torch.cat([gate_up, rand(3, 2048)], dim=1).contiguous()
    ref = torch_act_and_mul(get_activation(act), gate_up)
    got = torch.empty(3, 2048)
    _check(cpu_lib.lib().pq_act_and_mul(cpu_lib.ACT_IDS[ACTIVATION_KINDS[act]],
                                        gate_up.data_ptr(), 3, 2048, 4096, got.data_ptr()))
    assert ((got - ref).abs() <= 3e-6 * (1 + ref.abs())).all(), float((got - ref).abs().max())


def test_bad_arguments_are_refused():
    lib, x = cpu_lib.lib(), torch.zeros(2, 64)
    assert lib.pq_act_and_mul(3, x.data_ptr(), 1, 32, 64, x.data_ptr()) == cpu_lib.ERR_ARG
    assert lib.pq_act_and_mul(0, x.data_ptr(), 1, 32, 63, x.data_ptr()) == cpu_lib.ERR_ARG


def c_decode_attention(q, k, v, k_cache, v_cache, meta, window, scale, softcap):
    """What the decode stack does for one-token rows: their k/v written to their slots,
    then pq_decode_attention over each row's gathered slots."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    (group,) = meta.groups
    view = group.views[window]
    b, heads, dim = q.shape
    out = torch.empty(b, heads, dim)
    _check(cpu_lib.lib().pq_decode_attention(
        q.data_ptr(), b, heads, dim, q.stride(0), q.stride(1), k_cache.data_ptr(),
        v_cache.data_ptr(), k_cache.shape[1], view.gather.data_ptr(), view.gather.shape[1],
        view.lengths.data_ptr(), scale, softcap or 0.0, out.data_ptr(), 0))
    return out


@pytest.mark.parametrize("window,softcap", [(None, None), (8, None), (None, 30.0)])
def test_decode_attention_matches_the_reference(window, softcap):
    """Batched decodes of different lengths (padding masked), GQA, sliding window,
    soft-capping: the C attention against TorchAttention on the same cache."""
    block, heads, kv_heads, dim = 4, 4, 2, 32
    cache_shape = (16 * block, kv_heads, dim)
    k_cache, v_cache = rand(*cache_shape), rand(*cache_shape)
    pad = 15 * block
    k_cache[pad], v_cache[pad] = 0, 0
    seqs = [ScheduledSeq([0, 1, 2, 3], 13, 1, 0), ScheduledSeq([5, 6], 4, 1, 1),
            ScheduledSeq([9], 0, 1, 2)]
    q, k, v = rand(3, heads, dim), rand(3, kv_heads, dim), rand(3, kv_heads, dim)
    meta = build_metadata(seqs, block, [window], torch.device("cpu"), pad)
    want = TorchAttention().forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, window,
                                    dim ** -0.5, softcap)
    got = c_decode_attention(q, k, v, k_cache, v_cache, meta, window, dim ** -0.5, softcap)
    assert close(got, want, 1e-5), float((got - want).abs().max())


# 3 threads: one KV head's keys in 3 runs (2 when 130 keys make runs under 64), two KV
# heads' in 2; 20 heads of one KV head attend in passes of 16 and 4
@pytest.mark.parametrize("heads,kv_heads,length", [(8, 1, 700), (16, 1, 130), (10, 2, 700),
                                                   (20, 1, 700)])
def test_decode_attention_splits_the_keys_across_threads(heads, kv_heads, length):
    """A long decode attends in parallel: each KV head's query heads in one pass over its
    keys, the keys split into runs (merged after) when there are fewer KV heads than
    threads."""
    block, dim = 16, 128
    k_cache, v_cache = rand(49 * block, kv_heads, dim), rand(49 * block, kv_heads, dim)
    blocks = list(range(47, 47 - (length + block - 1) // block, -1))  # out of order
    seqs = [ScheduledSeq(blocks, length - 1, 1, 0)]
    q, k, v = rand(1, heads, dim), rand(1, kv_heads, dim), rand(1, kv_heads, dim)
    meta = build_metadata(seqs, block, [None], torch.device("cpu"), 48 * block)
    want = TorchAttention().forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, None,
                                    dim ** -0.5, None)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)  # more threads than KV heads: the keys split
    try:
        got = c_decode_attention(q, k, v, k_cache, v_cache, meta, None, dim ** -0.5, None)
    finally:
        torch.set_num_threads(threads)
    assert close(got, want, 1e-5), float((got - want).abs().max())
