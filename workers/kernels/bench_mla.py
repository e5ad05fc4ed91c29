"""The MLA decode kernel at DeepSeek's widths (R=512, P=64; H=16 as V2-Lite, H=128 as
V3, one rank): achieved cache-read bandwidth, error, and time against its roofline.

    python -m pocketllm.workers.kernels.bench_mla [--ctx 4096 ...] [--batch 1 64 ...]
        [--heads 16 128] [--tune] [--out DIR]

CUDA only. Every sequence of a case holds exactly ``ctx`` tokens in blocks of 16 drawn in
random order. ``cache_gbs`` is the bytes of the cache rows the step must read
(batch x ctx x (R + P) x 2) over the CUDA-graph time (L2 flushed between runs);
``of_hbm`` is that over the device's copy bandwidth (read + write bytes a second: what
HBM moves, in any mix). ``roofline_ms`` is the larger of that read time and the time of
the step's FLOPs (2 x H x (2R + P) per key) at ``PEAK_BF16``, the H200's dense bfloat16
tensor rate (which Triton's mma on 16- or 32-row tiles does not reach). ``torch_ms``:
the same attention gathered and batched in torch (bf16 einsum), eager, where the gathered
copy is small. ``--tune`` also sweeps the tile, then the partition, per case.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch

from ..device import copy_bandwidth
from ..kernel_policy import KernelPolicy
from .bench import BF16, DEV, ROWS, emit, graph_ms, median_ms, rel_err
from .mla_decode import default_tiles, mla_decode_attention, mla_partition

RANK, ROPE, BLOCK = 512, 64, 16
PEAK_BF16 = 989e12  # H200 (SXM) dense bfloat16 FLOP/s, the spec sheet's
TILE_SWEEP = list(itertools.product((16, 32, 64), (16, 32, 64), (4, 8, 16), (1, 2)))
CHECK_SEQS = 8  # sequences checked against the float32 gather (the rest are timed only)


def case(batch: int, heads: int, ctx: int, seed: int = 0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    per_seq = -(-ctx // BLOCK)
    blocks = torch.randperm(batch * per_seq, device=DEV, generator=gen)
    cache = torch.randn(batch * per_seq * BLOCK, RANK + ROPE, device=DEV, generator=gen).to(BF16)
    tables = blocks.view(batch, per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    q_rows = torch.arange(batch, device=DEV)
    q_latent = torch.randn(batch, heads, RANK, device=DEV, generator=gen).to(BF16)
    q_rope = torch.randn(batch, heads, ROPE, device=DEV, generator=gen).to(BF16)
    return q_latent, q_rope, cache, tables, seq_lens, q_rows


def gathered(q_latent, q_rope, cache, tables, ctx: int, scale: float, upto=None):
    """Plain torch: gather every sequence's rows, score, softmax, weighted sum."""
    n = tables.shape[0] if upto is None else min(upto, tables.shape[0])
    pos = torch.arange(ctx, device=DEV)
    slots = tables[:n].long()[:, pos // BLOCK] * BLOCK + pos % BLOCK  # [n, ctx]
    rows = cache[slots]  # [n, ctx, R + P]
    scores = (torch.einsum("bhr,blr->bhl", q_latent[:n], rows[..., :RANK])
              + torch.einsum("bhp,blp->bhl", q_rope[:n], rows[..., RANK:]))
    probs = torch.softmax(scores.float() * scale, dim=-1).to(rows.dtype)
    return torch.einsum("bhl,blr->bhr", probs, rows[..., :RANK])


def run(batch: int, heads: int, ctx: int, bandwidth: float, tune: bool) -> None:
    q_latent, q_rope, cache, tables, seq_lens, q_rows = inputs = case(batch, heads, ctx)
    scale = (128 + ROPE) ** -0.5
    part = mla_partition(KernelPolicy(triton=True), batch, heads, ctx, RANK, ROPE, 2, DEV)
    out = torch.empty_like(q_latent)

    def ours(partition=part, tiles=None):
        return lambda: mla_decode_attention(*inputs, ctx, BLOCK, scale, out=out,
                                            partition=partition, tiles=tiles)
    ours()()
    truth = gathered(*[t.float() for t in (q_latent, q_rope, cache)], tables, ctx, scale,
                     CHECK_SEQS)
    err = rel_err(out[:CHECK_SEQS], truth)
    cache_bytes = batch * ctx * (RANK + ROPE) * cache.element_size()
    flops = 2 * batch * heads * ctx * (2 * RANK + ROPE)
    row = dict(section="mla", case=f"B{batch} H{heads} ctx{ctx}", partition=part,
               tiles=list(default_tiles(heads, cache.element_size())),
               splits=-(-ctx // part), graph_ms=graph_ms(ours()), eager_ms=median_ms(ours()),
               err=err)
    if batch * ctx <= 64 * 8192:  # the gathered copy must fit beside the cache
        gather = lambda: gathered(q_latent, q_rope, cache, tables, ctx, scale)  # noqa: E731
        row.update(torch_ms=median_ms(gather), torch_err=rel_err(gather()[:CHECK_SEQS], truth))
    read_ms = 1e3 * cache_bytes / bandwidth  # HBM moves about the copy's read + write rate
    roof = max(read_ms, 1e3 * flops / PEAK_BF16)
    row.update(cache_gbs=cache_bytes / row["graph_ms"] / 1e6,
               of_hbm=read_ms / row["graph_ms"], roofline_ms=roof,
               of_roofline=roof / row["graph_ms"], tflops=flops / row["graph_ms"] / 1e9)
    if tune:  # the tile at the policy's partition, then the partition at the best tile
        row.update(tune_case(ours, heads, part, ctx, cache_bytes))
    ROWS.append(row)
    emit(row)


def tune_case(ours, heads: int, part: int, ctx: int, cache_bytes: int) -> dict:
    times = {}
    for tiles in TILE_SWEEP:
        if tiles[0] > max(16, heads):
            continue
        try:
            times[tiles, part] = graph_ms(ours(part, tiles))
        except Exception as e:  # a tile too large for the registers or shared memory
            print(f"  {tiles}: {type(e).__name__}", flush=True)
    tiles = min(times, key=times.get)[0]
    for p in {64, 128, 256, 512, 1024, 2048, ctx} - {part}:
        if p <= ctx:
            times[tiles, p] = graph_ms(ours(p, tiles))
    best = min(times, key=times.get)
    return dict(best_tiles=list(best[0]), best_partition=best[1], best_graph_ms=times[best],
                best_cache_gbs=cache_bytes / times[best] / 1e6)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--ctx", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--tune", action="store_true")
    args = parser.parse_args()
    bandwidth = copy_bandwidth(DEV)
    print(torch.cuda.get_device_name(), torch.__version__,
          f"copy bandwidth {bandwidth / 1e9:,.0f} GB/s (read + write)", flush=True)
    with torch.inference_mode():
        for heads, batch, ctx in itertools.product(args.heads, args.batch, args.ctx):
            run(batch, heads, ctx, bandwidth, args.tune)
    with open(os.path.join(args.out, "bench_mla.json"), "w") as f:
        json.dump(ROWS, f, indent=1)
    print(f"\n{'case':<22} {'part':>6} {'graph ms':>9} {'GB/s':>7} {'of HBM':>7} "
          f"{'roof ms':>8} {'of roof':>8} {'TFLOP/s':>8} {'torch ms':>9} {'err':>8}")
    for r in ROWS:
        torch_ms = f"{r['torch_ms']:>9.4f}" if "torch_ms" in r else f"{'-':>9}"
        print(f"{r['case']:<22} {r['partition']:>6} {r['graph_ms']:>9.4f} {r['cache_gbs']:>7.0f} "
              f"{r['of_hbm']:>7.0%} {r['roofline_ms']:>8.4f} {r['of_roofline']:>8.0%} "
              f"{r['tflops']:>8.0f} {torch_ms} {r['err']:>8.1e}"
              + (f"  best {r['best_tiles']} p{r['best_partition']} "
                 f"{r['best_cache_gbs']:.0f} GB/s" if "best_tiles" in r else ""))


if __name__ == "__main__":
    main()
