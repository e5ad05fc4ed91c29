"""The HuggingFace transformers peer for `bench latency --peer transformers`.

Runs in the bench process (the only place outside workers/ that may import torch,
and only when a peer is asked for). Same checkpoint, same prompt ids, greedy.
"""

from __future__ import annotations

import os
import statistics
import time

from ..model_info import ModelInfo
from .latency import LatencyResult


def load_peer(info: ModelInfo, dtype: str):
    """(model, device, load seconds): the same checkpoint in transformers, on the GPU if any."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as e:
        raise SystemExit(f"--peer transformers needs transformers installed: {e}")
    t0 = time.perf_counter()
    torch_dtype = getattr(torch, dtype)
    if info.format == "gguf":
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(info.path), gguf_file=os.path.basename(info.path),
            dtype=torch_dtype)
    elif info.format == "dummy":  # random init straight on the device (minutes on a host)
        config = AutoConfig.from_pretrained(info.path)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(info.path, dtype=torch_dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.to(device).eval()
    return model, device, time.perf_counter() - t0


def timed_generate(model, device: str, ids, new_tokens: int) -> float:
    """Seconds for greedy generation of exactly ``new_tokens`` per row."""
    import torch

    mask = torch.ones_like(ids)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run_transformers(info: ModelInfo, prompt_ids: list[int], output_len: int, runs: int,
                     warmup: int, dtype: str = "float32", threads: int | None = None
                     ) -> LatencyResult:
    import torch

    if threads is not None:  # on the CPU: the same count as PocketLLM's worker
        torch.set_num_threads(threads)
    model, device, load_s = load_peer(info, dtype)
    ids = torch.tensor([prompt_ids], device=device)
    ttfts, tps = [], []
    for i in range(warmup + runs):
        t1 = timed_generate(model, device, ids, 1)
        tn = timed_generate(model, device, ids, output_len)
        if i >= warmup:
            ttfts.append(t1)
            tps.append((output_len - 1) / max(tn - t1, 1e-9))
    return LatencyResult("transformers", load_s, statistics.median(ttfts),
                         statistics.median(tps), runs, prompt_tokens=len(prompt_ids))


def run_transformers_throughput(info: ModelInfo, prompts: list[list[int]], output_len: int,
                                batch: int, dtype: str):
    """HF generate over static batches of ``batch`` equal-length prompts (no padding)."""
    import torch

    from .throughput import ThroughputResult

    model, device, _load_s = load_peer(info, dtype)
    timed_generate(model, device, torch.tensor(prompts[:1], device=device), 2)  # warm-up
    seconds = 0.0
    for i in range(0, len(prompts), batch):
        ids = torch.tensor(prompts[i:i + batch], device=device)
        seconds += timed_generate(model, device, ids, output_len)
    return ThroughputResult("transformers", len(prompts), len(prompts[0]), output_len, seconds,
                            len(prompts) * output_len)
