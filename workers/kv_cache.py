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

A linear-attention (Gated DeltaNet) model's recurrent layers form a state group
(``CacheSpec("state")``): per layer, ``[slots + 1, channels, kernel - 1]`` conv states in
the model dtype and ``[slots + 1, v_heads, k_dim, v_dim]`` float32 recurrent states, one
slot per running sequence (``kv_plan.state_slots``: ``max_num_seqs``, fewer if half the
budget cannot hold them). Its "blocks" are those slots; the spare one past the end is the
padding rows'.

Each K/V pool is ``[layers, 2 (K and V), (blocks + 1) * block_size, kv_heads, head_dim]``
(an FP8 pool, ``--kv-cache-dtype fp8``: bytes ``[layers, 2, slots * kv_heads * (head_dim
+ 1)]``, each layer's codes then an exponent byte per slot and head, ``kernels/kv_fp8.py``;
the layers see the codes as float8_e4m3fn ``[slots, kv_heads, head_dim]`` views);
the extra block past the end (``pad_blocks``) stays finite: the padding rows of batched
decodes read and write it, and the runner points a sliding table's entries behind the
window at it (their blocks may belong to another request by now).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from pocketllm.proto.messages import CacheGroup

from .device import populated_cpu_zeros, to_device
from .kv_plan import (CacheLayout, cache_layout, check_available,  # noqa: F401  (the runner's)
                      plan_blocks)


class PagedKVCache:
    """The pools of every group, and each layer's (k_cache, v_cache) view into its own
    (an MLA layer's: ``(latent_cache [slots, latent_width], None)``; a linear-attention
    layer's: ``(conv_states, states)``)."""

    def __init__(self, layout: CacheLayout, num_blocks: list[int], block_size: int,
                 kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 latent_width: Optional[int] = None,
                 state_shapes: Optional[tuple[tuple[int, ...], tuple[int, ...]]] = None,
                 kv_dtype: Optional[torch.dtype] = None):
        """``state_shapes``: one slot's conv and recurrent state (a state group's layers);
        ``kv_dtype``: the K/V pools' (None: ``dtype``; float8_e4m3fn: codes and scales)."""
        self.kv_dtype = kv_dtype or dtype
        fp8 = self.kv_dtype == torch.float8_e4m3fn
        if fp8:  # (a Triton module: the GPU path only)
            from .kernels import kv_fp8
        self.layout, self.num_blocks, self.block_size = layout, list(num_blocks), block_size
        self.pad_blocks = list(num_blocks)  # the spare block past each pool's end
        latent = [spec.kind == "mla" for spec in layout.specs]
        state = [layout.is_state(g) for g in range(len(num_blocks))]
        if any(latent) and latent_width is None:
            raise ValueError("an MLA cache group needs its latent_width")
        if any(state) and state_shapes is None:
            raise ValueError("a state cache group needs its state_shapes")
        # (shape, dtype) of each pool: a state group has two, conv then recurrent states
        shapes: list[tuple[tuple[int, ...], torch.dtype]] = []
        for g, n in enumerate(num_blocks):
            layers = layout.num_layers(g)
            if state[g]:
                shapes.append(((layers, n + 1, *state_shapes[0]), dtype))
                shapes.append(((layers, n + 1, *state_shapes[1]), torch.float32))
            elif latent[g]:
                shapes.append(((layers, (n + 1) * block_size, latent_width), dtype))
            elif fp8:
                shapes.append(((layers, 2, (n + 1) * block_size
                                * kv_fp8.slot_bytes(kv_heads, head_dim)), torch.uint8))
            else:
                shapes.append(((layers, 2, (n + 1) * block_size, kv_heads, head_dim), dtype))
        pools = self._allocate(shapes, device)  # zeroed: the spare block/slot stays so
        self.pools: list = []  # per group: its pool, or a state group's (conv, states) pair
        for g in range(len(num_blocks)):
            self.pools.append((pools.pop(0), pools.pop(0)) if state[g] else pools.pop(0))
        self.layer_caches: list[tuple[torch.Tensor, Optional[torch.Tensor]]] = []
        used = [0] * len(num_blocks)
        for g in layout.layer_group:
            pool, i = self.pools[g], used[g]
            if state[g]:
                self.layer_caches.append((pool[0][i], pool[1][i]))
            elif latent[g]:
                self.layer_caches.append((pool[i], None))
            elif fp8:
                slots = (num_blocks[g] + 1) * block_size
                self.layer_caches.append(tuple(kv_fp8.codes_view(pool[i, j], slots, kv_heads,
                                                                 head_dim) for j in (0, 1)))
            else:
                self.layer_caches.append((pool[i, 0], pool[i, 1]))
            used[g] += 1

    @staticmethod
    def _allocate(shapes: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device
                  ) -> list[torch.Tensor]:
        if device.type != "cpu":  # a memset: ~10 ms for the 80 GB of an H100
            return [torch.zeros(s, device=device, dtype=d) for s, d in shapes]
        # The OS backs a CPU tensor's pages only when they are first written, so an
        # untouched cache would grow the worker's memory request by request until full
        # (and fail mid-serving where RAM is short): refused now if it cannot fit,
        # backed in the background from now.
        check_available(sum(math.prod(s) * d.itemsize for s, d in shapes), "KV cache",
                        "kv_cache_memory_gb")
        by_dtype = {d: populated_cpu_zeros([s for s, dd in shapes if dd == d], d)
                    for d in dict.fromkeys(d for _, d in shapes)}
        return [by_dtype[d].pop(0) for _, d in shapes]

    def start_states(self, group: int, slots: list[int]) -> None:
        """Zero the state slots of requests that start at position 0."""
        index = to_device(slots, self.pools[group][0].device, torch.long)
        for pool in self.pools[group]:
            pool.index_fill_(1, index, 0)

    def pad_slot(self, group: int) -> int:
        return self.pad_blocks[group] * self.block_size

    def copy_states(self, group: int, src: int, dst: int) -> None:
        """Every layer's states of slot ``src`` into slot ``dst`` (a snapshot, or a prefix
        hit's restore)."""
        for pool in self.pools[group]:
            pool[:, dst].copy_(pool[:, src])

    def state_slot_bytes(self, group: int) -> int:
        return sum(p[:, 0].numel() * p.element_size() for p in self.pools[group])

    def groups(self) -> list[CacheGroup]:
        """What the capability declaration carries."""
        return [CacheGroup(spec, n, self.layout.num_layers(g))
                for g, (spec, n) in enumerate(zip(self.layout.specs, self.num_blocks))]

    def capacity_tokens(self) -> int:
        """Tokens of concurrency: the first group's blocks (full attention when any)."""
        return self.num_blocks[0] * self.block_size
