"""The Triton MLA decode kernel (``kernels/mla_decode.py``) against a plain torch
reference over random paged latent caches: under Triton's interpreter on CPU at tiny
widths, compiled on CUDA at DeepSeek's (R=512, P=64, H=16 and 128)."""

from __future__ import annotations

import math
import random

import pytest

from kernel_modules import load_kernels

K, DEVICE = load_kernels()
import torch  # noqa: E402

from pocketllm.workers.kernel_policy import KernelPolicy  # noqa: E402
from pocketllm.workers.kernels.mla_decode import (PARTIAL_TRAFFIC,  # noqa: E402
                                                   mla_decode_attention, mla_partition)

CUDA = DEVICE.type == "cuda"
needs_cuda = pytest.mark.skipif(not CUDA, reason="compiled kernel at real sizes: CUDA only")


def make_case(seq_lens, heads, rank, rope, block_size, dtype=torch.float32, seed=0,
              spare_rows=2):
    """A cache whose unused slots are NaN (a read of one shows), one block table per
    sequence drawn from shuffled blocks with spare entries past its end, and query rows in
    a shuffled order among ``spare_rows`` rows that no sequence owns."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [math.ceil(n / block_size) for n in seq_lens]
    width = max(need) + 3  # the table is longer than any sequence needs
    blocks = list(range(sum(need) + 5))
    rng.shuffle(blocks)
    cache = torch.full((len(blocks) * block_size, rank + rope), float("nan"))
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for b, n in enumerate(seq_lens):
        own = [blocks.pop() for _ in range(need[b])]
        tables[b, :need[b]] = torch.tensor(own)
        tables[b, need[b]:] = torch.tensor([rng.choice(blocks) for _ in range(width - need[b])])
        pos = torch.arange(n)
        slots = tables[b, :need[b]].long()[pos // block_size] * block_size + pos % block_size
        cache[slots] = torch.randn(n, rank + rope, generator=gen)
    tokens = len(seq_lens) + spare_rows
    rows = list(range(tokens))
    rng.shuffle(rows)
    q_rows = torch.tensor(rows[:len(seq_lens)], dtype=torch.int64)
    q_latent = torch.randn(tokens, heads, rank, generator=gen)
    q_rope = torch.randn(tokens, heads, rope, generator=gen)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    to = lambda t, cast=True: t.to(DEVICE, dtype if cast else t.dtype)  # noqa: E731
    return (to(q_latent), to(q_rope), to(cache), to(tables, False), to(seq_lens, False),
            to(q_rows, False))


def reference(q_latent, q_rope, cache, tables, seq_lens, q_rows, block_size, scale):
    """float64: gather each sequence's rows by its block table, score, softmax, sum."""
    rank = q_latent.shape[2]
    out = {}
    for b in range(tables.shape[0]):
        pos = torch.arange(int(seq_lens[b]), device=cache.device)
        rows = cache[tables[b].long()[pos // block_size] * block_size + pos % block_size].double()
        latent, k_rope = rows[:, :rank], rows[:, rank:]
        r = int(q_rows[b])
        scores = scale * (q_latent[r].double() @ latent.T + q_rope[r].double() @ k_rope.T)
        out[r] = torch.softmax(scores, dim=-1) @ latent
    return out


def run(case, block_size, scale, partition, tiles=None):
    q_latent, q_rope, cache, tables, seq_lens, q_rows = case
    out = torch.full_like(q_latent, float("nan"))
    got = mla_decode_attention(q_latent, q_rope, cache, tables, seq_lens, q_rows,
                               int(seq_lens.max()), block_size, scale, out=out,
                               partition=partition, tiles=tiles)
    assert got is out
    return out


def check(out, case, block_size, scale, atol, rtol):
    want = reference(*case, block_size, scale)
    for r, row in want.items():
        torch.testing.assert_close(out[r].double(), row, atol=atol, rtol=rtol)
    unowned = [r for r in range(out.shape[0]) if r not in want]
    assert torch.isnan(out[unowned]).all(), "rows no sequence owns must stay untouched"


# sequence lengths: 1, within one block, not a multiple of the block size, several blocks
LENS = [1, 13, 30, 3]


@pytest.mark.parametrize("partition", [None, 5, 16, 64])
@pytest.mark.parametrize("rank,rope,heads", [(32, 16, 4), (64, 16, 20)])
def test_float32_matches_reference(partition, rank, rope, heads):
    # 20 heads: a full block of 16 and a masked one; partitions not a multiple of the
    # block size nor of the keys per loop, a whole loop, and longer than every sequence
    case = make_case(LENS, heads, rank, rope, block_size=4, seed=rank + heads)
    out = run(case, 4, 0.3, partition)
    check(out, case, 4, 0.3, atol=2e-5, rtol=2e-5)


def test_many_splits_merge_over_several_chunks():
    # 70 one-key splits: the merge runs three loops of up to 32 splits
    case = make_case([70, 2, 33], 4, 32, 16, block_size=4, seed=11)
    out = run(case, 4, 0.3, 1)
    check(out, case, 4, 0.3, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("partition", [None, 8])
def test_half_precision_matches_reference(dtype, partition):
    case = make_case([1, 19, 26], 16, 32, 16, block_size=8, dtype=dtype, seed=3)
    out = run(case, 8, 0.25, partition)
    assert out.dtype == dtype
    tol = 3e-2 if dtype == torch.bfloat16 else 4e-3
    check(out, case, 8, 0.25, atol=tol, rtol=tol)


def test_out_is_allocated_with_q_dtype_and_other_tiles_compute_the_same():
    case = make_case([5, 30], 40, 32, 16, block_size=4, seed=5)
    q_latent, q_rope, cache, tables, seq_lens, q_rows = case
    out = mla_decode_attention(q_latent, q_rope, cache, tables, seq_lens, q_rows, 30, 4, 0.5,
                               partition=8)
    assert out.shape == q_latent.shape and out.dtype == q_latent.dtype
    want = reference(*case, 4, 0.5)
    for r, row in want.items():
        torch.testing.assert_close(out[r].double(), row, atol=2e-5, rtol=2e-5)
    # the large-H tile (32 heads: one full block and a masked one; 32 keys per loop, more
    # than a split holds) computes the same rows
    other = run(case, 4, 0.5, 8, tiles=(32, 32, 8, 1))
    check(other, case, 4, 0.5, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("rank,rope,cache_width,match", [
    (48, 16, 64, "kv_lora_rank R = 48"), (32, 24, 56, "qk_rope_head_dim P = 24"),
    (32, 16, 64, "not R \\+ P = 48"), (8, 16, 24, "kv_lora_rank R = 8")])
def test_refuses_widths_it_cannot_tile(rank, rope, cache_width, match):
    q_latent = torch.zeros(2, 4, rank, device=DEVICE)
    q_rope = torch.zeros(2, 4, rope, device=DEVICE)
    cache = torch.zeros(16, cache_width, device=DEVICE)
    tables = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(1, dtype=torch.int32, device=DEVICE)
    rows = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        mla_decode_attention(q_latent, q_rope, cache, tables, lens, rows, 1, 8, 1.0)


def test_refuses_a_block_table_with_strided_entries():
    case = make_case([5], 4, 32, 16, block_size=4)
    q_latent, q_rope, cache, tables, seq_lens, q_rows = case
    strided = torch.cat([tables, tables], dim=1)[:, ::2]
    with pytest.raises(ValueError, match="block_tables must be contiguous"):
        mla_decode_attention(q_latent, q_rope, cache, strided, seq_lens, q_rows, 5, 4, 1.0)


def test_refuses_mixed_dtypes():
    q = torch.zeros(1, 4, 32, device=DEVICE)
    with pytest.raises(ValueError, match="share a dtype"):
        mla_decode_attention(q, torch.zeros(1, 4, 16, device=DEVICE),
                             torch.zeros(8, 48, device=DEVICE, dtype=torch.bfloat16),
                             torch.zeros(1, 1, dtype=torch.int32, device=DEVICE),
                             torch.ones(1, dtype=torch.int32, device=DEVICE),
                             torch.zeros(1, dtype=torch.int64, device=DEVICE), 1, 8, 1.0)


def test_partition_splits_a_small_batch_but_keeps_partials_below_the_cache_bytes():
    policy = KernelPolicy(triton=True, decode_min_partition=64, decode_programs_per_sm=8)
    cpu = torch.device("cpu")  # sm_count: 4 under the interpreter
    # one sequence, 16 heads (one head block): split; H=128 raises the floor
    small = mla_partition(policy, 1, 16, 4096, 512, 64, 2, cpu)
    assert small < 4096 and small % 32 == 0
    big = mla_partition(policy, 1, 128, 4096, 512, 64, 2, cpu)
    assert big * 576 * 2 * PARTIAL_TRAFFIC >= 128 * 512 * 4 and big % 32 == 0
    # a batch that fills the machine, or a span under the floor, is not split
    assert mla_partition(policy, 64, 16, 4096, 512, 64, 2, cpu) == 4096
    assert mla_partition(policy, 1, 128, 100, 512, 64, 2, cpu) == 100


def real_case(batch, heads, ctx, seed=0, dtype=torch.bfloat16):
    """Contexts drawn in [ctx/2, ctx], blocks of 16 (only built on CUDA)."""
    rng = random.Random(seed)
    lens = [rng.randrange(ctx // 2, ctx + 1) for _ in range(batch)]
    lens[0] = ctx
    return make_case(lens, heads, 512, 64, block_size=16, dtype=dtype, seed=seed, spare_rows=1)


@needs_cuda
@pytest.mark.parametrize("batch,heads,ctx", [(1, 16, 3000), (1, 128, 2049), (64, 16, 700),
                                             (16, 128, 513)])
def test_real_widths_match_reference(batch, heads, ctx):
    case = real_case(batch, heads, ctx, seed=batch + heads)
    policy = KernelPolicy(triton=True)
    part = mla_partition(policy, batch, heads, ctx, 512, 64, 2, DEVICE)
    for partition in (None, part):
        out = run(case, 16, 576 ** -0.5, partition)
        check(out, case, 16, 576 ** -0.5, atol=2e-2, rtol=2e-2)


@needs_cuda
@pytest.mark.parametrize("heads", [16, 128])
def test_real_widths_do_not_depend_on_the_partition(heads):
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 8e-3)):
        case = real_case(4, heads, 2500, seed=heads, dtype=dtype)
        whole = run(case, 16, 0.05, None).float()
        for partition in (64, 96, 256, 1000):
            torch.testing.assert_close(run(case, 16, 0.05, partition).float(), whole,
                                       atol=tol, rtol=tol, equal_nan=True)


@needs_cuda
def test_replays_under_a_cuda_graph():
    case = real_case(2, 16, 1000, seed=9)
    q_latent, q_rope, cache, tables, seq_lens, q_rows = case
    out = torch.full_like(q_latent, float("nan"))
    call = lambda: mla_decode_attention(q_latent, q_rope, cache, tables, seq_lens,  # noqa: E731
                                        q_rows, 1000, 16, 0.05, out=out, partition=128)
    call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    out.fill_(float("nan"))
    q_latent.mul_(-1)  # new inputs in the same buffers
    graph.replay()
    check(out, case, 16, 0.05, atol=2e-2, rtol=2e-2)
