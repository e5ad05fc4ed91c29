"""The worker's paged KV cache: what each layer caches (its ``CacheSpec``), the cache
groups (layers of one spec share a block pool and a block table per request), and the
pools' sizes from the memory budget.

A sliding-window layer reads only the last ``window`` positions, so the scheduler keeps
for it at most ``ceil(window / block_size) + 1`` blocks per decoding sequence
(``pocketllm/scheduler/kv_groups.py``). Its pool is therefore sized for concurrency, not
for context: ``sliding_cap`` blocks hold the windows of ``max_num_seqs`` sequences plus
the prefill chunks in flight. The budget is split so that every group fits the same
number of tokens of concurrency: ``N`` blocks for each full-attention group (what the
engine reports as its KV capacity, ``N * block_size`` tokens) and ``min(N, sliding_cap)``
for each sliding group, with ``N`` the largest count whose bytes fit the budget. A
sliding group rarely needs more than ``sliding_cap``; if it does (an unusual mix of
prompts), the scheduler preempts, as it does when any pool runs out.

A multi-head latent attention model (DeepSeek-V2/V3) caches one row per position and
layer: the compressed latent then the rotated rope key, ``kv_lora_rank +
qk_rope_head_dim`` wide, shared by every head (``CacheSpec("mla")``: full attention's
block rules, a pool of its own width, ``[layers, (blocks + 1) * block_size, width]``).

Each K/V pool is ``[layers, 2 (K and V), (blocks + 1) * block_size, kv_heads, head_dim]``;
the extra block past the end (``pad_blocks``) stays finite: the padding rows of batched
decodes read and write it, and the runner points a sliding table's entries behind the
window at it (their blocks may belong to another request by now).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from pocketllm.proto.messages import CacheGroup

from .device import populated_cpu_zeros
from .kv_plan import (CacheLayout, cache_layout, check_available,  # noqa: F401  (the runner's)
                      plan_blocks)


class PagedKVCache:
    """The pools of every group, and each layer's (k_cache, v_cache) view into its own
    (an MLA layer's: ``(latent_cache [slots, latent_width], None)``)."""

    def __init__(self, layout: CacheLayout, num_blocks: list[int], block_size: int,
                 kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 latent_width: Optional[int] = None):
        self.layout, self.num_blocks, self.block_size = layout, list(num_blocks), block_size
        self.pad_blocks = list(num_blocks)  # the spare block past each pool's end
        latent = [spec.kind == "mla" for spec in layout.specs]
        if any(latent) and latent_width is None:
            raise ValueError("an MLA cache group needs its latent_width")
        shapes = [(layout.num_layers(g), (n + 1) * block_size, latent_width) if latent[g] else
                  (layout.num_layers(g), 2, (n + 1) * block_size, kv_heads, head_dim)
                  for g, n in enumerate(num_blocks)]
        if device.type == "cpu":
            # The OS backs a CPU tensor's pages only when they are first written, so an
            # untouched cache would grow the worker's memory request by request until full
            # (and fail mid-serving where RAM is short): refused now if it cannot fit,
            # backed in the background from now.
            check_available(sum(math.prod(s) for s in shapes) * dtype.itemsize, "KV cache",
                            "kv_cache_memory_gb")
            self.pools = populated_cpu_zeros(shapes, dtype)
        else:
            self.pools = [torch.empty(s, device=device, dtype=dtype) for s in shapes]
            for pool, n, mla in zip(self.pools, num_blocks, latent):
                (pool[:, n * block_size:] if mla else pool[:, :, n * block_size:]).zero_()
        self.layer_caches: list[tuple[torch.Tensor, Optional[torch.Tensor]]] = []
        used = [0] * len(num_blocks)
        for g in layout.layer_group:
            pool = self.pools[g]
            self.layer_caches.append((pool[used[g]], None) if latent[g] else
                                     (pool[used[g], 0], pool[used[g], 1]))
            used[g] += 1

    def pad_slot(self, group: int) -> int:
        return self.pad_blocks[group] * self.block_size

    def groups(self) -> list[CacheGroup]:
        """What the capability declaration carries."""
        return [CacheGroup(spec, n, self.layout.num_layers(g))
                for g, (spec, n) in enumerate(zip(self.layout.specs, self.num_blocks))]

    def capacity_tokens(self) -> int:
        """Tokens of concurrency: the first group's blocks (full attention when any)."""
        return self.num_blocks[0] * self.block_size
