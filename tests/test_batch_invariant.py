"""Batch-invariant mode: a row's result does not depend on what else shares its step.

The kernel tests run compiled on a CUDA machine and under Triton's interpreter on CPU
(small sizes); the engine test needs CUDA, where the mode exists (kernel_policy.py).
"""

from __future__ import annotations

import random

import pytest

from kernel_modules import load_kernels

K, DEVICE = load_kernels()
import torch  # noqa: E402  (load_kernels skips the module when torch/triton are missing)

from pocketllm.workers.kernel_policy import KernelPolicy  # noqa: E402
from pocketllm.proto.messages import SamplingSpec  # noqa: E402
from pocketllm.workers.layers.attention import ScheduledSeq, build_metadata  # noqa: E402
from pocketllm.workers.sampler import torch_ops  # noqa: E402
from pocketllm.workers.sampler.rules import Sampler  # noqa: E402

CUDA = DEVICE.type == "cuda"
DTYPES = [torch.float32, torch.bfloat16] if CUDA else [torch.float32]


def same_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal on CUDA, where the mode runs. Under the interpreter a ``tl.dot`` is numpy's
    BLAS, whose rounding of a row may depend on the rows beside it in the tile (OpenBLAS
    0.3.31 on an AVX2 EPYC does, for any core type): there the rows must agree to float32
    rounding, and the bit-exact property is the GPU run's to show."""
    if CUDA:
        return torch.equal(a, b)
    return a.shape == b.shape and torch.allclose(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_rows_do_not_depend_on_the_batch(dtype):
    gen = torch.Generator().manual_seed(0)
    n, k = (200, 256) if CUDA else (40, 48)  # k not a multiple of the K chunk on CPU
    weight = torch.randn(n, k, generator=gen).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(dtype).to(DEVICE)
    rows = torch.randn(300, k, generator=gen).to(dtype).to(DEVICE)
    full = K.bi_matmul.linear(rows, weight, bias)  # the largest tier's tile
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(full.float(), torch.nn.functional.linear(rows, weight, bias).float(),
                               **tol)
    for m in (1, 2, 31, 33, 63, 65, 130, 257):  # alone, and in every tier's tile, every fill
        assert same_rows(K.bi_matmul.linear(rows[:m], weight, bias), full[:m])
    assert same_rows(K.bi_matmul.linear(rows[77:78], weight, bias), full[77:78])
    logits = K.bi_matmul.linear(rows[:3], weight, out_dtype=torch.float32)
    assert logits.dtype == torch.float32 and same_rows(
        logits, K.bi_matmul.linear(rows, weight, out_dtype=torch.float32)[:3])


BS, PAGES, HEADS, KV_HEADS = 4, 64, 4, 2


def _attend(backend, q_all, k_all, v_all, chunks, blocks, dtype):
    """Run one step holding, per sequence, the chunk (start, length) of its positions,
    with the positions before each chunk already in the cache; the rows' outputs."""
    dim = q_all[0].shape[-1]
    slots = (PAGES + 1) * BS
    k_cache = torch.zeros(slots, KV_HEADS, dim, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    seqs, qs, ks, vs, row = [], [], [], [], 0
    for s, (start, length) in enumerate(chunks):
        for p in range(start):
            slot = blocks[s][p // BS] * BS + p % BS
            k_cache[slot], v_cache[slot] = k_all[s][p], v_all[s][p]
        seqs.append(ScheduledSeq(blocks[s], start, length, row))
        qs.append(q_all[s][start:start + length])
        ks.append(k_all[s][start:start + length])
        vs.append(v_all[s][start:start + length])
        row += length
    meta = build_metadata(seqs, BS, [None], DEVICE, PAGES * BS, kernel_tables=True)
    return backend["attn"](torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, meta)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_rows_do_not_depend_on_chunking_or_neighbours(window, dtype):
    """A row attends the same whether its keys came from its own chunk or the cache, in
    a decode or a prefill, alone or beside other sequences."""
    dim, length = 16, 37
    gen = torch.Generator().manual_seed(1)

    def seq(n):
        return [torch.randn(n, h, dim, generator=gen).to(dtype).to(DEVICE)
                for h in (HEADS, KV_HEADS, KV_HEADS)]

    (q, k, v), (oq, ok, ov) = seq(length), seq(23)
    pages = list(range(PAGES))
    random.Random(2).shuffle(pages)
    blocks = [pages[:12], pages[12:24]]
    tri = K.attention_backend.TritonAttention(KernelPolicy(triton=True, batch_invariant=True))
    backend = {"attn": lambda *a: tri.forward(*a, window, dim ** -0.5, None)}

    def rows_of(chunks, q_all=(q, oq), k_all=(k, ok), v_all=(v, ov)):
        return _attend(backend, list(q_all), list(k_all), list(v_all), chunks, blocks, dtype)

    whole = rows_of([(0, length)], [q], [k], [v])  # alone, one chunk
    chunked = rows_of([(20, length - 20), (0, 9)])  # the last 17 rows, beside a prefill
    assert same_rows(chunked[:length - 20], whole[20:])
    decode = rows_of([(length - 1, 1), (22, 1)])  # the last row as a decode, beside a decode
    assert same_rows(decode[:1], whole[length - 1:])
    odd = rows_of([(3, 11)], [q], [k], [v])  # a chunk that starts mid-tile
    assert same_rows(odd, whole[3:14])


def test_sampler_draws_a_row_the_same_in_any_batch():
    vocab = 300
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, vocab, generator=gen).to(DEVICE)
    target = SamplingSpec(temperature=0.8, top_k=40, top_p=0.9, seed=7)
    others = [SamplingSpec(temperature=1.0, top_k=k, top_p=p, seed=s)
              for k, p, s in ((0, 1.0, 1), (5, 0.5, 2), (40, 1.0, 3), (0, 0.7, 4), (0, 1.0, 0))]
    sampler = Sampler(torch_ops, 0)
    alone, _ = sampler.draw(logits[2:3].clone(), [target], [11])
    specs = others[:2] + [target] + others[2:]
    mixed, _ = sampler.draw(logits.clone(), specs, [5, 6, 11, 7, 8, 9])
    assert mixed[2].item() == alone[0].item()
    # and its token over many positions matches, whatever shares the step
    for pos in range(40):
        a, _ = sampler.draw(logits[2:3].clone(), [target], [pos])
        m, _ = sampler.draw(logits.clone(), specs, [1, 2, pos, 3, 4, 5])
        assert m[2].item() == a[0].item()


def test_mode_is_refused_where_it_cannot_hold(tiny_llama):
    from pocketllm import LLM, EngineArgs, UnsupportedFeatureError

    with pytest.raises(UnsupportedFeatureError, match="tensor parallelism"):
        EngineArgs(model=tiny_llama, batch_invariant=True, tensor_parallel_size=2)
    if not CUDA:
        with pytest.raises(UnsupportedFeatureError, match="CUDA"):
            LLM(EngineArgs(model=tiny_llama, batch_invariant=True, device="cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="batch-invariant mode is a CUDA mode")
def test_requests_alone_and_in_50_random_mixes_give_one_sequence(tiny_llama):
    """Seeded and greedy requests, alone and then inside random concurrent mixes (other
    lengths, preemption under a small KV budget, prefix-cache hits): one distinct token
    sequence each, with CUDA graphs, chunked prefill and overlap on."""
    from pocketllm import LLM, EngineArgs, SamplingParams
    from pocketllm.bench.throughput import settled_stats

    seeded = SamplingParams(max_tokens=48, temperature=1.0, top_p=0.95, seed=99, ignore_eos=True)
    greedy = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    target = "the same request each time, " * 5
    rng = random.Random(5)
    with LLM(EngineArgs(model=tiny_llama, batch_invariant=True, num_kv_blocks=40,
                        max_num_seqs=16, max_num_batched_tokens=64, seed=0)) as llm:
        assert llm.capabilities.batch_invariant
        alone = {"seeded": llm.generate(target, seeded)[0].token_ids,
                 "greedy": llm.generate(target, greedy)[0].token_ids}
        seen = {"seeded": set(), "greedy": set()}
        for _ in range(50):
            mix = []
            for _ in range(rng.randint(1, 10)):
                words = " ".join(f"w{rng.randint(0, 999)}" for _ in range(rng.randint(1, 60)))
                prompt = target + words if rng.random() < 0.3 else words  # some share a prefix
                mix.append((prompt, SamplingParams(max_tokens=rng.randint(1, 64),
                                                   temperature=rng.choice([0.0, 1.0]),
                                                   top_k=rng.choice([0, 20]), ignore_eos=True)))
            mix.insert(rng.randint(0, len(mix)), (target, seeded))
            mix.insert(rng.randint(0, len(mix)), (target, greedy))
            outs = llm.generate([p for p, _ in mix], [sp for _, sp in mix])
            for (_, sp), out in zip(mix, outs):
                if sp is seeded:
                    seen["seeded"].add(tuple(out.token_ids))
                elif sp is greedy:
                    seen["greedy"].add(tuple(out.token_ids))
        stats = settled_stats(llm)
    assert seen == {"seeded": {tuple(alone["seeded"])}, "greedy": {tuple(alone["greedy"])}}
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0  # both were exercised
