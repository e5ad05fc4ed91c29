"""The KV cache groups the worker declared: one block pool and one block table per
request for each ``CacheSpec`` (``WorkerCapabilities.cache_groups``).

Every group's table of a request has the same length, one entry per ``block_size``
positions computed, so one position is in the same table entry in every group. What
differs is which entries hold a block:

- a full-attention group holds every entry from position 0; so does an MLA group
  (``kind="mla"``: one compressed latent per position, in a pool of its own width; the
  scheduler's rules are full attention's);
- a sliding-window group (window ``w``) needs only the entries covering the last ``w``
  positions a query can read. When a chunk is scheduled from position ``s``, the entries
  wholly before position ``s - w + 1`` are freed back to the group's pool and become
  ``NULL_BLOCK``: a decoding sequence holds at most ``ceil(w / block_size) + 1`` blocks
  there. With prefix caching a block is freed only once it is published (its step's
  result arrived), so it stays reusable as a cached prefix block; with overlapped
  scheduling that keeps the blocks of the one step in flight a step longer.

A recurrent-state group (``kind="state"``: Gated DeltaNet's layers) holds no positions: a
request's table there is one entry, a slot of the group's pool holding its recurrent and
conv states, taken at admission and freed with the request (preemption frees it, and the
recompute rebuilds the state from position 0). The worker starts a slot from zeros when a
request's first chunk starts at position 0. The positional groups alone decide how many
blocks a request holds, what fits and the tables' length (``positional``).

With prefix caching, a state group's pool also keeps **snapshots**: copies of a request's
state at block boundaries of its prompt (``snapshots_in``): at every
``STATE_SNAPSHOT_TOKENS``-th position, at its last block boundary, where a chunk ends on
one, and where its match in the KV prefix cache ended beyond any snapshot (an earlier
prompt shared its tokens up to there: the next one resumes there), taken by the worker
inside the step that computes that position (a chunk is never cut for one: a cut would
cost a second pass over the weights). So a repeated system prompt resumes at the last
multiple of ``STATE_SNAPSHOT_TOKENS`` inside it, and from its third use at the last block
boundary inside it, and a conversation's next turn at the end of the previous turn's
prompt. Snapshots are published under that block's chained hash once the step succeeded
(``publish_snapshot``) and then evictable like any cached block, least recently used
first. A prefix hit of ``k`` blocks needs, besides the positional groups' blocks, a
snapshot at block ``k``'s boundary (a fresh slot would compute the rest from zeros, the
trap that cost one deployment its GSM8K score); the hit shrinks until one exists. The
request then gets a slot of its own and a copy of the snapshot into it before its first
step (``state_restores``, sent in the plan's ``state_copies_before``).

Prefix caching is per group (each pool keys its blocks by the same chained hashes). A hit
of ``k`` blocks (the next token computed is at position ``k * block_size``) is usable when
every full group caches blocks ``0 .. k-1`` and every sliding group caches the blocks
from the one holding position ``k * block_size - w + 1`` to ``k-1``, the ones its first
query reads. Otherwise the hit shrinks until it is usable (possibly to none): blocks a
sliding group freed long ago may have been evicted while the full group kept them.
"""

from __future__ import annotations

from typing import Optional, Sequence

from pocketllm.errors import UnsupportedFeatureError
from pocketllm.proto.messages import NULL_BLOCK, CacheGroup, CacheSpec

from .block_manager import BlockManager, blocks_for

SUPPORTED_KINDS = ("full", "sliding", "mla", "state")

# With a recurrent state and prefix caching, prompts stop a chunk (and leave a state
# snapshot) every this many tokens: finer points of resumption cost more steps and slots
STATE_SNAPSHOT_TOKENS = 1024


class GroupRule:
    """Which table entries one group needs: the block rules of its ``CacheSpec``."""

    def __init__(self, spec: CacheSpec, block_size: int):
        if spec.kind not in SUPPORTED_KINDS:
            raise UnsupportedFeatureError(
                f"the worker declared a KV cache group of kind {spec.kind!r}; this scheduler "
                f"manages only {', '.join(SUPPORTED_KINDS)}")
        if spec.kind == "sliding" and spec.window < 1:
            raise UnsupportedFeatureError(f"a sliding-window cache group needs a positive "
                                          f"window, got {spec.window}")
        self.spec, self.block_size = spec, block_size
        self.window = spec.window if spec.kind == "sliding" else None
        self.state = spec.kind == "state"  # one slot per request, not a block per positions

    def first_needed(self, start: int) -> int:
        """The first table entry a chunk computed from position ``start`` reads."""
        if self.window is None:
            return 0
        return max(0, start - self.window + 1) // self.block_size

    def max_blocks(self, limit: int, chunk: int) -> int:
        """The most blocks a request growing to ``limit`` tokens may hold at once here, when
        a step computes at most ``chunk`` of its tokens: its window's blocks, the chunk's,
        and (prefix caching with overlap) the previous chunk's not freed yet."""
        if self.state:
            return 1
        whole = blocks_for(limit, self.block_size)
        if self.window is None:
            return whole
        return min(whole, blocks_for(self.window, self.block_size) + 2
                   + 2 * blocks_for(chunk, self.block_size))


class CacheGroups:
    """The pools of every group, and the request-level operations over all of them."""

    def __init__(self, groups: Sequence[CacheGroup], block_size: int, prefix_caching: bool):
        if not groups:
            raise ValueError("at least one cache group is needed")
        self.groups = list(groups)
        self.block_size, self.prefix_caching = block_size, prefix_caching
        self.rules = [GroupRule(g.spec, block_size) for g in groups]
        self.pools = [BlockManager(g.num_blocks, block_size, prefix_caching) for g in groups]
        self._sliding = [i for i, r in enumerate(self.rules) if r.window is not None]
        self._state = [i for i, r in enumerate(self.rules) if r.state]
        self._full = [i for i, r in enumerate(self.rules) if r.window is None and not r.state]
        self._positional = [i for i, r in enumerate(self.rules) if not r.state]
        if not self._positional:
            raise ValueError("at least one cache group must hold positions")
        self._ref = self._positional[0]

    def positional(self, req) -> list[int]:
        """The request's table in the first positional group: one entry per ``block_size``
        positions, as every positional group's."""
        return req.block_ids[self._ref]

    def empty_tables(self) -> list[list[int]]:
        return [[] for _ in self.pools]

    # ------------------------------------------------------------ capacity

    def min_free(self) -> int:
        """Free blocks in the scarcest pool (every group grows by the same entries)."""
        if len(self.pools) == 1:  # most models: asked per request per step
            return self.pools[0].num_free_blocks
        return min(self.pools[g].num_free_blocks for g in self._positional)

    def fit_tokens(self, req) -> int:
        """How many more tokens ``req`` could compute with the blocks free now."""
        held = len(self.positional(req))
        return (held + self.min_free()) * self.block_size - req.num_computed_tokens

    def refusal(self, limit: int, chunk: int) -> Optional[str]:
        """Why a request growing to ``limit`` tokens can never fit one of the pools."""
        for group, rule in zip(self.groups, self.rules):
            need = rule.max_blocks(limit, chunk)
            if need > group.num_blocks:  # never a state group: its pool has a slot
                where = "" if len(self.groups) == 1 else f" ({group.spec.kind} attention layers)"
                return (f"needing {need} KV blocks of {self.block_size} tokens{where}, but "
                        f"the KV cache has only {group.num_blocks}")
        return None

    # ------------------------------------------------------------ a request's blocks

    def drop_out_of_window(self, req, start: int) -> None:
        """Free each sliding group's blocks wholly before the window of a chunk computed
        from ``start`` (with prefix caching, only those already published)."""
        for g in self._sliding:
            end = self.rules[g].first_needed(start)
            if self.prefix_caching:
                end = min(end, req.num_cached_blocks)
            lo = req.num_dropped[g]
            if end <= lo:
                continue
            table = req.block_ids[g]
            self.pools[g].free([b for b in table[lo:end] if b != NULL_BLOCK])
            table[lo:end] = [NULL_BLOCK] * (end - lo)
            req.num_dropped[g] = end

    def grow(self, req, num_tokens: int) -> None:
        """Blocks for the request's first ``num_tokens`` tokens, in every group (check
        ``min_free`` first)."""
        need = blocks_for(num_tokens, self.block_size) - len(self.positional(req))
        if need > 0:
            for g in self._positional:
                req.block_ids[g] += self.pools[g].allocate(need)

    def free_all(self, req) -> None:
        self.take_restores(req)
        for pool, table in zip(self.pools, req.block_ids):
            pool.free([b for b in table if b != NULL_BLOCK])
        req.block_ids = self.empty_tables()
        req.num_dropped = [0] * len(self.pools)

    # ------------------------------------------------------------ state snapshots

    @property
    def has_state(self) -> bool:
        return bool(self._state)

    def take_restores(self, req) -> list[list[int]]:
        """The request's snapshot copies for its plan, their snapshots released: the worker
        runs plans in order, so a slot reused from now on is written only after the copy."""
        restores, req.state_restores = req.state_restores, []
        for g, snapshot, _slot in restores:
            self.pools[g].free([snapshot])
        return restores

    def snapshots_in(self, req, start: int, end: int
                     ) -> list[tuple[list[int], bytes]]:
        """Snapshots of the request's states at the snapshot points of its prompt that its
        chunk of positions [start, end) reaches: every multiple of ``STATE_SNAPSHOT_TOKENS``
        (rounded to a block), the last block boundary a later prefix hit on its tokens
        could resume from, where its match in the KV prefix cache ended beyond any snapshot
        (``snapshot_hint``: an earlier prompt shares its tokens up to there, as a system
        prompt is shared), and the chunk's end when that is a block boundary (free: the
        state is there anyway), each in a slot to spare of each state group that does not
        hold that boundary already: ([group, its slot, the snapshot's, the boundary], the
        boundary's block hash) for the plan's ``state_snapshots``."""
        bs = self.block_size
        if not (self._state and self.prefix_caching):
            return []
        every = max(bs, STATE_SNAPSHOT_TOKENS // bs * bs)
        last = min((req.num_tokens - 1) // bs * bs, req.num_prompt_tokens // bs * bs)
        points = {b for b in range((start // every + 1) * every, end + 1, every) if b <= last}
        points |= {b for b in (last, req.snapshot_hint) if start < b <= min(end, last)}
        if end % bs == 0 and end <= req.num_prompt_tokens:
            points.add(end)
        out = []
        for b in sorted(points):
            req.update_block_hashes(bs, b)
            block_hash = req.block_hashes[b // bs - 1]
            for g in self._state:
                pool = self.pools[g]
                if pool.cached_block(block_hash) is None and pool.num_free_blocks > 0:
                    out.append(([g, req.block_ids[g][0], pool.allocate(1)[0], b], block_hash))
        return out

    def spare_state_slots(self) -> int:
        """Slots every state pool can give now (cached snapshots evicted first)."""
        return min(self.pools[g].num_free_blocks for g in self._state)

    def draft_snapshots(self, req, n: int) -> list[tuple[int, list[int]]]:
        """(group, ``n`` fresh slots) per state group: where a speculative step keeps the
        request's states after its first ``n`` rows, so a rejected draft's state can be
        rolled back (check ``spare_state_slots`` first)."""
        return [(g, self.pools[g].allocate(n)) for g in self._state]

    def end_draft_snapshots(self, req, held: list[tuple[int, list[int]]],
                            accepted: Optional[int]) -> None:
        """A speculative step ended with ``accepted`` drafts (None: failed, or the request
        is gone): the snapshot after the last accepted row goes back into the request's
        slot before its next step (``state_restores``) unless every draft was accepted
        (then the slot holds it already); the rest are freed."""
        for g, slots in held:
            keep = slots[accepted] if accepted is not None and accepted < len(slots) else None
            if keep is not None:
                req.state_restores.append([g, keep, req.block_ids[g][0]])
            self.pools[g].free([s for s in slots if s != keep])

    def publish_snapshot(self, group: int, slot: int, block_hash: Optional[bytes]) -> None:
        """A snapshot's step ended: cache it under ``block_hash`` (None: the step failed),
        then release it, evictable."""
        if block_hash is not None:
            self.pools[group].cache_block(slot, block_hash)
        self.pools[group].free([slot])

    def publish(self, req, first: int, end: int) -> None:
        """Publish table entries [first, end), full of computed KV, in every positional
        group."""
        for g in self._positional:
            pool, table = self.pools[g], req.block_ids[g]
            for i in range(first, end):
                if table[i] != NULL_BLOCK:
                    pool.cache_block(table[i], req.block_hashes[i])

    # ------------------------------------------------------------ prefix cache

    def match_prefix(self, hashes: Sequence[bytes]) -> list[list[int]]:
        """Per group, the table of the longest usable prefix hit among these chained block
        hashes (the rule in the module docstring); every table has the hit's length."""
        k = self.positional_match(hashes)
        while k > 0 and not (self._sliding_hit(hashes, k) and self._state_hit(hashes, k)):
            k -= 1
        tables = []
        for g, (pool, rule) in enumerate(zip(self.pools, self.rules)):
            if rule.state:  # the snapshot at the hit's boundary (admit gives it a slot)
                tables.append([pool.cached_block(hashes[k - 1])] if k else [])
                continue
            first = rule.first_needed(k * self.block_size)
            tables.append([NULL_BLOCK] * first
                          + [pool.cached_block(h) for h in hashes[first:k]])
        return tables

    def positional_match(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks of these hashes every full group caches: the hit a state
        snapshot at its boundary would allow."""
        k = len(hashes)
        for g in self._full:
            k = min(k, len(self.pools[g].match_prefix(hashes[:k])))
        return k

    def _sliding_hit(self, hashes: Sequence[bytes], k: int) -> bool:
        for g in self._sliding:
            pool = self.pools[g]
            first = self.rules[g].first_needed(k * self.block_size)
            if any(pool.cached_block(h) is None for h in hashes[first:k]):
                return False
        return True

    def _state_hit(self, hashes: Sequence[bytes], k: int) -> bool:
        return all(self.pools[g].cached_block(hashes[k - 1]) is not None for g in self._state)

    def can_admit(self, tables: list[list[int]], need: int) -> bool:
        """Whether every pool has ``need`` fresh blocks beyond the cached ones it revives
        (a state pool: one slot)."""
        for pool, table, rule in zip(self.pools, tables, self.rules):
            hit = [b for b in table if b != NULL_BLOCK]
            if (1 if rule.state else need) > pool.num_free_blocks - pool.num_unreferenced(hit):
                return False
        return True

    def admit(self, req, tables: list[list[int]], need: int) -> None:
        """Give an admitted request the hit's blocks (referenced) and ``need`` fresh ones."""
        req.num_dropped = [0] * len(self.pools)
        for g, (pool, table) in enumerate(zip(self.pools, tables)):
            if self.rules[g].state:
                snapshot = table[0] if table else None
                if snapshot is not None:  # held until the plan carries its copy
                    pool.acquire([snapshot])
                table[:] = pool.allocate(1)
                if snapshot is not None:
                    req.state_restores.append([g, snapshot, table[0]])
                continue
            hit = [b for b in table if b != NULL_BLOCK]
            pool.acquire(hit)
            req.num_dropped[g] = len(table) - len(hit)  # the leading NULL entries
            table += pool.allocate(need)
        req.block_ids = tables

    # ------------------------------------------------------------ introspection

    def stats(self) -> dict:
        """Blocks over the positional pools (state slots are not KV blocks)."""
        pools = [self.pools[g] for g in self._positional]
        return {"kv_blocks_used": sum(p.num_used_blocks for p in pools),
                "kv_blocks_total": sum(p.num_blocks for p in pools),
                "kv_blocks_cached_free": sum(p.num_cached_free_blocks for p in pools)}

    def check_invariants(self, running, held: Sequence[tuple[int, int]] = (),
                         ahead: int = 0) -> None:
        """``held``: (group, slot) of the snapshots steps in flight are writing; ``ahead``:
        the most draft tokens a request verifies in a step (the blocks of its last drafts'
        positions stay with it: the worker's table only grows)."""
        refs: list[dict[int, int]] = [{} for _ in self.pools]
        for g, slot in held:
            refs[g][slot] = refs[g].get(slot, 0) + 1
        for req in running:
            assert len(req.block_ids) == len(self.pools), f"{req} has a table per group"
            length = blocks_for(req.num_computed_tokens, self.block_size)
            most = blocks_for(req.num_computed_tokens + ahead, self.block_size)
            for g, (rule, table) in enumerate(zip(self.rules, req.block_ids)):
                if rule.state:
                    assert len(table) == 1, f"{req} holds {len(table)} state slots in group {g}"
                    refs[g][table[0]] = refs[g].get(table[0], 0) + 1
                    continue
                assert length <= len(table) <= most, f"{req} group {g} holds blocks it has not filled"
                real = [b for b in table if b != NULL_BLOCK]
                assert len(set(real)) == len(real), f"{req} repeats a block in group {g}"
                nulls = len(table) - len(real)
                assert table[:nulls] == [NULL_BLOCK] * nulls, f"{req} group {g}: a hole"
                assert rule.window is not None or not nulls, f"{req}: a full group dropped a block"
                for b in real:
                    refs[g][b] = refs[g].get(b, 0) + 1
        for pool, expected in zip(self.pools, refs):
            pool.check_invariants(expected)
