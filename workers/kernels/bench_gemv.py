"""The one-row gemv (``gemv.py``) at the projection shapes of the shipped models: time per
launch inside a chain of launches with distinct weights, as a decode step runs them
(each launch ramps up while the one before drains; the weights of the chain exceed L2),
and, with ``--tune``, a sweep of its (BLOCK_N, BLOCK_K, warps).

    python -m pocketllm.workers.kernels.bench_gemv [--model NAME ...] [--tune] [--fp8] [--out DIR]

CUDA only. ``tb_s`` is the weight bytes of one launch over its time. ``--fp8``: the
weights in e4m3 with row scales (``fp8_linear.quantize_weight``), swept over
``FP8_SWEEP``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch

from . import gemv as gemv_mod
from .bench import BF16, DEV, graph_ms

# name: [(projection, N, K, the op fused before it, rotary head_dim or 0)], bf16, TP=1
SHAPES = {
    "llama-3-8b": [("qkv", 6144, 4096, "add_norm", 128), ("o", 4096, 4096, "", 0),
                   ("gate_up", 28672, 4096, "add_norm", 0), ("down", 4096, 14336, "silu", 0)],
    "qwen3-30b-a3b": [("qkv", 5120, 2048, "add_norm", 0), ("o", 2048, 4096, "", 0),
                      ("router", 128, 2048, "add_norm", 0), ("lm_head", 151936, 2048, "norm", 0)],
    "deepseek-v2-lite": [("q_and_latent", 3648, 2048, "add_norm", 0), ("o", 2048, 2048, "", 0),
                         ("router", 64, 2048, "", 0), ("shared_gate_up", 5632, 2048, "", 0),
                         ("shared_down", 2048, 2816, "silu", 0)],
}
SWEEP = [c for c in itertools.product((2, 4, 8, 16, 32), (128, 256, 512, 1024), (2, 4, 8))
         if c[0] * c[1] <= 16384]
FP8_SWEEP = list(itertools.product((4, 8, 16), (512, 1024, 2048), (4, 8)))
L2_MULTIPLE = 4  # a chain's weights are at least this many times the L2 cache


def chain(n: int, k: int, pre: str, head_dim: int, fp8: bool = False):
    """A call launching one gemv per weight copy, enough copies to defeat L2."""
    from .fp8_linear import quantize_weight

    l2 = torch.cuda.get_device_properties(DEV).L2_cache_size
    copies = max(8, -(-L2_MULTIPLE * l2 // (n * k * (1 if fp8 else 2))))
    weights = [torch.randn(n, k, device=DEV) * k ** -0.5 for _ in range(copies)]
    weights = [quantize_weight(w) if fp8 else (w.to(BF16), None) for w in weights]
    width = 2 * k if pre == "silu" else k
    x = torch.randn(1, width, device=DEV).to(BF16)
    res = torch.randn(1, k, device=DEV).to(BF16)
    norm_w = torch.rand(k, device=DEV) + 0.5
    rotary = None
    if head_dim:
        cos = torch.rand(head_dim // 2, device=DEV).to(BF16)
        rotary = (cos, cos, head_dim, n - n // 3)  # q and k rotated, v (a third) not

    def launch(config, w, scale):
        if pre == "silu":
            return gemv_mod.gated_gemv(x, w, None, "silu", config=config, scale=scale)
        if pre:
            return gemv_mod.norm_gemv(x, res if pre == "add_norm" else None, norm_w, 1e-6, w,
                                      rotary=rotary, config=config, scale=scale)
        return gemv_mod.gemv(x, w, config=config, scale=scale)

    def run(config):
        for w, scale in weights:
            launch(config, w, scale)
    return run, copies


def default_config(n: int, k: int, pre: str, head_dim: int, fp8: bool = False):
    block_n, block_k, warps = gemv_mod._config(n, k, pre, bool(head_dim), fp8)
    return (gemv_mod.rotary_block_n(block_n, head_dim) if head_dim else block_n, block_k, warps)


def measure(model: str, tune: bool, fp8: bool = False) -> list[dict]:
    rows = []
    size = 1 if fp8 else 2
    for proj, n, k, pre, head_dim in SHAPES[model]:
        run, copies = chain(n, k, pre, head_dim, fp8)
        default = default_config(n, k, pre, head_dim, fp8)
        us = lambda c: 1e3 * graph_ms(lambda: run(c)) / copies  # noqa: E731
        row = dict(model=model, proj=proj, n=n, k=k, pre=pre, default=default, us=us(None))
        row["tb_s"] = n * k * size / row["us"] / 1e6
        if tune:
            times = {}
            for c in FP8_SWEEP if fp8 else SWEEP:
                if head_dim and gemv_mod.rotary_block_n(c[0], head_dim) != c[0]:
                    continue
                try:
                    times[c] = us(c)
                except Exception as e:  # e.g. out of registers or shared memory
                    print(f"{proj} {c}: {type(e).__name__}: {str(e)[:80]}")
            best = min(times, key=times.get)
            row.update(best=best, best_us=times[best], best_tb_s=n * k * size / times[best] / 1e6,
                       top5=sorted(times.items(), key=lambda t: t[1])[:5])
        print(json.dumps(row, default=str), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tune", action="store_true")
    parser.add_argument("--fp8", action="store_true", help="e4m3 weights with row scales")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = [row for model in args.model for row in measure(model, args.tune, args.fp8)]
    print(f"{'model':18} {'proj':14} {'N x K':>14} {'us':>7} {'TB/s':>5}"
          + ("  best (BN, BK, warps)    us   TB/s" if args.tune else ""))
    for r in rows:
        print(f"{r['model']:18} {r['proj']:14} {r['n']:>7}x{r['k']:<6} {r['us']:7.2f} "
              f"{r['tb_s']:5.2f}" + (f"  {str(r['best']):20} {r['best_us']:7.2f} "
                                     f"{r['best_tb_s']:5.2f}" if "best" in r else ""))
    if args.out:
        with open(os.path.join(args.out, "bench_gemv.json"), "w") as f:
            json.dump(rows, f, default=str)


if __name__ == "__main__":
    main()
