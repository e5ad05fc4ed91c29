"""What a step plan means on the host, for both runners (``runner.py`` and ``lite/runner.py``):
the requests a worker knows (tokens, block tables, sampling), kept up to date plan by plan,
and a plan's rows (which tokens at which positions, which rows sample). No torch here.

The runner never appends the tokens it samples: the next plan's ``new_token_ids`` carries
them, so every rank holds the same state.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from pocketllm.proto.messages import NULL_BLOCK, PENDING, SamplingSpec, StepPlan, StepResult
from pocketllm.sampling import uses_penalties


class StepError(RuntimeError):
    """A plan this runner cannot execute (unknown request, out-of-range blocks...)."""


@dataclass
class ScheduledSeq:
    """One sequence's share of a step, as the runner knows it on the host."""

    block_ids: Sequence[int]
    start: int  # first position computed this step (tokens before it are in the cache)
    num_tokens: int  # positions start .. start + num_tokens - 1
    row: int  # index of its first token in the flattened batch


@dataclass
class RequestState:
    token_ids: list[int]
    block_ids: list[list[int]]  # a table per KV cache group
    sampling: SamplingSpec
    history: Any = None  # only for requests with penalties or logit_bias (the sampler's)
    # per sliding group: leading table entries pointed at the pad block (behind the window)
    padded: Optional[list[int]] = None


@dataclass
class StepRows:
    """A plan's rows: ``seqs`` per KV cache group (the same sequences, each group's table)."""

    seqs: list[list[ScheduledSeq]]
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    samplers: list[tuple[str, RequestState]] = field(default_factory=list)  # per sample row
    # per sample row: how many draft tokens precede it after the request's known tokens
    # (its token takes position len(token_ids) + offset); 0 but for speculative steps
    sample_offsets: list[int] = field(default_factory=list)
    drafts: dict[str, list[int]] = field(default_factory=dict)  # request -> its drafts
    pending_rows: list[tuple[int, str]] = field(default_factory=list)  # (row, request)
    request_ids: list[str] = field(default_factory=list)  # per sequence


class RequestBook:
    """The requests a worker knows. ``make_history(spec, prompt_ids, output_ids)`` builds
    a penalised request's history (the sampler's own ``TokenHistory``)."""

    def __init__(self, num_blocks: Sequence[int], pad_blocks: Sequence[int],
                 slide_windows: Sequence[Optional[int]], block_size: int, max_num_seqs: int,
                 make_history: Callable[[SamplingSpec, list[int], list[int]], Any],
                 state_groups: Sequence[bool] = ()):
        """``state_groups[g]``: group g holds a recurrent-state slot per request, not blocks
        of positions (its table is that one slot)."""
        self.num_blocks, self.pad_blocks = list(num_blocks), list(pad_blocks)
        self.positional = [not s for s in state_groups] or [True] * len(self.num_blocks)
        self.slide_windows = list(slide_windows)  # per group: its window, None if full
        self.block_size, self.max_num_seqs = block_size, max_num_seqs
        self.make_history = make_history
        self.requests: dict[str, RequestState] = {}
        # Prompt lengths of dropped requests whose output counts matter: a preempted one
        # comes back as a NewRequestData holding prompt + output with no boundary. FIFO-capped;
        # the scheduler readmits a preempted request before any newer one, so it stays found.
        self._dropped_prompt_lens: collections.OrderedDict[str, int] = collections.OrderedDict()

    def update(self, plan: StepPlan, pending_ok: Callable[[str], bool]
               ) -> list[tuple[str, RequestState, int]]:
        """Apply a plan's new, cached and finished requests: (id, state, first position
        computed) per scheduled request. ``pending_ok(rid)``: a PENDING token of that
        request can be resolved (its last step's token is still held)."""
        for rid in plan.finished_request_ids:
            self.drop(rid)
        entries = []
        for new in plan.new_requests:  # new, or back after preemption: replaces any old state
            self.check_blocks(new.request_id, new.block_ids)
            if any(len(t) != 1 for t, p in zip(new.block_ids, self.positional) if not p):
                raise StepError(f"request {new.request_id!r}: a state group's table must be "
                                "one slot")
            state = RequestState(list(new.token_ids), self.tables(new.block_ids), new.sampling,
                                 padded=[0] * len(new.block_ids))
            if uses_penalties(new.sampling):
                prompt_len = self._dropped_prompt_lens.pop(new.request_id, len(new.token_ids))
                state.history = self.make_history(new.sampling, new.token_ids[:prompt_len],
                                                  new.token_ids[prompt_len:])
            self.requests[new.request_id] = state
            entries.append((new.request_id, state, new.num_computed_tokens))
        for cached in plan.cached_requests:
            state = self.requests.get(cached.request_id)
            if state is None:
                raise StepError(f"request {cached.request_id!r} is not known to this worker")
            self.check_blocks(cached.request_id, cached.new_block_ids)
            if PENDING in cached.new_token_ids and (
                    state.history is not None or cached.new_token_ids[-1] != PENDING
                    or not pending_ok(cached.request_id)):
                raise StepError(f"request {cached.request_id!r}: a PENDING token this worker "
                                "cannot resolve")
            state.token_ids.extend(cached.new_token_ids)
            for table, more in zip(state.block_ids, self.tables(cached.new_block_ids)):
                table.extend(more)
            if state.history is not None:
                state.history.add_output(cached.new_token_ids)
            entries.append((cached.request_id, state, cached.num_computed_tokens))
        if len(plan.num_scheduled_tokens) != len(entries):
            raise StepError(f"num_scheduled_tokens has {len(plan.num_scheduled_tokens)} entries "
                            f"for {len(entries)} requests")
        return entries

    def drop(self, rid: str) -> None:
        state = self.requests.pop(rid, None)
        if state is not None and state.history is not None and (
                state.sampling.frequency_penalty != 0.0 or state.sampling.presence_penalty != 0.0):
            self._dropped_prompt_lens[rid] = state.history.prompt_len
            while len(self._dropped_prompt_lens) > 4 * self.max_num_seqs + 64:
                self._dropped_prompt_lens.popitem(last=False)

    def check_blocks(self, rid: str, tables: list[list[int]]) -> None:
        if len(tables) != len(self.num_blocks):
            raise StepError(f"request {rid!r}: {len(tables)} block tables for "
                            f"{len(self.num_blocks)} KV cache groups")
        for g, (table, n) in enumerate(zip(tables, self.num_blocks)):
            if not self.positional[g] and len(table) > 1:
                raise StepError(f"request {rid!r}: {len(table)} slots in state group {g}")
            real = [b for b in table if b != NULL_BLOCK]
            if real and not (0 <= min(real) and max(real) < n):
                raise StepError(f"request {rid!r}: block ids of group {g} outside [0, {n})")

    def tables(self, tables: list[list[int]]) -> list[list[int]]:
        """Block tables as the kernels read them: a NULL entry (no block) is the pad block."""
        return [[pad if b == NULL_BLOCK else b for b in table]
                for table, pad in zip(tables, self.pad_blocks)]

    def behind_window(self, state: RequestState, start: int) -> None:
        """Point each sliding table's entries wholly behind the window of a chunk computed
        from ``start`` at the pad block: the scheduler may have freed their blocks to
        another request, and a kernel's key tile may start a little before the window."""
        for g, window in enumerate(self.slide_windows):
            if window is None:
                continue
            end = max(0, start - window + 1) // self.block_size
            table, pad = state.block_ids[g], self.pad_blocks[g]
            for i in range(state.padded[g], end):
                table[i] = pad
            state.padded[g] = max(state.padded[g], end)

    def rows(self, plan: StepPlan, entries: list[tuple[str, RequestState, int]]) -> StepRows:
        """The plan's rows, in its order; checked against what each request holds. A
        request's drafts (``plan.draft_token_ids``) follow its last known token, each
        position sampled."""
        out = StepRows([[] for _ in self.num_blocks])
        drafts_of = plan.draft_token_ids or [[]] * len(entries)
        if len(drafts_of) != len(entries):
            raise StepError(f"draft_token_ids has {len(drafts_of)} entries for "
                            f"{len(entries)} requests")
        for (rid, state, start), n, drafts in zip(entries, plan.num_scheduled_tokens, drafts_of):
            if n == 0:
                continue
            end = start + n - len(drafts)  # the known tokens' end
            if start < 0 or end <= start or end > len(state.token_ids):
                raise StepError(f"request {rid!r}: tokens [{start}, {end}) scheduled but only "
                                f"{len(state.token_ids)} known")
            if drafts and end != len(state.token_ids):
                raise StepError(f"request {rid!r}: drafts follow its last known token")
            if any(start + n > len(table) * self.block_size
                   for table, positional in zip(state.block_ids, self.positional) if positional):
                raise StepError(f"request {rid!r}: {start + n} tokens need more than its "
                                f"{min(map(len, state.block_ids))} blocks")
            self.behind_window(state, start)
            for group, table in zip(out.seqs, state.block_ids):
                group.append(ScheduledSeq(table, start, n, len(out.input_ids)))
            out.request_ids.append(rid)
            out.input_ids.extend(state.token_ids[start:end])
            if state.token_ids[end - 1] == PENDING:  # only a step's last input can be pending
                out.pending_rows.append((len(out.input_ids) - 1, rid))
            last = len(out.input_ids) - 1
            out.input_ids.extend(drafts)
            out.positions.extend(range(start, start + n))
            if drafts:
                out.drafts[rid] = list(drafts)
            if end == len(state.token_ids):
                for offset in range(len(drafts) + 1):
                    out.sample_rows.append(last + offset)
                    out.samplers.append((rid, state))
                    out.sample_offsets.append(offset)
        return out


def check_state_plan(plan: StepPlan, state_groups: Sequence[bool],
                     num_blocks: Sequence[int]) -> None:
    """A plan's state copies and snapshots name state groups, and its copies slots of
    them (``snapshot_rows`` checks the snapshots' slots against the step)."""
    for entry in list(plan.state_copies_before) + list(plan.state_snapshots):
        group = entry[0]
        if not (0 <= group < len(state_groups) and state_groups[group]):
            raise StepError(f"a state copy or snapshot in cache group {group}, not a state group")
    for group, src, dst in plan.state_copies_before:
        if not all(0 <= s < num_blocks[group] for s in (src, dst)):
            raise StepError(f"state slots {src} -> {dst} outside [0, {num_blocks[group]})")


def snapshot_rows(seqs: Sequence[ScheduledSeq], snapshots: Sequence[Sequence[int]],
                  group: int, num_slots: int) -> list[tuple[int, int]]:
    """A plan's ``state_snapshots`` of state group ``group`` (its view of the step:
    ``seqs``, each table one slot) as (row, snapshot slot): the row after which the
    sequence's state is the one the snapshot keeps."""
    by_slot = {s.block_ids[0]: s for s in seqs}
    out = []
    for g, slot, snapshot, position in snapshots:
        if g != group:
            continue
        s = by_slot.get(slot)
        if s is None or not s.start < position <= s.start + s.num_tokens:
            raise StepError(f"a state snapshot at position {position} of slot {slot}, which "
                            "computes no such position in this step")
        if not 0 <= snapshot < num_slots or snapshot == slot:
            raise StepError(f"a state snapshot into slot {snapshot}, outside [0, {num_slots}) "
                            "or its own")
        out.append((s.row + position - s.start - 1, snapshot))
    return out


def row_histories(rows: StepRows) -> Optional[list]:
    """Each sample row's penalty history (None: no row has one): a draft's row counts the
    drafts before it as generated, as decoding them one by one would have."""
    out = []
    for (rid, state), offset in zip(rows.samplers, rows.sample_offsets):
        history = state.history
        if history is not None and offset:
            history = history.extended(rows.drafts[rid][:offset])
        out.append(history)
    return out if any(h is not None for h in out) else None


def accept_drafts(step_id: int, row_ids: list[str], tokens: list[int], logprobs: list,
                  drafts: dict[str, list[int]], **result) -> StepResult:
    """The step's result from its sample rows (``row_ids``: each row's request; a request
    with k drafts has k + 1 rows in a run): each request's first token, and for one with
    drafts the drafts accepted after it, each accepted while the token sampled at the
    position before equals it, then the token sampled after the last accepted one.
    ``result``: StepResult's other fields (path, times)."""
    ids, firsts, first_lps, extras, extra_lps = [], [], [], [], []
    i = 0
    while i < len(row_ids):
        rid, d = row_ids[i], drafts.get(row_ids[i], [])
        got = tokens[i:i + len(d) + 1]
        accepted = 0
        while accepted < len(d) and got[accepted] == d[accepted]:
            accepted += 1
        lps = logprobs[i:i + accepted + 1] if logprobs else [None] * (accepted + 1)
        ids.append(rid)
        firsts.append(got[0])
        first_lps.append(lps[0])
        extras.append(got[1:accepted + 1])
        extra_lps.append(lps[1:accepted + 1])
        i += len(d) + 1
    spec = bool(drafts)
    return StepResult(step_id=step_id, request_ids=ids, token_ids=firsts,
                      logprobs=first_lps if logprobs else [],
                      extra_token_ids=extras if spec else [],
                      extra_logprobs=extra_lps if spec and logprobs else [], **result)
