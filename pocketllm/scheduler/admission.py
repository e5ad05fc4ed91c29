"""Admitting waiting requests into a step (first come, first served across clients:
fair_queue.py), with their cached prefix. ``Scheduler`` (scheduler.py) mixes this in; it
uses its state (``config``, ``kv``, ``waiting``, ``running``, ``structured``, ``clock``,
the prefix-cache counters)."""

from __future__ import annotations

import itertools

from .block_manager import blocks_for
from .config import StepDraft
from .request import Request, RequestStatus


class Admission:
    def _hold_admission(self, step: StepDraft) -> bool:
        """Whether to keep the waiting requests out of a decode-only step for now: until
        the prompts that free slots can take fill the step's budget, or the oldest has
        waited admission_delay_s."""
        if self.config.admission_delay_s <= 0 or not step.scheduled or step.has_prefill:
            return False  # nothing to disturb, or the step runs eagerly anyway
        admissible_tokens = 0
        for req in itertools.islice(self.waiting, self.config.max_num_seqs - len(self.running)):
            admissible_tokens += req.num_tokens
            if admissible_tokens >= step.budget:
                return False
        return self.clock() - self.waiting[0].queued_at < self.config.admission_delay_s

    def _admit_waiting(self, step: StepDraft) -> None:
        cfg, kv = self.config, self.kv
        if self.waiting and self._hold_admission(step):
            return
        while self.waiting and step.budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.structured.next_admissible(self.waiting)
            if req is None:
                break
            matched = self._match_prefix(req)  # a table per group
            hit = len(matched[0])
            num_computed = hit * cfg.block_size
            remaining = req.num_tokens - num_computed
            if cfg.enable_chunked_prefill:
                n = min(remaining, step.budget)
            elif remaining <= step.budget:
                n = remaining
            elif remaining > cfg.max_num_batched_tokens and not step.has_prefill:
                n = remaining  # can never fit the budget: run it whole, as the step's only prefill
            else:
                break
            need = blocks_for(num_computed + n, cfg.block_size) - hit
            if not kv.can_admit(matched, need):
                break  # FCFS: later requests wait behind it
            self.waiting.remove(req)
            self.waiting.admitted(req)
            kv.admit(req, matched, need)
            req.num_computed_tokens = req.num_verified_tokens = num_computed
            req.num_cached_blocks = hit
            if cfg.enable_prefix_caching:
                self.prefix_cache_queries += req.num_tokens
                self.prefix_cache_hits += num_computed
            if req.num_cached_tokens is None:
                req.num_cached_tokens = num_computed
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            step.add(req, n)

    def _match_prefix(self, req: Request) -> list[list[int]]:
        if not self.config.enable_prefix_caching:
            return self.kv.empty_tables()
        bs = self.config.block_size
        req.update_block_hashes(bs)
        # Leave at least one token to compute: the step must produce logits to sample.
        hashes = req.block_hashes[:(req.num_tokens - 1) // bs]
        tables = self.kv.match_prefix(hashes)
        if self.kv.has_state:  # where a snapshot would have made the hit longer
            req.snapshot_hint = self.kv.positional_match(hashes) * bs
        return tables
