"""Triton attention kernels (kv write, paged decode, prefill) against the torch reference
backend, over random paged caches. On CPU they run under Triton's interpreter, so the
sizes stay small; on a CUDA machine the same tests run the compiled kernels."""

from __future__ import annotations

import math
import random

import pytest

from kernel_modules import load_kernels

K, DEVICE = load_kernels()
import torch  # noqa: E402  (load_kernels skips the module when torch/triton are missing)

from pocketllm.workers.kernel_policy import KernelPolicy  # noqa: E402
from pocketllm.workers.layers.attention import (ScheduledSeq, TorchAttention,  # noqa: E402
                                                build_metadata)

BS, BLOCKS = 4, 96


def make_step(specs, heads, kv_heads, dim, dtype=torch.float32, seed=0):
    """specs: (tokens already cached, tokens this step) per sequence. Returns the
    scheduled seqs, q/k/v of this step and caches holding the cached part (the rest NaN,
    so a read of an unwritten slot shows)."""
    gen = torch.Generator().manual_seed(seed)
    free = list(range(BLOCKS))
    random.Random(seed).shuffle(free)  # non-contiguous block tables
    slots = BLOCKS * BS + BS
    k_cache = torch.full((slots, kv_heads, dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    k_cache[BLOCKS * BS:] = 0  # the zero padding block the torch path reads
    v_cache[BLOCKS * BS:] = 0
    seqs, qs, ks, vs, row = [], [], [], [], 0
    for cached, n in specs:
        blocks = [free.pop() for _ in range(math.ceil((cached + n) / BS) + 1)]  # one spare
        k = torch.randn(cached + n, kv_heads, dim, generator=gen).to(dtype)
        v = torch.randn(cached + n, kv_heads, dim, generator=gen).to(dtype)
        for p in range(cached):
            slot = blocks[p // BS] * BS + p % BS
            k_cache[slot], v_cache[slot] = k[p], v[p]
        seqs.append(ScheduledSeq(blocks, cached, n, row))
        qs.append(torch.randn(n, heads, dim, generator=gen).to(dtype))
        ks.append(k[cached:])
        vs.append(v[cached:])
        row += n
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return seqs, to(torch.cat(qs)), to(torch.cat(ks)), to(torch.cat(vs)), to(k_cache), to(v_cache)


def run_both(specs, heads, kv_heads, dim, window, softcap, dtype=torch.float32, seed=0,
             backend=None, sinks=None):
    seqs, q, k, v, k_cache, v_cache = make_step(specs, heads, kv_heads, dim, dtype, seed)
    scale = dim ** -0.5
    pad = BLOCKS * BS
    ref_meta = build_metadata(seqs, BS, [window], DEVICE, pad)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    sinks = None if sinks is None else sinks.to(DEVICE)
    ref = TorchAttention().forward(q, k, v, ref_k, ref_v, ref_meta, window, scale, softcap,
                                   sinks=sinks)
    meta = build_metadata(seqs, BS, [window], DEVICE, pad, kernel_tables=True)
    backend = backend or K.attention_backend.TritonAttention()
    out = backend.forward(q, k, v, k_cache, v_cache, meta, window, scale, softcap, sinks=sinks)
    # the cache writes must match too (NaN where neither wrote)
    torch.testing.assert_close(k_cache, ref_k, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, ref_v, equal_nan=True, atol=0, rtol=0)
    return out, ref


@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 3.0), (6, 2.0)])
def test_mixed_step_matches_torch_backend(window, softcap):
    # fresh prefill, chunk over a cached prefix, and decodes of different lengths, GQA 2
    specs = [(0, 7), (5, 6), (9, 1), (2, 1), (13, 1), (0, 1)]
    out, ref = run_both(specs, heads=4, kv_heads=2, dim=32, window=window, softcap=softcap)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_float32_decodes_of_256_wide_heads():
    """Gemma 3's 256-wide heads in a float32 cache: the decode kernel takes half its keys
    a loop (``decode_tiles``; 64 keys needed more shared memory than an H100 has, so the
    first float32 run of the embedded model on a GPU failed at start-up)."""
    assert K.paged_decode_attention.decode_tiles(256, 4)[0] == \
        K.paged_decode_attention.decode_tiles(256, 2)[0] // 2
    out, ref = run_both([(70, 1), (5, 1)], heads=4, kv_heads=1, dim=256, window=None,
                        softcap=None, seed=5)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [None, 40])
def test_long_chunk_over_long_prefix(window):
    # key tiles entirely before the diagonal (unmasked path) and several query blocks;
    # head_dim 24 is not a power of two (masked lanes); GQA 4 over one KV head
    out, ref = run_both([(150, 70), (3, 20)], heads=4, kv_heads=1, dim=24, window=window,
                        softcap=None, seed=3)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [None, 30, 5])
def test_lone_fresh_prefill_on_sdpa(window):
    # a lone prompt from position 0 may take SDPA (window 5 < 11 rows: it must not)
    backend = K.attention_backend.TritonAttention(KernelPolicy(triton=True, sdpa_min_rows=(8, 8)))
    out, ref = run_both([(0, 11), (6, 1)], heads=4, kv_heads=2, dim=32, window=window,
                        softcap=None, seed=11, backend=backend)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(DEVICE.type == "cpu", reason="Triton's interpreter gets tl.dot on "
                    "bfloat16 wrong (numpy has no bfloat16); checked compiled on CUDA")
def test_bfloat16_step():
    out, ref = run_both([(0, 9), (20, 1), (7, 1)], heads=8, kv_heads=2, dim=32, window=None,
                        softcap=None, dtype=torch.bfloat16, seed=5)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(DEVICE.type == "cpu", reason="Triton's interpreter gets tl.dot on "
                    "bfloat16 wrong (numpy has no bfloat16); checked compiled on CUDA")
@pytest.mark.parametrize("window", [None, 64])
def test_bfloat16_step_with_sinks(window):
    # gpt-oss's heads (64 query over 8 KV heads of 64), a long chunk and long decodes
    sinks = torch.randn(64, generator=torch.Generator().manual_seed(2))
    out, ref = run_both([(90, 30), (200, 1), (20, 1)], heads=64, kv_heads=8, dim=64,
                        window=window, softcap=None, dtype=torch.bfloat16, seed=6, sinks=sinks)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("window,softcap", [(None, None), (37, 2.5)])
def test_split_decode_merges_partial_softmaxes(window, softcap):
    # force small partitions: several splits per sequence, some sequences shorter than
    # the others (splits past their end do nothing; the merge must ignore them)
    seqs, q, k, v, k_cache, v_cache = make_step([(200, 1), (33, 1), (90, 1)], 4, 2, 32, seed=7)
    meta = build_metadata(seqs, BS, [window], DEVICE, BLOCKS * BS, kernel_tables=True)
    K.kv_write.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    d = meta.decode
    args = (q, k_cache, v_cache, d.block_tables, d.seq_lens, d.q_start, d.max_seq_len, BS, 0.2,
            window, softcap)
    whole = K.paged_decode_attention.paged_decode_attention(*args, partition=256)
    poisoned = torch.full_like(q, float("nan"))
    split = K.paged_decode_attention.paged_decode_attention(*args, out=poisoned, partition=16)
    ref_meta = build_metadata(seqs, BS, [window], DEVICE, BLOCKS * BS)
    ref = TorchAttention().forward(q, k, v, k_cache.clone(), v_cache.clone(), ref_meta, window,
                                   0.2, softcap)
    torch.testing.assert_close(whole, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(split, ref, atol=2e-5, rtol=2e-5)
    # a grid sized for 64-key splits, each sequence cutting its own into splits of at
    # least 16 (the 34- and 91-key ones run 3 splits each instead of 1 and 2)
    shrunk = K.paged_decode_attention.paged_decode_attention(
        *args, out=torch.full_like(q, float("nan")), partition=64, min_partition=16,
        tiles=(16, 4))
    torch.testing.assert_close(shrunk, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window,softcap", [(None, None), (37, 2.5)])
def test_decode_only_step_writes_new_kv_in_the_decode_kernel(window, softcap):
    # no prefill: the backend skips the kv_write launch; run_both checks the cache too
    specs = [(200, 1), (33, 1), (90, 1), (0, 1)]
    out, ref = run_both(specs, heads=4, kv_heads=2, dim=32, window=window, softcap=softcap,
                        seed=13)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    # and with small splits: only the split that holds the new token writes it
    seqs, q, k, v, k_cache, v_cache = make_step(specs, 4, 2, 32, seed=13)
    meta = build_metadata(seqs, BS, [window], DEVICE, BLOCKS * BS, kernel_tables=True)
    d = meta.decode
    split = K.paged_decode_attention.paged_decode_attention(
        q, k_cache, v_cache, d.block_tables, d.seq_lens, d.q_start, d.max_seq_len, BS,
        32 ** -0.5, window, softcap, partition=16, new_kv=(k, v, meta.slot_mapping))
    torch.testing.assert_close(split, ref, atol=2e-5, rtol=2e-5)
    assert not torch.isnan(k_cache[meta.slot_mapping.long()]).any()


def test_verification_rows_as_decodes_have_their_decode_steps_bits():
    """A speculative step's rows run as decodes (``rows_as_decodes``: an eager hybrid
    model's verification): each row gets exactly the output of a decode step of its
    sequences at its position, the keys split as for a step of two sequences."""
    specs = [(57, 4), (20, 3)]  # a last token and 3 and 2 drafts
    seqs, q, k, v, k_cache, v_cache = make_step(specs, 4, 2, 32, seed=21)
    policy = KernelPolicy(triton=True, decode_min_partition=16)  # splits of 16 keys
    backend = K.attention_backend.TritonAttention(policy)
    meta = build_metadata(seqs, BS, [None], DEVICE, BLOCKS * BS, kernel_tables=True,
                          rows_as_decodes=True)
    assert meta.prefill is None and meta.decode.num_seqs == 2
    out = backend.forward(q, k, v, k_cache, v_cache, meta, None, 32 ** -0.5, None)
    for j in range(3):  # the step whose decodes are each sequence's j-th row
        rows = [s.row + j for s in seqs]
        step = [ScheduledSeq(s.block_ids, s.start + j, 1, i) for i, s in enumerate(seqs)]
        alone = build_metadata(step, BS, [None], DEVICE, BLOCKS * BS, kernel_tables=True)
        got = backend.forward(q[rows], k[rows], v[rows], k_cache.clone(), v_cache.clone(),
                              alone, None, 32 ** -0.5, None)
        assert torch.equal(out[rows], got)
    with pytest.raises(ValueError, match="Triton"):
        build_metadata(seqs, BS, [None], DEVICE, BLOCKS * BS, rows_as_decodes=True)


def test_split_merge_in_the_decode_kernel_is_race_free():
    # The last split to arrive merges: a missing fence or a stale read would show as a
    # wrong row now and then, so on a GPU repeat over fresh inputs (few reps interpreted).
    reps = 40 if DEVICE.type == "cuda" else 2
    for rep in range(reps):
        rng = random.Random(rep)
        specs = [(rng.randrange(1, 40), 1) for _ in range(8)]  # up to 5 splits of 8
        seqs, q, k, v, k_cache, v_cache = make_step(specs, 8, 2, 32, seed=100 + rep)
        meta = build_metadata(seqs, BS, [None], DEVICE, BLOCKS * BS, kernel_tables=True)
        ref_meta = build_metadata(seqs, BS, [None], DEVICE, BLOCKS * BS)
        ref = TorchAttention().forward(q, k, v, k_cache.clone(), v_cache.clone(), ref_meta,
                                       None, 0.2, None)
        d = meta.decode
        out = K.paged_decode_attention.paged_decode_attention(
            q, k_cache, v_cache, d.block_tables, d.seq_lens, d.q_start, d.max_seq_len, BS, 0.2,
            partition=8, new_kv=(k, v, meta.slot_mapping))
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


SINKS = torch.tensor([0.5, -1.0, 2.0, 3.0])  # gpt-oss: a logit per query head


@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (6, 2.0)])
def test_sinks_in_prefill_and_decode_match_torch_backend(window, softcap):
    specs = [(0, 7), (5, 6), (9, 1), (2, 1), (13, 1), (0, 1)]
    out, ref = run_both(specs, heads=4, kv_heads=2, dim=32, window=window, softcap=softcap,
                        sinks=SINKS)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    plain, _ = run_both(specs, heads=4, kv_heads=2, dim=32, window=window, softcap=softcap)
    assert (out - plain).abs().max() > 0.05  # the sinks took a visible share


def test_sinks_keep_a_lone_fresh_prompt_off_sdpa():
    backend = K.attention_backend.TritonAttention(KernelPolicy(triton=True, sdpa_min_rows=(8, 8)))
    out, ref = run_both([(0, 11)], heads=4, kv_heads=2, dim=32, window=None, softcap=None,
                        seed=11, backend=backend, sinks=SINKS)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [None, 37])
def test_sinks_enter_a_split_decode_once_in_the_merge(window):
    seqs, q, k, v, k_cache, v_cache = make_step([(200, 1), (33, 1), (90, 1)], 4, 2, 32, seed=7)
    meta = build_metadata(seqs, BS, [window], DEVICE, BLOCKS * BS, kernel_tables=True)
    sinks = SINKS.to(DEVICE)
    d = meta.decode
    split = K.paged_decode_attention.paged_decode_attention(
        q, k_cache, v_cache, d.block_tables, d.seq_lens, d.q_start, d.max_seq_len, BS, 0.2,
        window, None, partition=16, new_kv=(k, v, meta.slot_mapping), sinks=sinks)
    ref_meta = build_metadata(seqs, BS, [window], DEVICE, BLOCKS * BS)
    ref = TorchAttention().forward(q, k, v, k_cache.clone(), v_cache.clone(), ref_meta, window,
                                   0.2, None, sinks=sinks)
    torch.testing.assert_close(split, ref, atol=2e-5, rtol=2e-5)


def test_warm_up_runs_every_variant_and_touches_only_the_padding_block():
    k_cache = torch.full((BLOCKS * BS + BS, 2, 32), float("nan"), device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    k_cache[BLOCKS * BS:] = 0
    v_cache[BLOCKS * BS:] = 0
    backend = K.attention_backend.TritonAttention(KernelPolicy(triton=True, sdpa_min_rows=(8, 8)))
    backend.warm_up(k_cache, v_cache, 4, BLOCKS, BS, {(None, None), (5, 2.0)}, 0.2)
    backend.warm_up(k_cache, v_cache, 4, BLOCKS, BS, {(5, None)}, 0.2, sinks=True)
    assert torch.isnan(k_cache[:BLOCKS * BS]).all() and torch.isnan(v_cache[:BLOCKS * BS]).all()
    assert not k_cache[BLOCKS * BS:].any() and not v_cache[BLOCKS * BS:].any()


def test_prefill_small_tiles_many_query_blocks():
    seqs, q, k, v, k_cache, v_cache = make_step([(10, 50), (0, 33)], 2, 2, 16, seed=9)
    meta = build_metadata(seqs, BS, [7], DEVICE, BLOCKS * BS, kernel_tables=True)
    K.kv_write.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    p = meta.prefill
    out = K.prefill_attention.prefill_attention(
        q, k_cache, v_cache, p.block_tables, p.seq_lens, p.q_start, p.q_lens, p.max_q_len, BS,
        0.25, 7, None, out=torch.full_like(q, float("nan")), tiles=(16, 16, 4, 1))
    ref_meta = build_metadata(seqs, BS, [7], DEVICE, BLOCKS * BS)
    ref = TorchAttention().forward(q, k, v, k_cache.clone(), v_cache.clone(), ref_meta, 7, 0.25,
                                   None)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_kernel_metadata_layout():
    seqs = [ScheduledSeq([7, 3, 9], 5, 6, 0), ScheduledSeq([4, 1], 6, 1, 6),
            ScheduledSeq([2], 0, 3, 7)]
    meta = build_metadata(seqs, 4, [None], torch.device("cpu"), 40, kernel_tables=True)
    torch_meta = build_metadata(seqs, 4, [None], torch.device("cpu"), 40)
    assert meta.slot_mapping.tolist() == torch_meta.slot_mapping.tolist()
    assert meta.groups == [] and meta.block_size == 4 and meta.num_tokens == 10
    d, p = meta.decode, meta.prefill
    assert (d.seq_lens.tolist(), d.q_start.tolist(), d.q_lens.tolist()) == ([7], [6], [1])
    assert d.block_tables.tolist() == [[4, 1]] and (d.max_seq_len, d.max_q_len) == (7, 1)
    assert p.seq_lens.tolist() == [11, 3] and p.q_start.tolist() == [0, 7]
    assert p.block_tables.tolist() == [[7, 3, 9], [2, 0, 0]]
    assert (p.max_seq_len, p.max_q_len) == (11, 6)
    assert build_metadata(seqs[1:2], 4, [None], torch.device("cpu"), 40,
                          kernel_tables=True).prefill is None


@pytest.mark.parametrize("seed", range(5))
def test_kernel_metadata_sections_start_16_byte_aligned(seed):
    """Triton compiles a kernel variant per pointer alignment: a section whose alignment
    followed the step's token count would compile new variants while serving."""
    rng = random.Random(seed)
    seqs, row = [], 0
    for _ in range(rng.randrange(1, 9)):
        n = rng.choice([1, 1, rng.randrange(2, 30)])
        start = rng.randrange(0, 20)
        blocks = list(range(-(-(start + n) // 4)))
        seqs.append(ScheduledSeq(blocks, start, n, row))
        row += n
    meta = build_metadata(seqs, 4, [None], torch.device("cpu"), 400, kernel_tables=True)
    for paged in (meta.decode, meta.prefill):
        if paged is not None:
            for t in (paged.block_tables, paged.seq_lens, paged.q_start, paged.q_lens):
                assert (t.data_ptr() - meta.slot_mapping.data_ptr()) % 16 == 0


def test_policy_splits_a_small_decode_batch_and_not_a_full_one():
    """The kernel policy's decode split: a batch that already fills the GPU runs unsplit;
    a small one is cut into splits of at least ``decode_min_partition`` keys, whole loops
    of the kernel's ``block_n``, enough for about ``decode_programs_per_sm`` per SM. And
    SDPA takes a lone fresh prompt from the threshold of its head_dim class."""
    policy = KernelPolicy(triton=True, decode_min_partition=64, decode_programs_per_sm=8,
                          sdpa_min_rows=(512, 1024))
    assert policy.decode_partition(132, 1, 4096, sms=132, block_n=64) == 4096
    assert policy.decode_partition(1, 8, 40, sms=132, block_n=64) == 40
    part = policy.decode_partition(1, 8, 4096, sms=132, block_n=64)
    assert part % 64 == 0 and part >= 64
    assert -(-4096 // part) == 64  # min(8 * 132 / 8 programs, 4096 / 64) = 64 splits
    assert policy.fresh_prefill_on_sdpa(512, 128) and not policy.fresh_prefill_on_sdpa(511, 128)
    assert not policy.fresh_prefill_on_sdpa(1000, 256) and policy.fresh_prefill_on_sdpa(1024, 256)
