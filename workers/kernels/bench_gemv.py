"""The gemv (``gemv.py``) at the projection shapes of the shipped models: time per
launch inside a chain of launches with distinct weights, as a decode step runs them
(each launch ramps up while the one before drains; the weights of the chain exceed L2),
and, with ``--tune``, a sweep of its (BLOCK_N, BLOCK_K, warps).

    python -m pocketllm.workers.kernels.bench_gemv [--model NAME ...] [--tune] [--fp8]
        [--rows M] [--out DIR]

CUDA only. ``tb_s`` is the weight bytes of one launch over its time. ``--fp8``: the
weights in e4m3 with row scales (``fp8_linear.quantize_weight``), swept over
``FP8_SWEEP``. ``--rows M`` (2..8): M rows a launch, with the ops before and after the
product as the layers run them (norm, activation, rotary as launches of their own), beside
cuBLAS (``F.linear`` on the same rows), each row checked to be bit-equal to its one-row
launch; the sweep then varies BLOCK_N and warps at the one-row launch's BLOCK_K.
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
ROWS_BLOCK_N, ROWS_WARPS = (1, 2, 4, 8), (1, 2)  # the rows sweep (warps: x the default)
L2_MULTIPLE = 4  # a chain's weights are at least this many times the L2 cache


def chain(n: int, k: int, pre: str, head_dim: int, fp8: bool = False, m: int = 1):
    """(a call launching one gemv of ``m`` rows per weight copy, enough copies to defeat
    L2; the copies; the same with F.linear; a check of the rows' bits)."""
    from .fp8_linear import quantize_weight

    l2 = torch.cuda.get_device_properties(DEV).L2_cache_size
    copies = max(8, -(-L2_MULTIPLE * l2 // (n * k * (1 if fp8 else 2))))
    weights = [torch.randn(n, k, device=DEV) * k ** -0.5 for _ in range(copies)]
    weights = [quantize_weight(w) if fp8 else (w.to(BF16), None) for w in weights]
    width = 2 * k if pre == "silu" else k
    x = torch.randn(m, width, device=DEV).to(BF16)
    res = torch.randn(m, k, device=DEV).to(BF16)
    norm_w = torch.rand(k, device=DEV) + 0.5
    cos = torch.rand(m, 1, head_dim // 2, device=DEV).to(BF16) if head_dim else None

    def launch(config, w, scale, rows=slice(None)):
        if pre == "silu":
            return gemv_mod.gated_gemv(x[rows], w, None, "silu", config=config, scale=scale)
        if pre:
            rotary = (cos[rows], cos[rows], head_dim, n - n // 3) if head_dim else None
            return gemv_mod.norm_gemv(x[rows], res[rows] if pre == "add_norm" else None,
                                      norm_w, 1e-6, w, rotary=rotary, config=config,
                                      scale=scale)[0]
        return gemv_mod.gemv(x[rows], w, config=config, scale=scale)

    def run(config):
        for w, scale in weights:
            launch(config, w, scale)

    def run_cublas():
        xin = x[:, :k] if pre == "silu" else x
        for w, _ in weights:
            torch.nn.functional.linear(xin, w if w.dtype == BF16 else w.to(BF16))

    def exact() -> bool:
        w, scale = weights[0]
        one = torch.cat([launch(None, w, scale, slice(i, i + 1)) for i in range(m)])
        return torch.equal(launch(None, w, scale), one)
    return run, copies, run_cublas, exact


def default_config(n: int, k: int, pre: str, head_dim: int, fp8: bool = False):
    block_n, block_k, warps = gemv_mod._config(n, k, pre, bool(head_dim), fp8)
    return (gemv_mod.rotary_block_n(block_n, head_dim) if head_dim else block_n, block_k, warps)


def rows_sweep(n: int, k: int, pre: str, head_dim: int, fp8: bool) -> list:
    lanes = min(gemv_mod._config(n, k, pre, bool(head_dim), fp8)[1], 1 << (k - 1).bit_length())
    return [(bn, lanes, w * max(1, lanes // 256)) for bn in ROWS_BLOCK_N for w in ROWS_WARPS]


def measure(model: str, tune: bool, fp8: bool = False, m: int = 1) -> list[dict]:
    rows = []
    size = 1 if fp8 else 2
    for proj, n, k, pre, head_dim in SHAPES[model]:
        run, copies, run_cublas, exact = chain(n, k, pre, head_dim, fp8, m)
        default = default_config(n, k, pre, head_dim, fp8) if m == 1 else None
        us = lambda c: 1e3 * graph_ms(lambda: run(c)) / copies  # noqa: E731
        row = dict(model=model, proj=proj, n=n, k=k, pre=pre, rows=m, default=default,
                   us=us(None))
        row["tb_s"] = n * k * size / row["us"] / 1e6
        if m > 1:
            row.update(cublas_us=1e3 * graph_ms(run_cublas) / copies, exact=exact())
        if tune:
            times = {}
            for c in (rows_sweep(n, k, pre, head_dim, fp8) if m > 1 else
                      FP8_SWEEP if fp8 else SWEEP):
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
    parser.add_argument("--rows", type=int, default=1, choices=range(1, gemv_mod.MAX_ROWS + 1),
                        help="rows a launch (default 1)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = [row for model in args.model
            for row in measure(model, args.tune, args.fp8, args.rows)]
    print(f"{'model':18} {'proj':14} {'N x K':>14} {'us':>7} {'TB/s':>5}"
          + (" cuBLAS us exact" if args.rows > 1 else "")
          + ("  best (BN, BK, warps)    us   TB/s" if args.tune else ""))
    for r in rows:
        print(f"{r['model']:18} {r['proj']:14} {r['n']:>7}x{r['k']:<6} {r['us']:7.2f} "
              f"{r['tb_s']:5.2f}"
              + (f" {r['cublas_us']:9.2f} {str(r['exact']):>5}" if args.rows > 1 else "")
              + (f"  {str(r['best']):20} {r['best_us']:7.2f} "
                 f"{r['best_tb_s']:5.2f}" if "best" in r else ""))
    if args.out:
        with open(os.path.join(args.out, "bench_gemv.json"), "w") as f:
            json.dump(rows, f, default=str)


if __name__ == "__main__":
    main()
