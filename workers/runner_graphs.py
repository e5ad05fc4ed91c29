"""What the torch worker compiles and captures once at startup, so that no request pays
for it: its CUDA graphs (decode steps, ``cuda_graphs.py``; steps holding a prefill,
``piecewise_graphs.py``; speculative verification steps, ``verify_graphs.py``; the draft
model's one-row steps), the attention kernels' variants and the sampler's first use."""

from __future__ import annotations

import gc
import logging
import time

import torch

from pocketllm.config import SPECULATIVE_MAX_BATCH
from pocketllm.proto.messages import SamplingSpec

logger = logging.getLogger("pocketllm.worker")


def capture_graphs(runner):
    """(decode graphs, piecewise graphs, verification graphs) of ``runner`` (a
    ``ModelRunner``), each None when off: CUDA graphs need the Triton kernels on a GPU, and
    the flags must allow them."""
    args = runner.args
    if not (args.cuda_graphs and runner.device.type == "cuda" and runner.policy.triton):
        if args.cuda_graph_max_tokens:
            logger.warning("--cuda-graph-max-tokens has no effect: CUDA graphs are off "
                           "(they need the Triton kernels on a GPU, and not "
                           "--no-cuda-graphs)")
        return None, None, None
    # A garbage collection during a capture may destroy another runner's graphs (a
    # process that built one before, as tests do): that CUDA call invalidates the
    # capture. So collect once now and not while capturing.
    gc.collect()
    gc.disable()
    try:
        with torch.inference_mode():
            return _capture(runner, args)
    finally:
        gc.enable()


def _capture(r, args):
    from .cuda_graphs import DecodeGraphs
    from .piecewise_graphs import MixedGraphs
    from .verify_graphs import VerifyGraphs, VerifyGraphSet

    decode = DecodeGraphs(
        r.model, r.kv_caches, r.block_size, r.max_model_len, r.kv.pad_blocks, r.device,
        min(args.cuda_graph_max_batch, args.max_num_seqs), r.state_groups)
    budget = args.max_num_batched_tokens
    wanted = args.cuda_graph_max_tokens
    max_tokens = budget if wanted is None else min(wanted, budget)
    if any(r.state_groups) and max_tokens > 0:
        # a piece between two layers hands on a layer's inputs, of one shape
        # for attention layers only (piecewise_graphs.py)
        logger.info("prefill steps of a linear-attention model run eagerly: no "
                    "piecewise CUDA graphs for it yet")
        max_tokens = 0
    mixed = MixedGraphs(r.model, r.kv_caches, r.max_model_len, r.device,
                        max_tokens) if max_tokens > 0 else None
    verify = None
    max_batch = min(SPECULATIVE_MAX_BATCH, args.max_num_seqs)
    # (an attention backend that reads a sequence's rows as decodes: the Triton kernels')
    if args.speculative_method is not None and getattr(r.backend, "rows_as_decodes", False):
        rows = {args.num_speculative_tokens + 1}
        if any(r.state_groups):  # a probe's two rounds, not k + 1 (verify_graphs.py)
            rows.add(2)
        verify = VerifyGraphSet([VerifyGraphs(r.model, r.kv_caches, r.block_size,
                                              r.max_model_len, r.kv.pad_blocks, r.device,
                                              max_batch, n, r.state_groups) for n in rows])
    if r.draft is not None:
        r.draft.capture(max_batch, r.max_model_len)
    return decode, mixed, verify


def warm_up_attention(r) -> None:
    """Compile the attention kernels' variants now, not during the first requests."""
    warm_up = getattr(r.backend, "warm_up", None)
    if warm_up is None:
        return
    started = time.perf_counter()
    attn = r.model.layers[r.model.layer_group.index(0)].self_attn  # group 0: attention
    with torch.inference_mode():
        for g, pad_block in enumerate(r.kv.pad_blocks):  # each pool, its layers' kinds
            if r.state_groups[g]:
                continue
            layers = [layer for layer, lg in zip(r.model.layers, r.model.layer_group)
                      if lg == g]
            kinds = {(layer.self_attn.window, layer.self_attn.softcap) for layer in layers}
            first = r.model.layer_group.index(g)
            warm_up(*r.kv_caches[first], attn.num_heads, pad_block, r.block_size,
                    kinds, attn.scale, sinks=attn.sinks is not None, dtype=r.dtype)
    logger.info("attention kernels ready in %.1fs", time.perf_counter() - started)


def warm_up_sampler(r) -> None:
    """Sample once from dummy logits, greedy and at random, on CUDA: CUDA loads a
    kernel's module on its first use and the pinned-memory pool starts empty, costs
    the first requests would pay (docs/benchmarks.md, "Cold start"). Seeded, so the
    shared generator of unseeded requests is not advanced."""
    if r.device.type != "cuda":
        return
    logits = torch.zeros(2, r.model.cfg.vocab_size, device=r.device)
    specs = [SamplingSpec(temperature=0.0, logprobs=1),
             SamplingSpec(temperature=1.0, top_k=5, top_p=0.9, min_p=0.05, seed=0,
                          logprobs=1)]
    r.sampler(logits, specs, [0, 0])
    torch.cuda.synchronize(r.device)
