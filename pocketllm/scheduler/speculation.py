"""The scheduler's speculative decoding (docs/speculative.md): a step's drafts, the
proposals it asks of the worker's drafter, and a speculative result's further tokens.

With ``SchedulerConfig.num_speculative_tokens`` (a drafter of drafter.py proposes) a
decode may bring draft tokens to its step, computed at the positions after its last token
and counted in the budget, with blocks for them; the result returns the drafts the worker
accepted and the token after them; the rejected positions are computed again as the
request reaches them (their blocks stay with it, never published before then). Requests
with a grammar, penalties or logit_bias draft too: each draft's row gets the mask and counts
of the drafts before it (docs/speculative.md). Drafts need the request's last token, so a
step that may draft is never planned ahead (one whose every request has paused drafting
is: drafter.py).

``Scheduler`` (scheduler.py) mixes these in; they use its state (``config``, ``kv``,
``drafter``, ``running``, ``_inflight``) and helpers (``_after_token``,
``_cache_full_blocks``)."""

from __future__ import annotations

from typing import Optional

from pocketllm.proto.messages import StepPlan, StepResult, TokenBatch

from .config import SchedulerConfig, StepDraft
from .drafter import Drafter
from .ngram import NgramDrafter
from .replay import ReplayDrafter, load_runs
from .request import Request
from .worker_drafts import WorkerDrafter


class SpeculativeSteps:
    def _add_drafts(self, step: StepDraft) -> None:
        """Drafts for a step of decodes alone, once it is decided: when speculation is on,
        no step is in flight (a draft follows the request's last token, which must be
        known), the running batch is small enough to gain from more tokens a request
        rather than more requests, and within the rows the worker computes exactly as
        alone (``speculative_max_rows``), the budget and the blocks free now (drafts never
        preempt)."""
        cfg = self.config
        if self.drafter is not None and self._inflight:  # planned ahead: every one paused
            for req in step.scheduled:
                self.drafter.skip(req.request_id)
            return
        if (self.drafter is None or step.has_prefill
                or len(self.running) > cfg.speculative_max_batch):
            return
        rows = cfg.speculative_max_rows or cfg.max_num_batched_tokens
        room = min(rows - sum(step.scheduled.values()), step.budget)
        for req in list(step.scheduled):
            if room <= 0:
                return
            drafts = self._drafts(req, room)[:max(0, self.kv.fit_tokens(req) - 1)]
            if drafts and self.kv.has_state:  # each row's state kept, to roll back to
                drafts = drafts[:self.kv.spare_state_slots()]
                if drafts:
                    step.draft_snapshots[req] = self.kv.draft_snapshots(req, len(drafts))
            if drafts:
                self.kv.grow(req, req.num_computed_tokens + 1 + len(drafts))
                step.scheduled[req] += len(drafts)
                step.budget -= len(drafts)
                step.drafts[req] = drafts
                room -= len(drafts)

    def _ask_proposals(self, step: StepDraft) -> None:
        """Ask the worker's drafter (``worker_drafts.py``) for the drafts of each request's
        next step, when that step may draft: as many as that step will carry (k times the
        request's recent acceptance: ``Drafter.length``) a decoding request that is not
        paused, each given its block now (the proposing writes the draft model's KV at the
        positions after the request's tokens; the next step computes them there). Not
        after a prompt's last chunk: its first token would wait for the draft model to
        read the whole prompt."""
        cfg, drafter = self.config, self.drafter
        if (drafter is None or not drafter.in_worker or self._inflight
                or len(self.running) > cfg.speculative_max_batch):
            return
        for req, n in step.scheduled.items():
            own = n - len(step.drafts.get(req, ()))
            if (own != 1 or req.num_computed_tokens + 1 != req.num_tokens
                    or drafter.paused(req.request_id)):
                continue
            count = min(drafter.length(req.request_id), self.kv.fit_tokens(req) - n,
                        cfg.max_model_len - req.num_computed_tokens - n)
            if count > 0:
                self.kv.grow(req, req.num_computed_tokens + n + count)
                step.proposals[req] = count

    def _drafts(self, req: Request, room: int) -> list[int]:
        """The draft tokens a decoding request may verify (at most ``room``): none when no
        room is left (max_tokens, max_model_len); with a grammar, those it allows in turn
        (each draft's row then gets the grammar's mask after the drafts before it, and the
        worker's penalties count those drafts: docs/speculative.md)."""
        room = min(req.sampling.max_tokens - req.num_output_tokens - 1,
                   self.config.max_model_len - req.num_tokens - 1, room)
        if room <= 0:
            return []
        drafts = self.drafter.propose(req.request_id, req.token_ids, room)
        return req.grammar.allowed_prefix(drafts) if req.grammar is not None and drafts else drafts

    def _end_draft_snapshots(self, plan: StepPlan, result: StepResult) -> None:
        """Roll each request of a recurrent-state model back to the state after its last
        accepted draft (or free the slots: a failed step, a finished request)."""
        index = {rid: i for i, rid in enumerate(result.request_ids)}
        for req, held in self._draft_snapshots.pop(plan.step_id, {}).items():
            i = index.get(req.request_id)
            ok = result.error is None and i is not None and not req.is_finished
            extra = result.extra_token_ids[i] if ok and i < len(result.extra_token_ids) else []
            self.kv.end_draft_snapshots(req, held, len(extra) if ok else None)

    def _after_drafts(self, batch: TokenBatch, req: Request, drafts: list[int], first: int,
                      result: StepResult, i: int) -> None:
        """A speculative step's further tokens: each accepted draft's position is computed,
        and the token after it joins as if decoded alone (a stop, EOS or max_tokens among
        them ends the request there). The blocks of rejected positions stay with the
        request (the worker's tables only grow): its next tokens fill them."""
        extra = result.extra_token_ids[i] if i < len(result.extra_token_ids) else []
        logprobs = result.extra_logprobs[i] if i < len(result.extra_logprobs) else []
        if [first, *extra][:len(extra)] != drafts[:len(extra)] or len(extra) > len(drafts):
            raise ValueError(f"the worker accepted {len(extra)} of drafts {drafts} but "
                             f"returned {[first, *extra]}")
        self.spec_draft_tokens += len(drafts)
        self.spec_accepted_tokens += len(extra)
        self.drafter.verified(req.request_id, len(drafts), len(extra))
        for j, token in enumerate(extra):
            if req.is_finished:
                return
            req.num_computed_tokens += 1  # the accepted draft's position
            req.num_verified_tokens += 1
            req.token_ids.append(token)
            self._cache_full_blocks(req)
            self._after_token(batch, req, token, logprobs[j] if j < len(logprobs) else None)


    def _blocks_ahead(self) -> int:
        """The most positions past its computed ones a running request holds blocks for: a
        step's drafts, and with the worker's drafter the proposals written after them."""
        k = self.config.num_speculative_tokens
        return 2 * k if self.drafter is not None and self.drafter.in_worker else k


def drafter_for(config: SchedulerConfig) -> Optional[Drafter]:
    """The drafter of the worker's speculative method (None: no speculation)."""
    k = config.num_speculative_tokens
    if not k:
        return None
    replay = (ReplayDrafter(k, load_runs(config.speculative_replay))
              if config.speculative_replay else None)
    if config.speculative_method == "replay":
        return replay
    if config.speculative_method in ("draft", "mtp"):
        return WorkerDrafter(k, replay)
    return NgramDrafter(k)
