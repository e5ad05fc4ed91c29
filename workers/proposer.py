"""What the worker's drafters share (a draft model: ``draft_model.py``; the checkpoint's MTP
layer: ``mtp_proposer.py``): a KV pool of their own with the target's first group's block
count, read through the target's block tables (the scheduler gives a request blocks for
the positions proposing writes: ``Scheduler._ask_proposals``), and drafts sampled as the
target samples their positions.

A draft is sampled greedy for greedy requests, else with the request's temperature and
cuts and the same per-(seed, position) uniform as the target's (an unseeded request gets
a seed of its own at arrival: ``coupled``), so a drafter that agrees with the target
proposes the very token the target will draw. Acceptance is by token match
(``step_rows.accept_drafts``): the text never depends on the drafts, and a seeded
request's is the text without speculation. Penalties, bias and grammars are the
target's to apply; drafts ignore them.
"""

from __future__ import annotations

from typing import Optional

import msgspec
import numpy as np
import torch

from pocketllm.config import EngineArgs
from pocketllm.proto.messages import SamplingSpec, StepPlan, StepResult

from .device import kv_bytes_per_block, to_device
from .kv_cache import PagedKVCache, cache_layout
from .layers.attention import build_metadata
from .sampler import torch_ops
from .sampler.rules import Sampler, is_greedy
from .step_rows import ScheduledSeq


class Proposer:
    """``num_layers`` layers of ``kv_heads`` x ``head_dim`` keys and values cached."""

    # whether it reads every step's hidden states (``LaunchedStep.hidden``)
    reads_hidden = False

    def __init__(self, runner, args: EngineArgs, backend, num_layers: int, kv_heads: int,
                 head_dim: int, latent_width: Optional[int] = None):
        """``runner``: the target's (its device and dtype); ``backend``: the attention
        backend the drafter's layers were built with; ``latent_width``: an MLA layer's
        cache row (then it caches one latent row a position, not keys and values)."""
        self.device, self.dtype = runner.device, runner.dtype
        self.block_size = args.block_size
        self.max_tokens = args.max_num_batched_tokens  # a forward's rows, as the target's
        self.backend = backend
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.latent_width = latent_width
        self.block_bytes = kv_bytes_per_block(num_layers, self.block_size, kv_heads, head_dim,
                                              self.dtype, latent_width)
        # its own stream for unseeded rows: the target's draws stay the target's
        self.sampler = Sampler(torch_ops, args.seed + 1)
        self._seeds = np.random.default_rng(args.seed)  # unseeded requests' (``coupled``)
        self.kv: Optional[PagedKVCache] = None
        # request -> (position, token) a step returned before the book knew the position
        self.sampled: dict[str, tuple[int, int]] = {}

    def allocate(self, num_blocks: int, max_model_len: int) -> None:
        """The pool, once the target's first group has its block count."""
        latent = self.latent_width is not None
        layout = cache_layout([None] * self.num_layers, max_model_len, latent)
        self.kv = PagedKVCache(layout, [num_blocks], self.block_size, self.kv_heads,
                               self.head_dim, self.dtype, self.device, self.latent_width)
        self.pad_slot = self.kv.pad_slot(0)

    def capture(self, max_batch: int, max_model_len: int) -> None:
        """CUDA graphs of its own (none unless a drafter says)."""

    def read_plan(self, plan: StepPlan, requests: dict) -> None:
        """Before a step: a drafter reads a request's tokens from the runner's book
        (``requests``), so put in those a plan named PENDING that a finished step already
        returned (``sampled``: on the CPU a step's tokens go before the next plan comes); a
        request back after preemption starts over; a new one's draws are coupled to its
        drafts' (``coupled``)."""
        for rid, (position, token) in self.sampled.items():
            state = requests.get(rid)
            if state is not None and len(state.token_ids) > position:
                state.token_ids[position] = token
        self.sampled.clear()
        for rid in plan.finished_request_ids:
            self.forget(rid)
        for new in plan.new_requests:
            self.forget(new.request_id)
            state = requests[new.request_id]
            state.sampling = self.coupled(state.sampling)

    def coupled(self, spec: SamplingSpec) -> SamplingSpec:
        """A request's sampling with a seed, drawn here for one that has none: the target
        then draws each position's uniform from (seed, position) as for a seeded request
        (the same distribution as the shared stream's), and the drafts use the same."""
        if spec.seed is not None or is_greedy(spec):
            return spec
        return msgspec.structs.replace(spec, seed=int(self._seeds.integers(1 << 62)))

    def forget(self, request_id: str) -> None:
        """Drop what it keeps of a request (finished, or back from preemption)."""

    def after_step(self, result: Optional[StepResult], step, requests: dict
                   ) -> Optional[list[list[int]]]:
        """After a step (``step``: the runner's ``LaunchedStep``; ``result``: its tokens,
        None when it sampled none): the proposals of the requests it asks
        (``step.proposals``), one list per result request; None when none asked."""
        raise NotImplementedError

    def draw(self, logits: torch.Tensor, specs: list[SamplingSpec], positions: list[int]
             ) -> list[int]:
        """Drafts of ``logits``' rows, at ``positions``, as the target would sample them."""
        return self.draw_on_device(logits, specs, positions).tolist()

    def draw_on_device(self, logits: torch.Tensor, specs: list[SamplingSpec],
                       positions: list[int]) -> torch.Tensor:
        """``draw``'s tokens [rows] where the logits are, not waited for."""
        specs = [msgspec.structs.replace(s, logprobs=None) for s in specs]
        return self.sampler.draw(logits, specs, positions)[0]

    def metadata(self, seqs: list[ScheduledSeq]):
        """Attention metadata of ``seqs`` over this pool."""
        return build_metadata(seqs, self.block_size, [None], self.device, self.pad_slot,
                              kernel_tables=getattr(self.backend, "kernel_tables", False))

    def ids(self, values: list[int]) -> torch.Tensor:
        return to_device(values, self.device, torch.long)


def verified_tokens(result: StepResult, slots: list[tuple[str, int]], requests: dict
                    ) -> dict[str, list[int]]:
    """Request -> its tokens once ``result`` is in (the known ones before its first sampled
    position, then the step's tokens), for each request the step sampled."""
    first_at: dict[str, int] = {}
    for rid, position in slots:
        first_at.setdefault(rid, position)
    extras = result.extra_token_ids or [[]] * len(result.request_ids)
    out = {}
    for rid, token, extra in zip(result.request_ids, result.token_ids, extras):
        state = requests.get(rid)
        if state is not None:
            out[rid] = state.token_ids[:first_at[rid]] + [token, *extra]
    return out
