"""GGUF block products of one row at Llama-3-8B's projection shapes: the float block gemv
(``gguf_gemv.block_gemv``), the integer dots (``gguf_dot``, with the rounding of x to
8-bit blocks each launch makes; Q8_0 also repacked, ``q8_0_split``) and the bf16 gemv,
timed as ``bench_gemv`` times it (a chain of launches over distinct weights replayed in a
CUDA graph), each checked
against dequantize-then-matmul; ``--tune`` sweeps the dots' (rows, blocks a step, warps).

    python -m pocketllm.workers.kernels.bench_gguf [--types q4_k q6_k ...] [--tune]

CUDA only. ``GB/s`` is the blocks' bytes of one launch over its faster path's time.
"""

from __future__ import annotations

import argparse
import itertools
import json

import numpy as np
import torch

from . import gemv as gemv_mod
from . import gguf_dot, gguf_gemv
from .bench import BF16, DEV, graph_ms

SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
          ("down", 4096, 14336)]
TYPES = {"q4_0": gguf_dot.Q4_0, "q8_0": gguf_dot.Q8_0, "q4_k": gguf_dot.Q4_K,
         "q5_k": gguf_dot.Q5_K, "q6_k": gguf_dot.Q6_K, "iq4_xs": gguf_gemv.IQ4_XS}
SWEEP = list(itertools.product((1, 2, 4, 8), (2, 4, 8, 16), (1, 2, 4)))
COPIES = 8  # distinct weights in a chain (8 x a 4.6 GB-class layer's blocks exceed L2)


def random_blocks(ggml_type: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks on the GPU, their decoding as float32 on the GPU)."""
    from ..loader.dummy_blocks import random_block_tensor

    t = random_block_tensor(ggml_type, (n, k), np.random.default_rng(ggml_type))
    return torch.from_numpy(t.blocks).to(DEV), torch.from_numpy(t.read()).to(DEV)


def measure(name: str, ggml_type: int, proj: str, n: int, k: int, tune: bool) -> dict:
    blocks, dense = random_blocks(ggml_type, n, k)
    chain = [blocks] + [blocks.clone() for _ in range(COPIES - 1)]
    x = torch.randn(1, k, device=DEV).to(BF16)
    want = x.float() @ dense.T
    out = torch.empty(1, n, device=DEV, dtype=BF16)
    dot = gguf_dot.KERNELS.get(ggml_type)  # IQ4_XS has the float block gemv only
    row = dict(type=name, proj=proj, n=n, k=k, bytes=blocks.numel())

    def timed(fn) -> float:
        err = ((fn(blocks).float() - want).abs().max() / want.abs().max()).item()
        if err > 3e-2:
            raise AssertionError(f"relative error {err:.2e}")
        return 1e3 * graph_ms(lambda: [fn(b) for b in chain]) / COPIES

    def dots(config=None):
        return lambda b: dot(gguf_dot.quantize_rows(x), b, n, k, out, config=config)

    bf16 = [torch.randn(n, k, device=DEV).to(BF16) for _ in range(COPIES)]
    row["bf16_us"] = 1e3 * graph_ms(lambda: [gemv_mod.gemv(x, w) for w in bf16]) / COPIES
    if ggml_type in gguf_gemv.FORMATS:
        row["float_us"] = timed(lambda b: gguf_gemv.block_gemv(x, b, ggml_type, n, k))
    if dot is not None:
        row["dot_us"] = timed(dots())
    if ggml_type == gguf_dot.Q8_0:  # the same bytes repacked for word reads (q8_0_split)
        split = {id(b): gguf_gemv.q8_0_split(b, k) for b in chain}
        def split_dots(config=None):
            return lambda b: gguf_dot.q8_0_split_dot(gguf_dot.quantize_rows(x), split[id(b)],
                                                     n, k, out, config=config)

        row["split_us"] = timed(split_dots())
        if tune:
            times = {c: timed(split_dots(c)) for c in SWEEP}
            row["split_top3"] = sorted(times.items(), key=lambda t: t[1])[:3]
    if tune and dot is not None:
        times = {}
        for config in SWEEP:
            try:
                times[config] = timed(dots(config))
            except Exception as e:  # out of registers, or wrong
                print(f"{name} {proj} {config}: {type(e).__name__}: {str(e)[:80]}", flush=True)
        best = min(times, key=times.get)
        row.update(best=best, best_us=times[best],
                   top5=sorted(times.items(), key=lambda t: t[1])[:5])
    print(json.dumps(row, default=str), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="+", default=list(TYPES), choices=list(TYPES))
    parser.add_argument("--tune", action="store_true")
    args = parser.parse_args()
    rows = [measure(t, TYPES[t], *shape, args.tune) for t in args.types for shape in SHAPES]
    print(f"{'type':6} {'proj':8} {'bf16 us':>8} {'float us':>9} {'dots us':>8} {'GB/s':>6}"
          + ("  best (rows, blocks, warps)   us   GB/s" if args.tune else ""))
    for r in rows:
        gbs = lambda us: r["bytes"] / us / 1e3  # noqa: E731
        fastest = min(r.get("dot_us", float("inf")), r.get("float_us", float("inf")))
        print(f"{r['type']:6} {r['proj']:8} {r['bf16_us']:8.1f} {r.get('float_us', 0):9.1f} "
              f"{r.get('dot_us', 0):8.1f} {gbs(fastest):6.0f}"
              + (f"  {str(r['best']):26} {r['best_us']:6.1f} {gbs(r['best_us']):6.0f}"
                 if "best" in r else ""))


if __name__ == "__main__":
    main()
