"""The draft model of ``speculative_method="draft"``: a smaller model of the target's
vocabulary that the worker runs beside it to propose each request's next drafts.

Its KV cache is a pool of its own with the target's first group's block count, read
through the target's block tables (the scheduler gives a request blocks for the
positions the proposing writes: ``Scheduler._ask_proposals``), so it needs no tables of
its own. When a step's result is known, ``propose`` brings the draft model's KV up to the
request's tokens (the positions it has not computed, or computed for other tokens: a
rejected proposal, a prompt it never saw) in one forward, then proposes one token at a
time, each fed back. What it computed for its own proposals is kept and reused where the
target accepted them.

A draft is sampled as the target samples its position: greedy for greedy requests, else
with the request's temperature and cuts and the same per-(seed, position) uniform (an
unseeded request gets a seed of its own at arrival: ``coupled``), so a draft model that
agrees with the target proposes the very token the target will draw. Acceptance is by
token match (``step_rows.accept_drafts``): the text never depends on the drafts, and a
seeded request's is the text without speculation. Penalties, bias and grammars are the
target's to apply; drafts ignore them.
"""

from __future__ import annotations

import logging
from typing import Optional

import msgspec
import numpy as np
import torch

from pocketllm.config import EngineArgs
from pocketllm.errors import UnsupportedFeatureError
from pocketllm.model_info import ModelInfo
from pocketllm.proto.messages import SamplingSpec, StepResult

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
        # request -> (positions below it computed for its tokens, the proposals computed
        # after them: valid where the target accepted them)
        self._done: dict[str, tuple[int, list[int]]] = {}
        self.info = info

    def allocate(self, num_blocks: int, max_model_len: int) -> None:
        """The pool, once the target's first group has its block count."""
        layout = cache_layout([None] * self.num_layers, max_model_len)
        self.kv = PagedKVCache(layout, [num_blocks], self.block_size, self.kv_heads,
                               self.head_dim, self.dtype, self.device)
        self.pad_slot = self.kv.pad_slot(0)

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
        sampling, how many drafts) -> the drafts of each."""
        runs = []
        for rid, tokens, table, spec, count in wanted:
            count = min(count, len(table) * self.block_size - len(tokens) + 1)  # its blocks
            if count > 0:
                runs.append((rid, tokens, table, msgspec.structs.replace(spec, logprobs=None),
                             count, self._catch_up(rid, tokens, table)))
        if not runs:
            return {}
        # first: each request's uncomputed tokens, sampled after its last
        feeds = [(tokens[start:], start) for _rid, tokens, _t, _s, _c, start in runs]
        drafts: list[list[int]] = [[] for _ in runs]
        active = list(range(len(runs)))
        while active:
            out = self._step([(runs[i][2], *feeds[i]) for i in active],
                             [runs[i][3] for i in active],
                             [len(runs[i][1]) + len(drafts[i]) for i in active])
            for i, token in zip(active, out):
                drafts[i].append(token)
                feeds[i] = ([token], len(runs[i][1]) + len(drafts[i]) - 1)
            active = [i for i in active if len(drafts[i]) < runs[i][4]]
        for (rid, tokens, *_), d in zip(runs, drafts):
            self._done[rid] = (len(tokens), d[:-1])  # the last one was never fed
        return {run[0]: d for run, d in zip(runs, drafts)}

    def _catch_up(self, rid: str, tokens: list[int], table: list[int]) -> int:
        """Compute all but the last ``max_tokens`` uncomputed tokens of a long catch-up
        (a prompt) in chunks of their own; -> where ``propose``'s first forward starts."""
        start = self._computed(rid, tokens)
        while len(tokens) - start > self.max_tokens:
            self._forward([(table, tokens[start:start + self.max_tokens], start)], [])
            start += self.max_tokens
        return start

    def _step(self, feeds: list[tuple[list[int], list[int], int]], specs: list[SamplingSpec],
              positions: list[int]) -> list[int]:
        """One forward over each request's fed tokens; the token sampled after each's last
        (``positions``: the positions those tokens take)."""
        last, at = [], 0
        for _table, ids, _start in feeds:
            at += len(ids)
            last.append(at - 1)
        logits = self._forward(feeds, last)
        tokens, _ = self.sampler.draw(logits, specs, positions)
        return tokens.tolist()

    def _forward(self, feeds: list[tuple[list[int], list[int], int]], sample_rows: list[int]
                 ) -> Optional[torch.Tensor]:
        """``feeds``: (block table, tokens, first position) per request -> logits of
        ``sample_rows`` (None when none)."""
        seqs, ids, positions = [], [], []
        for table, tokens, start in feeds:
            seqs.append(ScheduledSeq(table, start, len(tokens), len(ids)))
            ids += tokens
            positions += range(start, start + len(tokens))
        meta = build_metadata(seqs, self.block_size, [None], self.device, self.pad_slot,
                              kernel_tables=getattr(self.backend, "kernel_tables", False))
        hidden = self.model(to_device(ids, self.device, torch.long),
                            to_device(positions, self.device, torch.long), max(positions),
                            [meta], self.kv.layer_caches)
        if not sample_rows:
            return None
        return self.model.compute_logits(hidden.index_select(0, to_device(sample_rows,
                                                                           self.device)))


def draft_model(runner, info: ModelInfo, args: EngineArgs) -> Optional[DraftModel]:
    """The runner's draft model (None: speculation is not "draft"), loaded as the target
    is (its load format, dtype and device; ``model_info.draft_model_info`` resolved it)."""
    if args.speculative_method != "draft":
        return None
    if info.draft is None:
        raise UnsupportedFeatureError("speculative_method='draft' without the draft model's "
                                      "info (load_model_info resolves it)", "speculative_model")
    import dataclasses

    draft_args = dataclasses.replace(args, model=args.speculative_model, quantization=None,
                                     speculative_method=None, speculative_model=None)
    draft = DraftModel(runner, ModelInfo(**info.draft), draft_args)
    logger.info("draft model %s (%s, %d layers) proposes up to %d tokens a step",
                info.draft["path"], info.draft["architecture"], draft.num_layers,
                args.num_speculative_tokens)
    return draft
