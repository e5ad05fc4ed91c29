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


def run_transformers(info: ModelInfo, prompt_ids: list[int], output_len: int, runs: int,
                     warmup: int, dtype: str = "float32") -> LatencyResult:
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
            torch_dtype=torch_dtype)
    elif info.format == "dummy":
        config = AutoConfig.from_pretrained(info.path)
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(info.path, torch_dtype=torch_dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.to(device).eval()
    load_s = time.perf_counter() - t0
    ids = torch.tensor([prompt_ids], device=device)
    mask = torch.ones_like(ids)

    def gen(n: int) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    ttfts, tps = [], []
    for i in range(warmup + runs):
        t1 = gen(1)
        tn = gen(output_len)
        if i >= warmup:
            ttfts.append(t1)
            tps.append((output_len - 1) / max(tn - t1, 1e-9))
    return LatencyResult("transformers", load_s, statistics.median(ttfts),
                         statistics.median(tps), runs)
