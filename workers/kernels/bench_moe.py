"""The MoE grouped GEMM at Qwen3-30B-A3B's expert shapes: error and time against the torch
reference, and its time against the memory roofline of the experts a step actually reads.

    python -m pocketllm.workers.kernels.bench_moe [--out DIR] [--tune] [--tp N] [--tokens T ...]

CUDA only. ``roofline_ms`` is (bytes of the distinct experts the step's routing hits,
plus the rows in and out) over the device's copy bandwidth (``device.copy_bandwidth``,
read + write); ``of_roofline`` is that over the CUDA-graph time. Up to ``GEMV_TOKENS``
tokens the few-token gemvs (``moe_gemv.py``) are timed too. ``--tune`` also times a
sweep of tiles per case and reports the best (pass it to ``fused_experts(block=)`` or
change ``fused_moe.tiles``; for the gemvs, ``moe_gemv``'s two configs).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch

from ..device import copy_bandwidth
from ..layers.moe import softmax_topk, torch_experts
from .bench import BF16, DEV, ROWS, emit, graph_ms, host_us, median_ms, rel_err
from . import moe_gemv
from .fused_moe import fused_experts

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
TOKENS = (1, 4, 16, 64, 256, 1024, 4096)
SWEEP = list(itertools.product((16, 32, 64), (32, 64, 128), (32, 64, 128)))
GEMV_TOKENS = 8  # the few-token gemvs (moe_gemv.py) are timed up to this many tokens
# (BLOCK_N, BLOCK_K, warps) per gemv launch; the down launch's tile is k times taller
GEMV_SWEEP = {"GATE_UP_CONFIG": list(itertools.product((4, 8, 16), (128, 256, 512), (2, 4, 8))),
              "DOWN_CONFIG": [c for c in itertools.product((1, 2, 4, 8), (64, 128, 256, 512),
                                                           (2, 4, 8)) if c[0] * c[1] <= 2048]}


def case(tokens: int, inter: int, seed: int = 0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, device=DEV, generator=gen).to(BF16)
    w13 = (torch.randn(EXPERTS, 2 * inter, HIDDEN, device=DEV, generator=gen)
           * HIDDEN ** -0.5).to(BF16)
    w2 = (torch.randn(EXPERTS, HIDDEN, inter, device=DEV, generator=gen) * inter ** -0.5).to(BF16)
    logits = torch.randn(tokens, EXPERTS, device=DEV, generator=gen)
    weights, ids = softmax_topk(True)(logits, TOP_K)
    return x, w13, w2, weights, ids


def read_bytes(x, w13, w2, ids) -> int:
    """Bytes a step must move at least: the experts hit, once each, and the rows."""
    hit = int(torch.unique(ids).numel())
    per_expert = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    return hit * per_expert + 2 * x.numel() * x.element_size()


def run(tokens: int, inter: int, bandwidth: float, tune: bool) -> None:
    x, w13, w2, weights, ids = case(tokens, inter)
    truth = torch_experts(x.float(), w13.float(), w2.float(), weights, ids, "silu")
    out = fused_experts(x, w13, w2, weights, ids, "silu")
    ours = lambda: fused_experts(x, w13, w2, weights, ids, "silu")  # noqa: E731
    ref = lambda: torch_experts(x, w13, w2, weights, ids, "silu")  # noqa: E731
    # the reference reads its per-expert counts back to the host: it cannot be captured
    row = dict(section="moe", case=f"T{tokens} E{EXPERTS} k{TOP_K} H{HIDDEN} I{inter}",
               eager_ms=median_ms(ours), torch_eager_ms=median_ms(ref), graph_ms=graph_ms(ours),
               host_us=host_us(ours), err=rel_err(out, truth), torch_err=rel_err(ref(), truth))
    ROWS.append(row)
    # HBM moves about the copy's read + write rate in any mix (bench latency and
    # bench_mla hold reads to the same figure)
    roof = 1e3 * read_bytes(x, w13, w2, ids) / bandwidth
    row.update(roofline_ms=roof, of_roofline=roof / row["graph_ms"])
    if tokens <= GEMV_TOKENS:
        gemv = lambda: moe_gemv.gemv_experts(x, w13, w2, weights, ids, "silu")  # noqa: E731
        row.update(gemv_ms=graph_ms(gemv), gemv_err=rel_err(gemv(), truth))
        row.update(gemv_of_roofline=roof / row["gemv_ms"])
        if tune:
            row.update(gemv_best=tune_gemv(gemv))
    if tune:
        times = {}
        for block in SWEEP:
            try:
                times[block] = graph_ms(lambda: fused_experts(x, w13, w2, weights, ids, "silu",
                                                              block=block))
            except Exception as e:  # a tile too large for the shared memory: skip it
                print(f"  {block}: {type(e).__name__}", flush=True)
        best = min(times, key=times.get)
        row.update(best_block=list(best), best_graph_ms=times[best],
                   best_of_roofline=roof / times[best])
    emit(row)


def tune_gemv(gemv) -> list:
    """The best (BLOCK_N, BLOCK_K, warps) of each gemv launch, the other at its default."""
    best = []
    for name, sweep in GEMV_SWEEP.items():
        default, times = getattr(moe_gemv, name), {}
        for config in sweep:
            setattr(moe_gemv, name, config)
            times[config] = graph_ms(gemv)
        setattr(moe_gemv, name, default)
        pick = min(times, key=times.get)
        best.append([name, list(pick), times[pick], times[default]])
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--tune", action="store_true")
    parser.add_argument("--tp", type=int, default=1, help="split I as N ranks would")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    args = parser.parse_args()
    bandwidth = copy_bandwidth(DEV)
    print(torch.cuda.get_device_name(), torch.__version__,
          f"copy bandwidth {bandwidth / 1e9:,.0f} GB/s (read + write)", flush=True)
    with torch.inference_mode():
        for tokens in args.tokens:
            run(tokens, INTER // args.tp, bandwidth, args.tune)
    with open(os.path.join(args.out, "bench_moe.json"), "w") as f:
        json.dump(ROWS, f, indent=1)
    print(f"\n{'case':<36} {'graph':>8} {'eager':>8} {'torch':>8} {'roof':>8} {'of roof':>8} "
          f"{'err':>8}")
    for r in ROWS:
        print(f"{r['case']:<36} {r['graph_ms']:>8.4f} {r['eager_ms']:>8.4f} "
              f"{r['torch_eager_ms']:>8.4f} "
              f"{r['roofline_ms']:>8.4f} {r['of_roofline']:>8.0%} {r['err']:>8.1e}"
              + (f"  best {r['best_block']} {r['best_of_roofline']:.0%}" if "best_block" in r
                 else "")
              + (f"  gemv {r['gemv_ms']:.4f} {r['gemv_of_roofline']:.0%} {r['gemv_err']:.1e}"
                 if "gemv_ms" in r else "")
              + (f"  gemv best {r['gemv_best']}" if "gemv_best" in r else ""))


if __name__ == "__main__":
    main()
