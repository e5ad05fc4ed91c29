"""LiteRunner: the torch-free worker's data plane, for a GGUF checkpoint on the CPU.

The same contract as ``runner.ModelRunner`` (``launch``/``finish``, the capability
declaration, the plan's bookkeeping through ``step_rows.RequestBook``), computed by
``LiteModel`` on numpy buffers and sampled by the numpy ``Sampler``. Its KV pools are
float32 host memory, one per cache group, sized and backed as the torch worker's are
(``kv_plan.py``); each group's pad block stays zero.

Each step computes at launch (the CPU has no queue to overlap with), so the worker sends
its tokens at once; a plan made before the scheduler saw them (overlap scheduling) names
them PENDING, and they are taken from the last step's.

Speculative decoding (``--speculative-method ngram``): a request's drafts are computed
after its last token in the same forward and every one of those positions is sampled, the
token at position p + j with the randomness position p + j always gets; the drafts are
accepted while each equals the token sampled before it (``accept_drafts``), so the text is
the one decoding without drafts samples, seeded or greedy (docs/speculative.md).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
import numpy as np
from threadpoolctl import threadpool_limits

from pocketllm.config import EngineArgs, cpu_thread_count
from pocketllm.model_info import ModelInfo
from pocketllm.proto.messages import (CacheGroup, SamplingSpec, StepPlan, StepResult,
                                      WorkerCapabilities)
from pocketllm.sampling import MAX_LOGPROBS

from ..kv_plan import cache_layout, check_available, plan_blocks, populated_zeros
from ..step_rows import (RequestBook, accept_drafts, check_state_plan, row_histories,
                         snapshot_rows)
from .model import LiteModel, StepViews, step_view
from ..sampler import numpy_ops
from ..sampler.rules import Sampler, TokenHistory, structured_token_mask

logger = logging.getLogger("pocketllm.worker")


@dataclass
class LiteStep:
    """A computed step, its result waiting for ``finish``."""

    result: StepResult


class LiteRunner:
    computes_at_launch = True

    def __init__(self, info: ModelInfo, args: EngineArgs):
        started = time.perf_counter()
        self.info, self.args = info, args
        self.threads = cpu_thread_count()
        # One thread pool: the library's OpenMP threads run the products, and numpy's BLAS
        # (a long step's attention) stays on the calling thread. Two pools spinning
        # against each other on two cores made a 24-token prompt 10x slower (issue 34).
        threadpool_limits(1, user_api="blas")
        self.model = LiteModel(info, args.quantization, args.seed)
        cfg = self.model.cfg
        self.block_size, self.max_model_len = args.block_size, info.max_model_len
        # a linear-attention layer keeps a recurrent state per sequence: a state group
        layout = cache_layout(cfg.layer_windows, self.max_model_len,
                              state_layers=getattr(cfg, "linear_layers", None) or None)
        self.layout = layout
        self.state_groups = [layout.is_state(g) for g in range(len(layout.specs))]
        row = cfg.num_kv_heads * cfg.head_dim  # floats a slot holds, K or V
        per_layer_block = 2 * self.block_size * row * 4
        state_shapes = self.model.state_shapes() if any(self.state_groups) else ((0,), (0,))
        state_floats = [math.prod(shape) for shape in state_shapes]  # a slot's, per layer
        state_layers = sum(layout.num_layers(g) for g, s in enumerate(self.state_groups) if s)
        self.num_blocks = plan_blocks(layout, args, self.max_model_len, per_layer_block,
                                      state_slot_bytes=4 * sum(state_floats) * state_layers)
        self.pad_blocks = list(self.num_blocks)  # the spare zero block (or slot) past each pool's end
        # per layer: its (K, V) pools, or its (conv states, states) with a slot per sequence
        shapes = [[((n + 1) * self.block_size, cfg.num_kv_heads, cfg.head_dim)] * 2
                  if not self.state_groups[g] else [(n + 1, *shape) for shape in state_shapes]
                  for g, n in ((g, self.num_blocks[g]) for g in layout.layer_group)]
        sizes = [4 * math.prod(shape) for pair in shapes for shape in pair]
        check_available(sum(sizes), "KV cache", "kv_cache_memory_gb")
        buffers = populated_zeros(sizes)
        self.model.resident.start(reserved=sum(sizes))
        arrays = [np.frombuffer(b, dtype=np.float32).reshape(shape) if len(b)
                  else np.zeros(shape, np.float32)
                  for b, shape in zip(buffers, (shape for pair in shapes for shape in pair))]
        self._buffers = buffers  # the arrays' memory
        self.caches = list(zip(arrays[0::2], arrays[1::2]))
        self.views = [(g, w) for g, w in zip(layout.layer_group, cfg.layer_windows)]
        self.model.bind(self.caches, self.views)
        self.book = RequestBook(self.num_blocks, self.pad_blocks,
                                [layout.window(g) for g in range(len(layout.specs))],
                                self.block_size, args.max_num_seqs, self._history,
                                self.state_groups)
        self.sampler = Sampler(numpy_ops, args.seed)
        self._last_tokens: dict[str, int] = {}  # the last step's sampled token per request
        self.load_seconds = time.perf_counter() - started
        logger.info("worker ready (no torch): %s on cpu/float32, KV capacity %d tokens "
                    "(%s; blocks of %d), load %.1fs", info.architecture,
                    self.num_blocks[0] * self.block_size,
                    ", ".join(f"{n} {'state slots' if self.state_groups[g] else 'blocks'} x "
                              f"{layout.num_layers(g)} layers"
                              for g, n in enumerate(self.num_blocks)),
                    self.block_size, self.load_seconds)

    def capabilities(self) -> WorkerCapabilities:
        return WorkerCapabilities(
            device="cpu", dtype="float32", architecture=self.info.architecture,
            block_size=self.block_size, num_kv_blocks=self.num_blocks[0],
            max_num_seqs=self.args.max_num_seqs, max_model_len=self.max_model_len,
            vocab_size=self.model.cfg.vocab_size, tensor_parallel_size=1,
            chunked_prefill=self.args.enable_chunked_prefill,
            prefix_caching=self.args.enable_prefix_caching,
            max_logprobs=MAX_LOGPROBS, load_seconds=round(self.load_seconds, 3),
            attention_backend="LiteModel", weight_bytes=self.model.step_read_bytes(),
            state_step_bytes=2 * sum(k[0].nbytes + v[0].nbytes  # read, then written
                                     for (k, v), (g, _w) in zip(self.caches, self.views)
                                     if self.state_groups[g]),
            cache_groups=[CacheGroup(spec, n, self.layout.num_layers(g)) for g, (spec, n)
                          in enumerate(zip(self.layout.specs, self.num_blocks))],
            speculative_method=self.args.speculative_method or "",
            num_speculative_tokens=(self.args.num_speculative_tokens
                                    if self.args.speculative_method else 0),
            # below the many-row product and the attention by matrix products, every row's
            # arithmetic is the same whatever the step's row count (docs/speculative.md)
            speculative_max_rows=min(int(self.model.lib.pq_gemm_rows(0)),
                                     self.model.stack_rows) - 1)

    def launch(self, plan: StepPlan) -> LiteStep:
        """Compute a step and sample it; a failure comes back as ``StepResult.error``."""
        started = time.perf_counter()
        try:
            result = self._step(plan)
        except Exception as e:  # the worker process must outlive a bad step
            logger.exception("step %s failed", plan.step_id)
            return LiteStep(StepResult(step_id=plan.step_id, error=f"{type(e).__name__}: {e}"))
        if result.path:
            result.launch_ms = (time.perf_counter() - started) * 1e3
        return LiteStep(result)

    def finish(self, step: LiteStep) -> StepResult:
        return step.result

    def _history(self, spec: SamplingSpec, prompt_ids: list[int], output_ids: list[int]
                 ) -> TokenHistory:
        return TokenHistory(spec, prompt_ids, output_ids, self.model.cfg.vocab_size)

    def _step(self, plan: StepPlan) -> StepResult:
        check_state_plan(plan, self.state_groups, self.num_blocks)
        for group, src, dst in plan.state_copies_before:  # a prefix hit's snapshot
            for pools in self._state_layers(group):
                for pool in pools:
                    pool[dst] = pool[src]
        return self._compute(plan)

    def _state_layers(self, group: int) -> list[tuple[np.ndarray, np.ndarray]]:
        return [c for c, (g, _w) in zip(self.caches, self.views) if g == group]

    def _state_view(self, group: int, seqs, num_rows: int, snapshots) -> StepViews:
        """A state group's view of a step: each row's slot, zeroed first for a sequence
        that starts at position 0, and the plan's snapshots (``state_snapshots``) by row."""
        slots = np.zeros(num_rows, dtype=np.int64)
        taken = np.full(num_rows, -1, dtype=np.int64)
        for row, snapshot in snapshot_rows(seqs, snapshots, group, self.num_blocks[group]):
            taken[row] = snapshot
        for s in seqs:
            slot = s.block_ids[0]
            slots[s.row:s.row + s.num_tokens] = slot
            if s.start == 0:
                for pools in self._state_layers(group):
                    for pool in pools:
                        pool[slot] = 0.0
        return StepViews(slots, np.zeros((num_rows, 1), np.int64), np.zeros(num_rows, np.int64),
                         snapshots=taken)

    def _compute(self, plan: StepPlan) -> StepResult:
        entries = self.book.update(plan, lambda rid: rid in self._last_tokens)
        rows = self.book.rows(plan, entries)
        for row, rid in rows.pending_rows:
            token = self._last_tokens[rid]
            rows.input_ids[row] = self.book.requests[rid].token_ids[rows.positions[row]] = token
        if not rows.seqs[0]:
            return StepResult(step_id=plan.step_id)
        positions = np.array(rows.positions, dtype=np.int64)
        views = {(g, w): self._state_view(g, rows.seqs[g], len(positions), plan.state_snapshots)
                 if self.state_groups[g] else
                 step_view(rows.seqs[g], w, self.block_size, self.pad_blocks[g] * self.block_size,
                           len(positions))
                 for g, w in set(self.views)}
        logits = self.model.forward(np.array(rows.input_ids, dtype=np.int64), positions, views,
                                    rows.sample_rows, self.threads)
        if not rows.sample_rows:
            return StepResult(step_id=plan.step_id, path="eager")
        states = [state for _rid, state in rows.samplers]
        mask = structured_token_mask(plan.structured_request_ids, plan.structured_bitmask,
                                     [rid for rid, _state in rows.samplers])
        out = self.sampler(logits, [s.sampling for s in states],
                           [len(s.token_ids) + off for s, off in zip(states, rows.sample_offsets)],
                           row_histories(rows), mask)
        result = accept_drafts(plan.step_id, [rid for rid, _ in rows.samplers], out.token_ids,
                               out.logprobs, rows.drafts, path="eager")
        self._last_tokens = {rid: ([first, *more])[-1] for rid, first, more in
                             zip(result.request_ids, result.token_ids,
                                 result.extra_token_ids or [[]] * len(result.request_ids))}
        return result
