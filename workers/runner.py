"""ModelRunner: the worker's data plane. Loads weights, owns the paged KV cache,
runs one flattened forward per StepPlan and samples.

The runner never appends the tokens it samples: the next plan's
``new_token_ids`` carries them, so every rank holds the same state.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from pocketllm.config import EngineArgs
from pocketllm.errors import UnsupportedFeatureError
from pocketllm.model_info import ModelInfo
from pocketllm.sampling import MAX_LOGPROBS
from pocketllm.proto.messages import SamplingSpec, StepPlan, StepResult, WorkerCapabilities

from .device import (choose_device, choose_dtype, configure_cpu_threads, dtype_name,
                     gpu_free_bytes, kv_bytes_per_block, to_device)
from . import kernel_policy
from .distributed import RankFailure, current_group, ranks_on_this_host, share_cpu_threads
from .draft_model import draft_model
from .kv_cache import PagedKVCache, cache_layout, plan_blocks
from .layers.attention import build_metadata
from .layers.linear_attention import build_state_metadata
from .loader import load_model_weights
from .sampler import torch_ops
from .sampler.rules import Sampler, TokenHistory, structured_token_mask
from .sampler.torch_ops import HostCopy
from .models.base import check_tensor_parallel
from .models.registry import arch_config, build_model
from .mtp_proposer import MTPProposer
from .runner_graphs import capture_graphs, warm_up_attention, warm_up_sampler
from .step_rows import (RequestBook, RequestState, ScheduledSeq, StepError, StepRows,
                        accept_drafts, check_state_plan, row_histories, snapshot_rows)

logger = logging.getLogger("pocketllm.worker")


@dataclass
class LaunchedStep:
    """A step queued on the device; ``ModelRunner.finish`` reads its tokens back."""

    step_id: int
    copy: Optional[HostCopy] = None  # the sampled tokens on their way; None: none sampled
    specs: list = None
    slots: list[tuple[str, int]] = None  # (request id, position of its new token)
    drafts: Optional[dict[str, list[int]]] = None  # a speculative step's, by request
    proposals: Optional[dict[str, int]] = None  # drafts the drafter proposes after it
    # for a drafter that reads the target's hidden states (``Proposer.reads_hidden``): the
    # step's [rows, hidden] before the final norm, and its sequences (group 0's) by request
    hidden: Optional[torch.Tensor] = None
    seqs: Optional[list] = None
    seq_ids: Optional[list[str]] = None
    error: Optional[str] = None
    path: str = ""  # StepResult.path
    launch_s: float = 0.0  # host time to queue the step
    span: Optional[tuple] = None  # CUDA events queued before and after the step's work


class ModelRunner:
    def __init__(self, info: ModelInfo, args: EngineArgs, rank: int = 0, world_size: int = 1,
                 show_progress: bool = False):
        started = time.perf_counter()
        # Tensor parallel: heads that do not split are refused before any weight is read;
        # world > 1 needs distributed.init_from_env first (it also picks the CUDA device).
        check_tensor_parallel(arch_config(info), world_size)
        self.tp = current_group(world_size)
        if self.tp.rank != rank:
            raise RuntimeError(f"rank {rank} joined the process group as rank {self.tp.rank}")
        self.info, self.args, self.rank, self.world_size = info, args, rank, world_size
        self.device = choose_device(args)
        self.dtype = choose_dtype(args, self.device)
        if self.device.type == "cpu":
            configure_cpu_threads()
            share_cpu_threads(ranks_on_this_host(args))
        if args.batch_invariant:
            kernel_policy.check_batch_invariant(self.device, world_size)
        with torch.inference_mode(), kernel_policy.building(args.batch_invariant):
            self.policy = kernel_policy.policy_for(self.device)
            self.backend = self.policy.attention_backend()
            self.model = self.build(info, args, self.backend)
            load_model_weights(self.model, info, args, show_progress=show_progress)
        self.model.eval()
        # A family may attend its own way (MLA: workers/layers/mla.py): its backend decides
        # the metadata the runner (and an MTP drafter) builds and whether CUDA graphs can
        # capture it.
        self.backend = self.model.attention_backend
        self.draft = proposer_for(self, info, args)  # the worker's drafter, if any
        cfg = self.model.cfg
        self.block_size = args.block_size
        self.max_model_len = info.max_model_len
        kv_heads = self.model.num_local_kv_heads  # this rank's share of the KV heads
        # Layers of one cache spec (full attention, a sliding window) share a pool: kv_cache.py.
        # An MLA model caches one latent row per position (kv_cache.py).
        latent = self.model.latent_cache_width
        # A linear-attention layer keeps a recurrent state per sequence: a state group.
        layout = cache_layout(cfg.layer_windows, self.max_model_len, latent is not None,
                              cfg.linear_layers or None)
        self.model.layer_group = tuple(layout.layer_group)
        state_shapes, slot_bytes = self._state_shapes(layout)
        kv_dtype = self.policy.kv_cache_dtype(args.kv_cache_dtype, self.device, self.dtype,
                                              latent is not None)
        per_layer_block = kv_bytes_per_block(1, self.block_size, kv_heads, cfg.head_dim,
                                             kv_dtype, latent)
        if self.device.type == "cpu":  # the ranks of a host share one RAM budget
            per_layer_block *= ranks_on_this_host(args)
            slot_bytes *= ranks_on_this_host(args)
        # Every rank must hold what rank 0 declares: the smallest count wins.
        counts = [self.tp.min_int(n, self.device) for n in plan_blocks(
            layout, args, self.max_model_len, per_layer_block, gpu_free_bytes(self.device),
            slot_bytes, self.draft.block_bytes if self.draft else 0)]
        if self.draft is not None:  # read through the first group's tables
            self.draft.allocate(counts[0], self.max_model_len)
        self.kv = PagedKVCache(layout, counts, self.block_size, kv_heads, cfg.head_dim,
                               self.dtype, self.device, latent, state_shapes, kv_dtype)
        self.kv_caches = self.kv.layer_caches
        self.num_kv_blocks = counts[0]
        self.group_windows = layout.layer_windows
        # per group: the sliding window whose table entries behind it point at the pad block
        self.group_slide = [layout.window(g) for g in range(len(counts))]
        self.state_groups = [layout.is_state(g) for g in range(len(counts))]
        warm_up_attention(self)
        self.sampler = Sampler(torch_ops, args.seed)
        self.book = RequestBook(self.kv.num_blocks, self.kv.pad_blocks, self.group_slide,
                                self.block_size, args.max_num_seqs, self._history,
                                self.state_groups)
        # The last launched step's sampled tokens, still on the device: a PENDING input of
        # the next plan is read from here (overlapped scheduling).
        self._last_tokens: Optional[torch.Tensor] = None
        self._last_rows: dict[str, int] = {}
        self._spans: list[tuple] = []  # (path, start, end) of device spans not read yet
        self.graphs, self.mixed_graphs, self.verify_graphs = capture_graphs(self)
        warm_up_sampler(self)
        self.load_seconds = time.perf_counter() - started
        logger.info("worker ready: %s on %s/%s, KV capacity %d tokens (%s; blocks of %d%s), "
                    "load %.1fs", info.architecture, self.device, dtype_name(self.dtype),
                    self.kv.capacity_tokens(), self._describe_groups(), self.block_size,
                    ", FP8 keys and values" if kv_dtype == torch.float8_e4m3fn else "",
                    self.load_seconds)

    def build(self, info: ModelInfo, args: EngineArgs, backend):
        """The model, each linear layer with its method (``layers/linear_method.py``): a
        GGUF file's blocks (or ``--quantization``'s random ones) may stay blocks on the GPU
        path, and FP8 weights FP8, so their layers are built with the weights deferred
        until the stored types choose."""
        from .loader.stored_types import stored_types

        stored = stored_types(info, args, self.policy, self.device)
        if stored and args.speculative_method == "mtp":
            raise UnsupportedFeatureError("speculative_method='mtp' with quantized weights (GGUF "
                                          "blocks, --quantization) is not built yet",
                                          "speculative_method")
        if not stored:
            model = build_model(info, backend, self.device, self.dtype, self.tp)
            if args.speculative_method == "mtp":  # its weights load with the model's
                model.build_mtp(backend)
            return model
        from .layers import linear_method

        with linear_method.deferred_weights():
            model = build_model(info, backend, self.device, self.dtype, self.tp)
        linear_method.materialize(model, stored, self.device)
        return model

    def _state_shapes(self, layout) -> tuple[Optional[tuple], int]:
        """One slot's (conv, recurrent) state shapes of a linear-attention layer and the
        bytes of a slot over all of them; (None, 0) without such layers."""
        mixers = [layer.self_attn for layer, g in zip(self.model.layers, layout.layer_group)
                  if layout.is_state(g)]
        if not mixers:
            return None, 0
        conv, state = mixers[0].state_shapes()
        per_layer = math.prod(conv) * self.dtype.itemsize + math.prod(state) * 4  # float32
        return (conv, state), per_layer * len(mixers)

    def _describe_groups(self) -> str:
        return ", ".join(
            f"{g.num_blocks} state slots x {g.num_layers} linear-attention layers "
            f"({self.kv.state_slot_bytes(i) / (1 << 20):.1f} MiB a sequence)"
            if g.spec.kind == "state" else
            f"{g.num_blocks} blocks x {g.num_layers} "
            + ("full-attention layers" if g.spec.kind == "full"
               else "latent-attention (MLA) layers" if g.spec.kind == "mla"
               else f"sliding-window layers (window {g.spec.window})")
            for i, g in enumerate(self.kv.groups()))

    @property
    def pad_slot(self) -> int:
        """The first group's spare zero slot (a model of one group has only that one)."""
        return self.kv.pad_slot(0)

    @property
    def computes_at_launch(self) -> bool:
        """``launch`` returns with the step computed (the CPU): its tokens can go at once."""
        return self.device.type != "cuda"

    def capabilities(self) -> WorkerCapabilities:
        return WorkerCapabilities(
            device=str(self.device), dtype=dtype_name(self.dtype),
            architecture=self.info.architecture, block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks, max_num_seqs=self.args.max_num_seqs,
            max_model_len=self.max_model_len, vocab_size=self.model.cfg.vocab_size,
            tensor_parallel_size=self.world_size,
            # What this worker does, as asked: the scheduler and server branch on this only.
            chunked_prefill=self.args.enable_chunked_prefill,
            prefix_caching=self.args.enable_prefix_caching,
            paged_kv=True,  # KV lives in blocks the scheduler assigns (block tables)
            continuous_batching=True,  # a step mixes prefill chunks and decodes of any requests
            max_logprobs=MAX_LOGPROBS, load_seconds=round(self.load_seconds, 3),
            attention_backend=type(self.backend).__name__,
            cuda_graph_batch_sizes=self.graphs.batch_sizes if self.graphs else [],
            batch_invariant=self.policy.batch_invariant,
            weight_bytes=self.model.step_read_bytes(),
            state_step_bytes=sum(2 * self.kv.state_slot_bytes(g)  # read, then written
                                 for g, state in enumerate(self.state_groups) if state),
            cache_groups=self.kv.groups(),
            speculative_method=self.args.speculative_method or "",
            num_speculative_tokens=(self.args.num_speculative_tokens
                                    if self.args.speculative_method else 0),
            # a verification step past the verify graphs' rows would run eagerly (slowly)
            speculative_max_rows=self.verify_graphs.max_rows if self.verify_graphs else 0)

    def launch(self, plan: StepPlan) -> "LaunchedStep":
        """Queue a step's forward and sampling on the device without waiting for them, so
        the next plan can be launched before this one's tokens are read (``finish``). A failure
        comes back as ``StepResult.error``, except a tensor-parallel forward's (``RankFailure``):
        the ranks are out of step and the worker must exit."""
        started, start = time.perf_counter(), self._event()
        try:
            with torch.inference_mode():
                check_state_plan(plan, self.state_groups, self.kv.num_blocks)
                for group, src, dst in plan.state_copies_before:  # a prefix hit's snapshot
                    self.kv.copy_states(group, src, dst)
                step = self._launch(plan)
        except RankFailure:
            raise
        except Exception as e:  # the worker process must outlive a bad step
            logger.exception("step %s failed", plan.step_id)
            return LaunchedStep(plan.step_id, error=f"{type(e).__name__}: {e}")
        step.launch_s = time.perf_counter() - started
        if start is not None and step.path:  # an empty plan (overlap's filler) ran nothing
            step.span = (start, self._event())
        return step

    def _event(self) -> Optional[torch.cuda.Event]:
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def finish(self, step: "LaunchedStep") -> StepResult:
        """Wait for a launched step and return its tokens; they also replace the PENDING
        placeholders a later plan may already have given this worker."""
        if step.error is not None:
            return StepResult(step_id=step.step_id, error=step.error)
        try:
            with torch.inference_mode():
                out = self.sampler.collect(step.copy, step.specs) if step.copy is not None else None
                timing = self._timing(step)
        except Exception as e:
            logger.exception("step %s failed", step.step_id)
            return StepResult(step_id=step.step_id, error=f"{type(e).__name__}: {e}")
        if out is None:
            self._after_step(None, step)  # a drafter reading every row reads this step's
            return StepResult(step_id=step.step_id, **timing)
        for (rid, position), token in zip(step.slots, out.token_ids):
            state = self.book.requests.get(rid)
            if state is not None and len(state.token_ids) > position:
                state.token_ids[position] = token
            elif self.draft is not None:  # the plan naming it PENDING comes later (CPU)
                self.draft.sampled[rid] = (position, token)
        if step.drafts:
            result = accept_drafts(step.step_id, [rid for rid, _ in step.slots], out.token_ids,
                                   out.logprobs, step.drafts, **timing)
        else:
            result = StepResult(step_id=step.step_id, request_ids=[rid for rid, _ in step.slots],
                                token_ids=out.token_ids, logprobs=out.logprobs, **timing)
        proposed = self._after_step(result, step)
        if proposed is not None:
            result.proposed_token_ids = proposed
        return result

    def _after_step(self, result: Optional[StepResult], step: "LaunchedStep"
                    ) -> Optional[list[list[int]]]:
        """The drafter's turn after a step: its proposals (None: none asked)."""
        if self.draft is None or not (step.proposals or step.hidden is not None):
            return None
        try:
            with torch.inference_mode():
                return self.draft.after_step(result, step, self.book.requests)
        except Exception:  # the tokens stand; the next step just has no drafts
            logger.exception("the drafter failed after step %s", step.step_id)
            return None

    def _timing(self, step: "LaunchedStep") -> dict:
        """StepResult's path and times. A device span runs from the first to the last of a
        step's kernels, gaps where the GPU waited for the host included. It is read once
        the step's tokens are on the host; a step that samples nothing is not waited for,
        and its span is reported with the next one that samples."""
        if step.span is not None:
            self._spans.append((step.path, *step.span))
        device_ms: dict[str, float] = {}
        if step.copy is not None:
            for path, start, end in self._spans:
                end.synchronize()  # at most just behind the tokens' copy
                device_ms[path] = device_ms.get(path, 0.0) + start.elapsed_time(end)
            self._spans.clear()
        return {"path": step.path, "launch_ms": step.launch_s * 1e3, "device_ms": device_ms}

    # ------------------------------------------------------------------ internals

    def _history(self, spec: SamplingSpec, prompt_ids: list[int], output_ids: list[int]
                 ) -> TokenHistory:
        return TokenHistory(spec, prompt_ids, output_ids, self.model.cfg.vocab_size)

    def _launch(self, plan: StepPlan) -> "LaunchedStep":
        entries = self.book.update(plan, lambda rid: rid in self._last_rows)
        if self.draft is not None:
            self.draft.read_plan(plan, self.book.requests)
        rows = self.book.rows(plan, entries)
        seqs, input_ids, positions = rows.seqs, rows.input_ids, rows.positions
        sample_rows, samplers = rows.sample_rows, rows.samplers
        if not seqs[0]:
            return LaunchedStep(plan.step_id)
        pending = self._pending_inputs(rows.pending_rows)
        self._start_states(seqs)
        snapshots = self._snapshot_rows(seqs, plan.state_snapshots)
        # a decode graph has no slot for a snapshot: a verify graph or the eager forward takes it
        rung = 0 if plan.state_snapshots else self._graph_rung(seqs[0], len(samplers))
        graphs = self.graphs
        if not rung:
            graphs, rung = self._verify_rung(plan, rows)
        if rung:
            keep = {"snapshots": snapshots} if graphs is not self.graphs else {}
            hidden, logits = graphs.run(seqs, input_ids, positions, rung, pending, **keep)
            # (the graph's buffer is the next step's too: a copy)
            return self._sample(plan, rows, logits, "graph", self._kept(rows, hidden.clone))
        as_decodes = self._verifies_as_decodes(plan, rows)
        meta = self.metadata(seqs, snapshots, as_decodes)
        mixed_rung = self.mixed_graphs.rung(len(input_ids)) if self.mixed_graphs else 0
        alone = kernel_policy.rows_as_alone if as_decodes else contextlib.nullcontext
        try:  # the ranks' collectives are in here
            if mixed_rung:
                hidden = self.mixed_graphs.run(input_ids, positions, meta, mixed_rung, pending)
            else:
                with alone():
                    hidden = self.model(self._device_ids(input_ids, pending),
                                        to_device(positions, self.device, torch.long),
                                        max(positions), meta, self.kv_caches)
            path = "piecewise" if mixed_rung else "eager"
            kept = self._kept(rows, hidden.clone if mixed_rung else lambda: hidden)
            if not sample_rows:
                return LaunchedStep(plan.step_id, path=path, **kept)
            if sample_rows == list(range(sample_rows[0], sample_rows[0] + len(sample_rows))):
                hidden = hidden[sample_rows[0]:sample_rows[-1] + 1]  # e.g. all decodes: no copy
            else:
                hidden = hidden.index_select(0, to_device(sample_rows, self.device))
            with alone():
                logits = self.model.compute_logits(hidden)
        except Exception as e:
            if self.tp.world > 1:  # the other ranks may be left inside a collective
                raise RankFailure(f"rank {self.rank} failed mid-forward: "
                                  f"{type(e).__name__}: {e}") from e
            raise
        return self._sample(plan, rows, logits, path, kept)

    def _kept(self, rows: StepRows, hidden: Callable[[], torch.Tensor]) -> dict:
        """What a step keeps for a drafter reading its hidden states (``hidden()``: the
        states, copied out of a graph's buffer): LaunchedStep fields."""
        if self.draft is None or not self.draft.reads_hidden:
            return {}
        return dict(hidden=hidden(), seqs=rows.seqs[0], seq_ids=rows.request_ids)

    def _start_states(self, seqs: list[list[ScheduledSeq]]) -> None:
        """Zero the state slots of requests whose computation starts at position 0."""
        for g, state in enumerate(self.state_groups):
            fresh = [s.block_ids[0] for s in seqs[g] if s.start == 0] if state else None
            if fresh:
                self.kv.start_states(g, fresh)

    def _snapshot_rows(self, seqs: list[list[ScheduledSeq]], snapshots: list[list[int]]
                       ) -> list[list[tuple[int, int]]]:
        """The plan's state snapshots per cache group, as (row, snapshot slot)."""
        return [snapshot_rows(seqs[g], snapshots, g, self.kv.num_blocks[g]) if state else []
                for g, state in enumerate(self.state_groups)]

    def metadata(self, seqs: list[list[ScheduledSeq]],
                 snapshots: Optional[list[list[tuple[int, int]]]] = None,
                 as_decodes: bool = False) -> list:
        """A step's attention metadata per KV cache group (``seqs``: each group's tables;
        ``snapshots``: each state group's, by row; ``as_decodes``: every row of the
        attention groups as a decode of its position)."""
        tables = getattr(self.backend, "kernel_tables", False)
        return [build_state_metadata(group, self.device, snapshots[g] if snapshots else ())
                if self.state_groups[g] else
                build_metadata(group, self.block_size, windows, self.device, self.kv.pad_slot(g),
                               kernel_tables=tables, rows_as_decodes=as_decodes)
                for g, (group, windows) in enumerate(zip(seqs, self.group_windows))]

    def _device_ids(self, input_ids: list[int],
                    pending: Optional[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        ids = to_device(input_ids, self.device, torch.long)
        if pending is not None:
            ids[pending[0]] = pending[1]
        return ids

    def _keep_last(self, samplers: list[tuple[str, RequestState]], tokens: torch.Tensor) -> None:
        """Keep a step's sampled tokens on the device: the next plan, made before the
        scheduler saw them, names them PENDING."""
        self._last_tokens = tokens
        self._last_rows = {rid: i for i, (rid, _state) in enumerate(samplers)}

    def _graph_rung(self, seqs: list[ScheduledSeq], num_sampling: int) -> int:
        """The captured batch size for an all-decode step whose every row samples; 0: eager."""
        if self.graphs is None or num_sampling != len(seqs):
            return 0
        if any(s.num_tokens != 1 for s in seqs):
            return 0
        return self.graphs.rung(len(seqs))

    def _verifies_as_decodes(self, plan: StepPlan, rows: StepRows) -> bool:
        """Whether an eager step verifying drafts (one past the verify graphs' rows) runs
        its rows as the verify graphs do, each with the bits of its decode step
        (verify_graphs.py): every row samples, and the attention backend can read rows as
        decodes."""
        return (bool(plan.draft_token_ids) and len(rows.samplers) == len(rows.input_ids)
                and getattr(self.backend, "rows_as_decodes", False))

    def _verify_rung(self, plan: StepPlan, rows: StepRows) -> tuple:
        """(the verify graphs, the captured batch size) for a step of decodes with drafts,
        every row sampled; (None, 0): eager."""
        if self.verify_graphs is None or not plan.draft_token_ids:
            return None, 0
        if len(rows.samplers) != len(rows.input_ids):
            return None, 0
        return self.verify_graphs.fits(rows.seqs[0])

    def _pending_inputs(self, pending_rows: list[tuple[int, str]]
                        ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(rows, tokens on the device) for the PENDING inputs: each is the token the last
        launched step sampled for its request, still on the device (no host sync)."""
        if not pending_rows:
            return None
        rows = to_device([row for row, _rid in pending_rows], self.device)
        src = to_device([self._last_rows[rid] for _row, rid in pending_rows], self.device)
        return rows, self._last_tokens.index_select(0, src)

    def _sample(self, plan: StepPlan, rows: StepRows, logits: Optional[torch.Tensor],
                path: str, kept: Optional[dict] = None) -> "LaunchedStep":
        """Sample every sample row: a draft's row at its own position (its token's)."""
        samplers = rows.samplers
        if rows.drafts and plan.next_follows:
            raise StepError("a step with drafts was planned ahead: the next plan cannot "
                            "name its accepted tokens")
        if logits is None:  # tensor parallel: only rank 0 holds the logits and samples
            if plan.next_follows:  # ...but every rank feeds them to the next plan
                self._keep_last(samplers, self.tp.broadcast_from_first(torch.empty(
                    len(samplers), dtype=torch.long, device=self.device)))
            return LaunchedStep(plan.step_id, path=path)
        specs = [state.sampling for _rid, state in samplers]
        mask = structured_token_mask(plan.structured_request_ids, plan.structured_bitmask,
                                     [rid for rid, _state in samplers])  # None: none structured
        positions = [len(state.token_ids) + offset
                     for (_rid, state), offset in zip(samplers, rows.sample_offsets)]
        tokens, tables = self.sampler.draw(logits, specs, positions, row_histories(rows), mask)
        if plan.next_follows:
            self._keep_last(samplers, self.tp.broadcast_from_first(tokens))
        return LaunchedStep(plan.step_id, self.sampler.to_host(tokens, tables), specs,
                            [(rid, p) for (rid, _state), p in zip(samplers, positions)],
                            drafts=rows.drafts, proposals=self._proposals(plan), path=path,
                            **(kept or {}))

    def _proposals(self, plan: StepPlan) -> Optional[dict[str, int]]:
        """Request -> the drafts the plan asks the drafter to propose after the step."""
        if not plan.propose_token_counts:
            return None
        ids = [r.request_id for r in plan.new_requests] + [r.request_id
                                                          for r in plan.cached_requests]
        if self.draft is None or len(ids) != len(plan.propose_token_counts):
            raise StepError("propose_token_counts for a worker without a drafter, or "
                            "not one per request")
        return {rid: n for rid, n in zip(ids, plan.propose_token_counts) if n > 0}


def proposer_for(runner: ModelRunner, info: ModelInfo, args: EngineArgs):
    """The worker's drafter: a draft model, the checkpoint's MTP layer, or None (the
    scheduler's drafters, or no speculation)."""
    if args.speculative_method == "mtp":
        return MTPProposer(runner, args)
    return draft_model(runner, info, args)
