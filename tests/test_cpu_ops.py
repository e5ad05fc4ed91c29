"""The CPU path's fused C operations (workers/kernels/cpu_ops.py, cpu_quant/ops.c) against
the torch references the layers otherwise run, and ``BlockLinear`` (a whole layer's
block parts in one call) against the per-part products."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pocketllm.workers.kernels import cpu_quant as cq
from pocketllm.workers.layers.activation import act_and_mul as torch_act_and_mul
from pocketllm.workers.layers.activation import get_activation
from pocketllm.workers.layers.attention import ScheduledSeq, TorchAttention, build_metadata
from pocketllm.workers.layers.rotary import apply_rotary

pytestmark = pytest.mark.skipif(not cq.available(), reason=f"CPU kernels: {cq.unavailable_reason()}")

from pocketllm.workers.kernels import cpu_ops  # noqa: E402

G = torch.Generator().manual_seed(7)


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=G)


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 2e-6) -> bool:
    return bool(((a - b).abs() <= tol * (1 + b.abs())).all())


@pytest.mark.parametrize("rows", [1, 5])
def test_rms_norm_and_its_residual_add_match_torch(rows):
    x, res, w = rand(rows, 640) * 3, rand(rows, 640), rand(640)
    ref = F.rms_norm(x, (640,), w, 1e-6)
    assert close(cpu_ops.rms_norm(x, w, 1e-6), ref)
    out, summed = cpu_ops.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(summed, x + res)
    assert close(out, F.rms_norm(x + res, (640,), w, 1e-6))


def test_rms_norm_of_strided_heads():
    # q and k as the attention layer sees them: [T, H, D] views into one qkv row
    qkv = rand(3, 6 * 256)
    q = qkv[:, :4 * 256].view(3, 4, 256)
    w = rand(256)
    assert close(cpu_ops.rms_norm(q, w, 1e-6), F.rms_norm(q, (256,), w, 1e-6))


def test_rotary_is_the_reference_bit_for_bit_and_in_place():
    qkv = rand(4, 6 * 64)
    q, k = qkv[:, :4 * 64].view(4, 4, 64), qkv[:, 4 * 64:5 * 64].view(4, 1, 64)
    cos, sin = rand(4, 1, 32), rand(4, 1, 32)
    want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    v_before = qkv[:, 5 * 64:].clone()
    got_q, got_k = cpu_ops.apply_rotary_qk(q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr() and torch.equal(got_q, want_q)
    assert torch.equal(got_k, want_k)
    assert torch.equal(qkv[:, 5 * 64:], v_before)  # v untouched


def test_rotary_with_qk_norms_is_norm_then_rotary():
    qkv = rand(3, 6 * 64)
    q, k = qkv[:, :4 * 64].view(3, 4, 64), qkv[:, 4 * 64:5 * 64].view(3, 1, 64)
    cos, sin, wq, wk = rand(3, 1, 32), rand(3, 1, 32), rand(64), rand(64)
    want_q = apply_rotary(F.rms_norm(q, (64,), wq, 1e-6), cos, sin)
    want_k = apply_rotary(F.rms_norm(k, (64,), wk, 1e-6), cos, sin)
    got_q, got_k = cpu_ops.apply_rotary_qk(q, k, cos, sin, (wq, wk, 1e-6))
    assert close(got_q, want_q) and close(got_k, want_k)


@pytest.mark.parametrize("act", sorted(cpu_ops.ACTIVATIONS))
def test_gated_activations_match_torch(act):
    gate_up = torch.cat([torch.linspace(-30, 30, 2048).view(1, -1), rand(2, 2048) * 4])
    gate_up = torch.cat([gate_up, rand(3, 2048)], dim=1)
    ref = torch_act_and_mul(get_activation(act), gate_up)
    got = cpu_ops.act_and_mul(gate_up, act)
    assert ((got - ref).abs() <= 3e-6 * (1 + ref.abs())).all(), float((got - ref).abs().max())


def test_unknown_activation_and_bad_shapes_are_refused():
    with pytest.raises(ValueError):
        cpu_ops.act_and_mul(rand(1, 64), "relu")
    with pytest.raises(ValueError):
        cpu_ops.rms_norm(rand(2, 64).t(), rand(2), 1e-6)  # non-unit last stride
    with pytest.raises(ValueError):
        cpu_ops.rms_norm(rand(2, 64).double(), rand(64), 1e-6)
    with pytest.raises(ValueError):
        cpu_ops.add_rms_norm(rand(2, 64), rand(3, 64), rand(64), 1e-6)


@pytest.mark.parametrize("window,softcap", [(None, None), (8, None), (None, 30.0)])
def test_decode_attention_matches_the_reference(window, softcap):
    """Batched decodes of different lengths (padding masked), GQA, sliding window,
    soft-capping: the C backend against TorchAttention on the same cache."""
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
    got = cpu_ops.CpuAttention().forward(q, k, v, k_cache, v_cache, meta, window, dim ** -0.5,
                                         softcap)
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
        got = cpu_ops.CpuAttention().forward(q, k, v, k_cache, v_cache, meta, None, dim ** -0.5,
                                             None)
    finally:
        torch.set_num_threads(threads)
    assert close(got, want, 1e-5), float((got - want).abs().max())


def test_block_linear_equals_the_per_part_products():
    from test_cpu_quant_kernels import random_blocks

    k = 512
    parts = [(8, random_blocks(8, 40, k, 1), 0), (12, random_blocks(12, 23, k, 2), 40),
             (6, random_blocks(6, 17, k, 3), 63)]
    linear = cq.BlockLinear(k, parts)
    for m in (1, 3, 15):
        x = rand(m, k)
        act = cq.quantize_activations(x)
        want = torch.cat([cq.mul_mat(t, w, k, act, torch.empty(m, w.shape[0])) for t, w, _ in parts],
                         dim=1)
        wide = torch.full((m, 90), float("nan"))
        with cq.forcing_gemm_rows(1 << 40):  # the row dots, as mul_mat: bit for bit
            linear(x, wide)
        assert torch.equal(wide[:, :80], want)
        assert wide[:, 80:].isnan().all()  # nothing past the last part


def test_block_linear_refuses_what_does_not_fit():
    from test_cpu_quant_kernels import random_blocks

    w = random_blocks(8, 8, 64, 0)
    with pytest.raises(ValueError):
        cq.BlockLinear(96, [(8, w, 0)])  # rows of 64 elements, not 96
    linear = cq.BlockLinear(64, [(8, w, 4)])
    with pytest.raises(ValueError):
        linear(rand(2, 64), torch.empty(2, 11))  # 4 + 8 columns needed
    with pytest.raises(ValueError):
        linear(rand(2, 32), torch.empty(2, 12))
