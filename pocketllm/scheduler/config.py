"""What the scheduler is configured with (mostly what rank 0 declared at the handshake), and
what one ``schedule()`` call has decided so far."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from pocketllm.config import SPECULATIVE_MAX_BATCH
from pocketllm.errors import InvalidRequestError, UnsupportedFeatureError
from pocketllm.proto.messages import CacheGroup, CacheSpec, WorkerCapabilities

from .request import Request


@dataclass
class SchedulerConfig:
    block_size: int
    num_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # While a decode-only batch runs, a new request may wait this long for others to fill
    # a prefill step with it (0: admit at once). A step holding a prefill runs eagerly, a
    # decode-only one replays a CUDA graph, so batching admissions keeps most steps fast.
    admission_delay_s: float = 0.0
    # Plan step N+1 while step N runs (see plan_ahead_ok); the loop turns it on for one
    # CUDA rank, where it hides the round trip between the worker and the scheduler.
    overlap: bool = False
    # The worker's KV cache groups (kv_groups.py); empty: one full group of num_kv_blocks.
    cache_groups: list[CacheGroup] = field(default_factory=list)
    # Speculative decoding (drafter.py): the most drafts a decoding request verifies in one
    # step (0: off), and the largest batch of decodes that drafts at all.
    num_speculative_tokens: int = 0
    speculative_max_batch: int = SPECULATIVE_MAX_BATCH
    # the most tokens a step with drafts may hold (the worker's exact rows; 0: no limit)
    speculative_max_rows: int = 0
    # the drafter: "ngram" (ngram.py), "draft" or "mtp" (the worker's draft model or MTP
    # layer: worker_drafts.py) or "replay" (replay.py)
    speculative_method: str = ""
    speculative_replay: Optional[str] = None  # the replay drafter's file

    def __post_init__(self) -> None:
        for name in ("block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens",
                     "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}", name)
        if not self.cache_groups:
            self.cache_groups = [CacheGroup(CacheSpec(), self.num_kv_blocks)]


# What this scheduler cannot work without: it hands out KV blocks and mixes requests.
REQUIRED_CAPABILITIES = ("paged_kv", "continuous_batching")


def config_from_capabilities(caps: WorkerCapabilities, max_num_batched_tokens: int,
                             admission_delay_s: float, overlap: bool,
                             speculative_replay: Optional[str] = None) -> SchedulerConfig:
    """The scheduler branches on what the worker declared, never on the engine arguments
    behind it: the KV geometry, and whether prompts may be chunked and prefixes cached."""
    missing = [name for name in REQUIRED_CAPABILITIES if not getattr(caps, name)]
    if missing:
        raise UnsupportedFeatureError(
            f"the worker declared no {', '.join(missing)}, which this scheduler needs")
    return SchedulerConfig(
        block_size=caps.block_size, num_kv_blocks=caps.num_kv_blocks,
        max_num_seqs=caps.max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=caps.max_model_len, enable_prefix_caching=caps.prefix_caching,
        enable_chunked_prefill=caps.chunked_prefill,
        # Only decode steps under CUDA graphs gain from batched admissions.
        admission_delay_s=admission_delay_s if caps.cuda_graph_batch_sizes else 0.0,
        overlap=overlap, cache_groups=list(caps.cache_groups),
        num_speculative_tokens=caps.num_speculative_tokens,
        speculative_max_rows=caps.speculative_max_rows,
        speculative_method=caps.speculative_method, speculative_replay=speculative_replay)


class StepDraft:
    """What one schedule() call has decided so far."""

    def __init__(self, budget: int):
        self.budget = budget
        self.scheduled: dict[Request, int] = {}  # request -> tokens to compute, in order
        self.drafts: dict[Request, list[int]] = {}  # their draft tokens (counted in scheduled)
        self.proposals: dict[Request, int] = {}  # drafts the worker proposes after the step
        # a recurrent-state model's: (group, slots) keeping each draft row's state
        self.draft_snapshots: dict[Request, list[tuple[int, list[int]]]] = {}
        self.preempted_ids: list[str] = []  # ids workers must drop in this very plan
        self.preempted = False
        self.has_prefill = False

    def add(self, req: Request, n: int) -> None:
        self.scheduled[req] = n
        self.budget -= n
        if req.num_tokens - req.num_computed_tokens > 1:
            self.has_prefill = True
