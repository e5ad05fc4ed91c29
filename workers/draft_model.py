"""The draft model of ``speculative_method="draft"``: a smaller model of the target's
vocabulary that the worker runs beside it to propose each request's next drafts (its
pool and its sampling: ``proposer.py``).

When a step's result is known, ``propose`` brings the draft model's KV up to the
request's tokens (the positions it has not computed, or computed for other tokens: a
rejected proposal, a prompt it never saw), then proposes one token at a time, each fed
back: one row a request a forward (on a GPU a decode CUDA graph of its own), a prompt
first in multi-row forwards. What it computed for its own proposals is kept and reused
where the target accepted them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from pocketllm.config import EngineArgs
from pocketllm.errors import UnsupportedFeatureError
from pocketllm.model_info import ModelInfo
from pocketllm.proto.messages import SamplingSpec, StepResult

from .device import to_device
from .loader import load_model_weights
from .proposer import Proposer, verified_tokens
from .step_rows import ScheduledSeq

logger = logging.getLogger("pocketllm.worker")


class DraftModel(Proposer):
    def __init__(self, runner, info: ModelInfo, args: EngineArgs):
        """``runner``: the target's (its device, dtype, kernel policy and model builder)."""
        if runner.tp.world != 1:
            raise UnsupportedFeatureError("a draft model runs at tensor-parallel size 1",
                                          "speculative_model")
        backend = runner.policy.attention_backend()
        with torch.inference_mode():
            model = runner.build(info, args, backend)
            load_model_weights(model, info, args)
        model.eval()
        cfg = model.cfg
        why = ("sliding-window layers" if any(w is not None for w in cfg.layer_windows)
               else "linear-attention layers" if any(cfg.linear_layers)
               else "latent attention (MLA)" if model.latent_cache_width is not None
               else None)
        if why:
            raise UnsupportedFeatureError(f"the draft model {info.path!r} has {why}; a draft "
                                          "model must be of full attention only", "speculative_model")
        super().__init__(runner, args, backend, cfg.num_layers, model.num_local_kv_heads,
                         cfg.head_dim)
        self.model = model
        self.graphs = None  # decode CUDA graphs (``capture``)
        # request -> (positions below it computed for its tokens, the proposals computed
        # after them: valid where the target accepted them)
        self._done: dict[str, tuple[int, list[int]]] = {}

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

    def after_step(self, result: Optional[StepResult], step, requests: dict
                   ) -> Optional[list[list[int]]]:
        if result is None or not step.proposals:
            return None
        tokens_of = verified_tokens(result, step.slots, requests)
        wanted = [(rid, tokens_of[rid], requests[rid].block_ids[0], requests[rid].sampling,
                   step.proposals[rid])
                  for rid in result.request_ids if step.proposals.get(rid) and rid in tokens_of]
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
                runs.append(_Run(rid, table, spec, count, tokens[start:], start))
        active = runs
        while active:
            sampling = [r for r in active if len(r.queue) == 1]
            logits = self._step(active, [i for i, r in enumerate(active) if len(r.queue) == 1])
            tokens = []
            if sampling:
                tokens = self.draw(logits, [r.spec for r in sampling],
                                   [r.position + 1 for r in sampling])
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
            _, logits = self.graphs.run([seqs], ids, positions, rung)
            return logits.index_select(0, to_device(sample_rows, self.device)) if sample_rows else None
        return self._forward(seqs, ids, sample_rows)

    def _forward(self, seqs: list[ScheduledSeq], ids: list[int], sample_rows: list[int]
                 ) -> Optional[torch.Tensor]:
        """An eager forward of ``seqs`` (their tokens ``ids``, in order) -> the logits of
        ``sample_rows`` (None when none)."""
        positions = [p for s in seqs for p in range(s.start, s.start + s.num_tokens)]
        hidden = self.model(self.ids(ids), self.ids(positions), max(positions),
                            [self.metadata(seqs)], self.kv.layer_caches)
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
    draft_args = args.without_speculation(model=args.speculative_model, quantization=None)
    draft = DraftModel(runner, ModelInfo(**info.draft), draft_args)
    logger.info("draft model %s (%s, %d layers) proposes up to %d tokens a step",
                info.draft["path"], info.draft["architecture"], draft.num_layers,
                args.num_speculative_tokens)
    return draft
