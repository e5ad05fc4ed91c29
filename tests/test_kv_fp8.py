"""The FP8 KV cache (``--kv-cache-dtype fp8``, workers/kernels/kv_fp8.py): the codes and
scales the kernels write, against torch's own e4m3 rounding; the attention kernels over
such a cache, against the torch reference over the same values as float; and where the
engine refuses it. On CPU the kernels run under Triton's interpreter."""

from __future__ import annotations

import pytest

from kernel_modules import load_kernels

K, DEVICE = load_kernels()
import torch  # noqa: E402

from pocketllm.config import EngineArgs  # noqa: E402
from pocketllm.errors import InvalidRequestError, UnsupportedFeatureError  # noqa: E402
from pocketllm.workers.kernel_policy import KernelPolicy  # noqa: E402
from pocketllm.workers.kv_cache import PagedKVCache, cache_layout  # noqa: E402
from pocketllm.workers.layers.attention import (ScheduledSeq, TorchAttention,  # noqa: E402
                                                build_metadata)

kv_fp8 = K.kv_fp8
BS, BLOCKS = 4, 40


def fp8_cache(kv_heads: int, dim: int, layers: int = 1):
    """A one-group FP8 PagedKVCache (BLOCKS blocks of BS) and its first layer's (k, v)."""
    layout = cache_layout([None] * layers, 4096)
    kv = PagedKVCache(layout, [BLOCKS], BS, kv_heads, dim, torch.float32, DEVICE,
                      kv_dtype=torch.float8_e4m3fn)
    return kv, kv.layer_caches[0]


def expected(x: torch.Tensor):
    """Per (position, head): the biased exponent of the least power of two >= amax / 448,
    and x over it rounded by torch (to nearest, ties to even)."""
    amax = x.abs().amax(-1).float() / 448
    e = torch.where(amax > 0, torch.ceil(torch.log2(amax)), torch.full_like(amax, -126))
    e = e.clamp(-126, 126) + 127
    scaled = x.float() / torch.exp2(e - 127)[..., None]
    return e.to(torch.uint8), scaled.to(torch.float8_e4m3fn)


def values(tokens: int, heads: int, dim: int, seed: int = 0) -> torch.Tensor:
    """Rows of every magnitude: normal, tiny (e4m3's subnormals), huge, zero, and values
    halfway between two codes (the rounding's ties)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, heads, dim, generator=gen)
    x *= torch.exp2(torch.randint(-30, 30, (tokens, heads, 1), generator=gen).float())
    x[0, 0] = 0  # a head of zeros
    x[1, 0, :] = torch.randn(dim, generator=gen) * 1e-4  # mostly subnormal codes
    x[1, 0, 0] = 448.0  # scale 1: the rest below 2^-6
    codes = torch.arange(0, 126, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    ties = (codes[:-1] + codes[1:]) / 2  # exactly between neighbours
    n = min(dim - 1, len(ties))
    x[2, 0, :n] = ties[torch.randperm(len(ties), generator=gen)[:n]]
    x[2, 0, n:] = 0
    x[2, 0, -1] = 448.0  # scale 1: the ties stay ties
    x[3, -1] = -x[3, -1].abs()
    return x


@pytest.mark.parametrize("dim", [32, 24])
def test_kv_write_codes_and_scales_match_torch(dim):
    heads, tokens = 3, 6
    kv, (k_cache, v_cache) = fp8_cache(heads, dim)
    k, v = values(tokens, heads, dim, 1), values(tokens, heads, dim, 2)
    slots = torch.tensor([5, 0, 17, 3, -1, 40], dtype=torch.int32)  # -1: written nowhere
    K.kv_write.write_kv(k.to(DEVICE), v.to(DEVICE), k_cache, v_cache, slots.to(DEVICE))
    for x, cache in ((k, k_cache), (v, v_cache)):
        e, q = expected(x)
        live = slots >= 0
        got_e = kv_fp8.exponents(cache)[slots[live].long()].cpu()
        got_q = cache[slots[live].long()].cpu()
        assert torch.equal(got_e, e[live])
        assert torch.equal(got_q.view(torch.uint8), q[live].view(torch.uint8))
        # and the values they stand for are x to e4m3's precision
        back = kv_fp8.dequantize(cache)[slots[live].long()].cpu()
        assert torch.allclose(back, x[live], rtol=2 ** -4, atol=0) or \
            ((back - x[live]).abs() <= x[live].abs().amax(-1, keepdim=True) * 2 ** -12
             + x[live].abs() * 2 ** -4).all()
    untouched = torch.ones(k_cache.shape[0], dtype=torch.bool)
    untouched[slots[slots >= 0].long()] = False
    for cache in (k_cache, v_cache):  # nothing else written
        assert not cache.view(torch.uint8)[untouched.to(DEVICE)].any()
        assert not kv_fp8.exponents(cache)[untouched.to(DEVICE)].any()


def make_step(specs, heads, kv_heads, dim, seed=0):
    """specs: (tokens cached, tokens this step) per sequence -> the scheduled seqs, q/k/v
    of the step, and an FP8 cache holding the cached positions (written by kv_write)."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(BLOCKS, generator=gen).tolist()
    kv, (k_cache, v_cache) = fp8_cache(kv_heads, dim)
    seqs, qs, ks, vs, row = [], [], [], [], 0
    for cached, n in specs:
        blocks = [order.pop() for _ in range(-(-(cached + n) // BS))]
        k = torch.randn(cached + n, kv_heads, dim, generator=gen) * 3
        v = torch.randn(cached + n, kv_heads, dim, generator=gen)
        slots = torch.tensor([blocks[p // BS] * BS + p % BS for p in range(cached)],
                             dtype=torch.int32)
        K.kv_write.write_kv(k[:cached].to(DEVICE), v[:cached].to(DEVICE), k_cache, v_cache,
                            slots.to(DEVICE))
        seqs.append(ScheduledSeq(blocks, cached, n, row))
        qs.append(torch.randn(n, heads, dim, generator=gen))
        ks.append(k[cached:])
        vs.append(v[cached:])
        row += n
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return seqs, to(torch.cat(qs)), to(torch.cat(ks)), to(torch.cat(vs)), k_cache, v_cache


@pytest.mark.parametrize("specs", [
    [(5, 6), (9, 1), (2, 1), (13, 1), (0, 3)],  # chunks and decodes: kv_write, then both
    [(9, 1), (2, 1), (13, 1), (0, 1)],  # decodes only: the decode kernel writes the rows
])
@pytest.mark.parametrize("window,softcap,sinks", [(None, None, False), (5, None, False),
                                                  (None, 2.0, True)])
def test_attention_over_fp8_cache_matches_reference(specs, window, softcap, sinks):
    heads, kv_heads, dim = 4, 2, 32
    seqs, q, k, v, k_cache, v_cache = make_step(specs, heads, kv_heads, dim)
    scale = dim ** -0.5
    pad = BLOCKS * BS
    sinks = torch.linspace(-1, 2, heads).to(DEVICE) if sinks else None
    meta = build_metadata(seqs, BS, [window], DEVICE, pad, kernel_tables=True)
    out = K.attention_backend.TritonAttention().forward(q, k, v, k_cache, v_cache, meta, window,
                                                        scale, softcap, sinks=sinks)
    # The reference: float caches holding exactly the values the FP8 cache stands for,
    # this step's rows included (the kernels wrote them, as codes)
    ref_k, ref_v = kv_fp8.dequantize(k_cache), kv_fp8.dequantize(v_cache)
    slots = meta.slot_mapping.long()
    ref = TorchAttention().forward(q, ref_k[slots], ref_v[slots], ref_k.clone(), ref_v.clone(),
                                   build_metadata(seqs, BS, [window], DEVICE, pad), window,
                                   scale, softcap, sinks=sinks)
    torch.testing.assert_close(out, ref, atol=3e-5, rtol=3e-5)
    # and the step's rows are e4m3 copies of k and v
    assert torch.allclose(ref_k[slots], k, rtol=2 ** -4, atol=k.abs().max().item() * 2 ** -12)


def test_capacity_is_about_twice_the_model_dtype():
    from pocketllm.workers.device import kv_bytes_per_block

    bf16 = kv_bytes_per_block(32, 16, 8, 128, torch.bfloat16)
    fp8 = kv_bytes_per_block(32, 16, 8, 128, torch.float8_e4m3fn)
    assert bf16 / fp8 == pytest.approx(2 * 128 / 129)


def test_engine_args_and_refusals():
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype"):
        EngineArgs(kv_cache_dtype="int4")
    assert EngineArgs(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    torch_path = KernelPolicy(triton=False)
    assert torch_path.kv_cache_dtype("auto", torch.device("cpu"), torch.bfloat16,
                                     False) is torch.bfloat16
    with pytest.raises(UnsupportedFeatureError, match="Triton attention kernels"):
        torch_path.kv_cache_dtype("fp8", torch.device("cpu"), torch.float32, False)
    with pytest.raises(UnsupportedFeatureError, match="MLA"):
        KernelPolicy(triton=True).kv_cache_dtype("fp8", DEVICE, torch.bfloat16, True)


@pytest.mark.parametrize("new_kv", [False, True])
def test_split_decode_over_fp8_cache(new_kv):
    """Keys cut into splits merged in the launch (flash-decoding), with and without the
    kernel writing the new rows: as the same kernel over the float values."""
    heads, kv_heads, dim = 4, 2, 32
    specs = [(30, 1), (7, 1), (41, 1)]
    seqs, q, k, v, k_cache, v_cache = make_step(specs, heads, kv_heads, dim, seed=3)
    meta = build_metadata(seqs, BS, [None], DEVICE, BLOCKS * BS, kernel_tables=True)
    d = meta.decode
    if not new_kv:
        K.kv_write.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    ref_k, ref_v = kv_fp8.dequantize(k_cache), kv_fp8.dequantize(v_cache)
    kw = dict(partition=8, new_kv=(k, v, meta.slot_mapping) if new_kv else None)
    out = K.paged_decode_attention.paged_decode_attention(
        q, k_cache, v_cache, d.block_tables, d.seq_lens, d.q_start, d.max_seq_len, BS,
        dim ** -0.5, **kw)
    if new_kv:  # the rows it wrote, as float, for the float run
        ref_k, ref_v = kv_fp8.dequantize(k_cache), kv_fp8.dequantize(v_cache)
        kw["new_kv"] = (ref_k[meta.slot_mapping.long()], ref_v[meta.slot_mapping.long()],
                        meta.slot_mapping)
    ref = K.paged_decode_attention.paged_decode_attention(
        q, ref_k, ref_v, d.block_tables, d.seq_lens, d.q_start, d.max_seq_len, BS,
        dim ** -0.5, **kw)
    torch.testing.assert_close(out, ref, atol=3e-5, rtol=3e-5)


def test_the_cpu_worker_refuses_an_fp8_cache():
    from test_worker_parity import make_runner
    from tiny_checkpoints import make_tiny_checkpoint

    with pytest.raises(UnsupportedFeatureError, match="kv_cache_dtype=fp8 needs"):
        make_runner(make_tiny_checkpoint("llama"), device="cpu", kv_cache_dtype="fp8")


# --- whole engines, on a GPU -------------------------------------------------------------

@pytest.mark.skipif(DEVICE.type != "cuda" or torch.cuda.get_device_capability() < (8, 9),
                    reason="e4m3 conversions (compute capability 8.9+)")
@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt_oss", "qwen3_5"])
def test_an_fp8_cache_tracks_the_model_dtype_cache(family):
    """Greedy decoding with CUDA graphs over an FP8 cache: the same tokens as over a
    bfloat16 one until a near-tie of the tiny random model, each token's log probability
    close (measured on an H100: within 0.021 for llama, 0.023 gemma3, 0.158 gpt-oss);
    the pools hold 2 * D / (D + 1) times the positions a byte."""
    from test_fp8_linear import _greedy, assert_tracks
    from test_worker_parity import PROMPT
    from tiny_checkpoints import make_tiny_checkpoint

    from pocketllm.model_info import load_model_info
    from pocketllm.workers.runner import ModelRunner

    path = make_tiny_checkpoint(family)

    def runner(kv_cache_dtype):
        args = EngineArgs(model=path, device="cuda", dtype="bfloat16", block_size=16,
                          num_kv_blocks=64, max_num_seqs=4, kv_cache_dtype=kv_cache_dtype)
        return ModelRunner(load_model_info(args), args)

    fp8, ref = runner("fp8"), runner("auto")
    first = fp8.model.layer_group.index(0)  # an attention layer (Qwen3.5's first is not)
    assert fp8.kv_caches[first][0].dtype == torch.float8_e4m3fn
    dim = ref.kv_caches[first][0].shape[-1]
    assert ref.kv.pools[0].nbytes / fp8.kv.pools[0].nbytes == pytest.approx(2 * dim / (dim + 1))
    got_tokens, got = _greedy(fp8, PROMPT, new_tokens=16)
    want_tokens, want = _greedy(ref, PROMPT, new_tokens=16)
    # gpt-oss's tiny model (sinks, a window) moved most: 0.158 at one step (H100, session 28)
    assert_tracks(got_tokens, got, want_tokens, want, atol=0.25)
