"""The draft model of ``speculative_method="draft"``: a smaller model of the target's
vocabulary that the worker runs beside it to propose each request's next drafts.

Its KV cache is a pool of its own with the target's first group's block count, read
through the target's block tables (the scheduler gives a request blocks for the
positions the proposing writes: ``Scheduler._ask_proposals``), so it needs no tables of
its own. When a step's result is known, ``propose`` brings the draft model's KV up to the
request's tokens (the positions it has not computed, or computed for other tokens: a
rejected proposal, a prompt it never saw), then proposes one token at a time, each fed
back: one row a request a forward (on a GPU a decode CUDA graph of its own), a prompt
first in multi-row forwards. What it computed for its own proposals is kept and reused
where the target accepted them.

A draft is sampled as the target samples its position: greedy for greedy requests, else
with the request's temperature and cuts and the same per-(seed, position) uniform (an
unseeded request gets a seed of its own at arrival: ``coupled``), so a draft model that
agrees with the target proposes the very token the target will draw. Acceptance is by
token match (``step_rows.accept_drafts``): the text never depends on the drafts, and a
seeded request's is the text without speculation. Penalties, bias and grammars are the
target's to apply; drafts ignore them.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Optional

import msgspec
import numpy as np
import torch

from pocketllm.config import EngineArgs
from pocketllm.errors import UnsupportedFeatureError
from pocketllm.model_info import ModelInfo
from pocketllm.proto.messages import SamplingSpec, StepPlan, StepResult

from .device import kv_bytes_per_block, to_device
from .kv_cache import PagedKVCache, cache_layout
from .layers.attention import build_metadata
from .loader import load_model_weights
from .sampler import torch_ops
from .sampler.rules import Sampler, is_greedy
from .step_rows import ScheduledSeq

logger = logging.getLogger("pocketllm.worker")


class DraftModel:
    def __init__(self, runner, info: ModelInfo, args: EngineArgs):
        """``runner``: the target's (its device, dtype, kernel policy and model builder)."""
        if runner.tp.world != 1:
            raise UnsupportedFeatureError("a draft model runs at tensor-parallel size 1",
                                          "speculative_model")
        self.device, self.dtype = runner.device, runner.dtype
        self.block_size = args.block_size
        self.max_tokens = args.max_num_batched_tokens  # a forward's rows, as the target's
        self.backend = runner.policy.attention_backend()
        with torch.inference_mode():
            self.model = runner.build(info, args, self.backend)
            load_model_weights(self.model, info, args)
        self.model.eval()
        cfg = self.model.cfg
        why = ("sliding-window layers" if any(w is not None for w in cfg.layer_windows)
               else "linear-attention layers" if any(cfg.linear_layers)
               else "latent attention (MLA)" if self.model.latent_cache_width is not None
               else None)
        if why:
            raise UnsupportedFeatureError(f"the draft model {info.path!r} has {why}; a draft "
                                          "model must be of full attention only", "speculative_model")
        self.num_layers = cfg.num_layers
        self.kv_heads, self.head_dim = self.model.num_local_kv_heads, cfg.head_dim
        self.block_bytes = kv_bytes_per_block(self.num_layers, self.block_size, self.kv_heads,
                                              self.head_dim, self.dtype)
        # its own stream for unseeded rows: the target's draws stay the target's
        self.sampler = Sampler(torch_ops, args.seed + 1)
        self._seeds = np.random.default_rng(args.seed)  # unseeded requests' (``coupled``)
        self.kv: Optional[PagedKVCache] = None
        self.graphs = None  # decode CUDA graphs (``capture``)
        # request -> (positions below it computed for its tokens, the proposals computed
        # after them: valid where the target accepted them)
        self._done: dict[str, tuple[int, list[int]]] = {}
        # request -> (position, token) a step returned before the book knew the position
        self.sampled: dict[str, tuple[int, int]] = {}

    def allocate(self, num_blocks: int, max_model_len: int) -> None:
        """The pool, once the target's first group has its block count."""
        layout = cache_layout([None] * self.num_layers, max_model_len)
        self.kv = PagedKVCache(layout, [num_blocks], self.block_size, self.kv_heads,
                               self.head_dim, self.dtype, self.device)
        self.pad_slot = self.kv.pad_slot(0)

    def read_plan(self, plan: StepPlan, requests: dict) -> None:
        """Before a step: this model reads a request's tokens from the runner's book
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
        self._done.pop(request_id, None)

    def _computed(self, request_id: str, tokens: list[int]) -> int:
        """Leading positions of ``tokens`` whose KV this model holds (not the last: its
        logits are needed)."""
        base, fed = self._done.get(request_id, (0, []))
        if base >= len(tokens):  # (never: a known request's tokens only grow)
            return 0
        n = base
        while n < len(tokens) - 1 and n - base < len(fed) and tokens[n] == fed[n - base]:
            n += 1
        return n

    def after_step(self, result: StepResult, slots: list[tuple[str, int]],
                   counts: dict[str, int], requests: dict) -> list[list[int]]:
        """The proposals after a step's tokens (``result``; ``slots``: each sample row's
        request and position; ``counts``: the plan's asks; ``requests``: the runner's
        ``RequestBook.requests``), one list per result request."""
        first_at: dict[str, int] = {}
        for rid, position in slots:
            first_at.setdefault(rid, position)
        extras = result.extra_token_ids or [[]] * len(result.request_ids)
        wanted = []
        for rid, token, extra in zip(result.request_ids, result.token_ids, extras):
            state = requests.get(rid)
            if state is not None and counts.get(rid):
                tokens = state.token_ids[:first_at[rid]] + [token, *extra]
                wanted.append((rid, tokens, state.block_ids[0], state.sampling, counts[rid]))
        proposed = self.propose(wanted)
        return [proposed.get(rid, []) for rid in result.request_ids]

    def propose(self, wanted: list[tuple[str, list[int], list[int], SamplingSpec, int]]
                ) -> dict[str, list[int]]:
        """``wanted``: (request id, its verified tokens, its first group's block table, its
        sampling, how many drafts) -> the drafts of each. One row a request a forward (a
        CUDA graph's decode step where captured): its tokens not computed yet, one by one
        (a long run of them, a prompt, first in chunks of its own), then each draft."""
        runs = []
        for rid, tokens, table, spec, count in wanted:
            count = min(count, len(table) * self.block_size - len(tokens) + 1)  # its blocks
            if count > 0:
                start = self._catch_up(table, tokens, self._computed(rid, tokens))
                runs.append(_Run(rid, table, msgspec.structs.replace(spec, logprobs=None),
                                 count, tokens[start:], start))
        active = runs
        while active:
            sampling = [r for r in active if len(r.queue) == 1]
            logits = self._step(active, [i for i, r in enumerate(active) if len(r.queue) == 1])
            tokens = []
            if sampling:
                tokens, _ = self.sampler.draw(logits, [r.spec for r in sampling],
                                              [r.position + 1 for r in sampling])
                tokens = tokens.tolist()
            for r in active:
                r.queue.pop(0)
                r.position += 1
            for r, token in zip(sampling, tokens):
                r.drafts.append(token)
                if len(r.drafts) < r.count:
                    r.queue.append(token)
            active = [r for r in active if r.queue]
        for r in runs:  # the positions before its last draft hold its tokens and drafts
            self._done[r.rid] = (r.position - len(r.drafts) + 1, r.drafts[:-1])
        return {r.rid: r.drafts for r in runs}

    def _catch_up(self, table: list[int], tokens: list[int], start: int) -> int:
        """Compute all but the last of a long run of uncomputed tokens (a prompt) in
        multi-row forwards; -> where ``propose``'s one-row steps start."""
        while len(tokens) - start > CATCH_UP_ROWS:
            n = min(self.max_tokens, len(tokens) - 1 - start)
            self._forward([ScheduledSeq(table, start, n, 0)], tokens[start:start + n], [])
            start += n
        return start

    def _step(self, runs: list["_Run"], sample_rows: list[int]) -> Optional[torch.Tensor]:
        """One forward of each run's next token; the logits of ``sample_rows``."""
        seqs = [ScheduledSeq(r.table, r.position, 1, i) for i, r in enumerate(runs)]
        ids, positions = [r.queue[0] for r in runs], [r.position for r in runs]
        rung = self.graphs.rung(len(runs)) if self.graphs is not None else 0
        if rung:
            logits = self.graphs.run([seqs], ids, positions, rung)
            return logits.index_select(0, to_device(sample_rows, self.device)) if sample_rows else None
        return self._forward(seqs, ids, sample_rows)

    def _forward(self, seqs: list[ScheduledSeq], ids: list[int], sample_rows: list[int]
                 ) -> Optional[torch.Tensor]:
        """An eager forward of ``seqs`` (their tokens ``ids``, in order) -> the logits of
        ``sample_rows`` (None when none)."""
        positions = [p for s in seqs for p in range(s.start, s.start + s.num_tokens)]
        meta = build_metadata(seqs, self.block_size, [None], self.device, self.pad_slot,
                              kernel_tables=getattr(self.backend, "kernel_tables", False))
        hidden = self.model(to_device(ids, self.device, torch.long),
                            to_device(positions, self.device, torch.long), max(positions),
                            [meta], self.kv.layer_caches)
        if not sample_rows:
            return None
        return self.model.compute_logits(hidden.index_select(0, to_device(sample_rows,
                                                                           self.device)))

    def capture(self, max_batch: int, max_model_len: int) -> None:
        """Decode CUDA graphs for the one-row steps (the GPU, where the target has them)."""
        from .cuda_graphs import DecodeGraphs

        self.graphs = DecodeGraphs(self.model, self.kv.layer_caches, self.block_size,
                                   max_model_len, self.kv.pad_blocks, self.device, max_batch)


# A request's uncomputed tokens up to this many run one a step (a graph's); more (a prompt
# the draft model has not seen) are computed in one forward first.
CATCH_UP_ROWS = 4


@dataclass
class _Run:
    """One request's proposing: the tokens still to feed (its uncomputed ones, then each
    draft), the position of the next, the drafts so far."""

    rid: str
    table: list[int]
    spec: SamplingSpec
    count: int
    queue: list[int]
    position: int
    drafts: list[int] = field(default_factory=list)


def draft_model(runner, info: ModelInfo, args: EngineArgs) -> Optional[DraftModel]:
    """The runner's draft model (None: speculation is not "draft"), loaded as the target
    is (its load format, dtype and device; ``pocketllm/draft_info.py`` resolved it)."""
    if args.speculative_method != "draft":
        return None
    if info.draft is None:
        raise UnsupportedFeatureError("speculative_method='draft' without the draft model's "
                                      "info (the supervisor resolves it: draft_info.py)", "speculative_model")
    draft_args = dataclasses.replace(args, model=args.speculative_model, quantization=None,
                                     speculative_method=None, speculative_model=None)
    draft = DraftModel(runner, ModelInfo(**info.draft), draft_args)
    logger.info("draft model %s (%s, %d layers) proposes up to %d tokens a step",
                info.draft["path"], info.draft["architecture"], draft.num_layers,
                args.num_speculative_tokens)
    return draft
