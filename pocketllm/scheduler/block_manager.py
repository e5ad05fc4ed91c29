"""The KV block pool: ref counts, free lists and the prefix cache (hash -> block).

The scheduler owns block *ids*; workers own the tensors behind them. A block is
in exactly one of three states:

- referenced: ``ref_count > 0``, held by one or more running requests;
- cached-free: ``ref_count == 0`` but it holds a full, hashed block of KV that a
  later request with the same prefix may reuse; evictable in LRU order;
- plain free: ``ref_count == 0`` and no hash.

Allocation takes plain free blocks first and evicts the least recently freed
cached block only when none are left, so the cache keeps as much as it can.
Prefix hashes are chained (each block's hash covers its parent's hash) so a
block matches only when its whole prefix matches; SHA-256 makes an accidental
match between different prefixes practically impossible (a collision would
hand one request another's KV).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from typing import Iterable, Optional, Sequence


def hash_block(parent: Optional[bytes], token_ids: Sequence[int]) -> bytes:
    """Chained hash of one full block: its parent's hash and its token ids."""
    h = hashlib.sha256(parent or b"\x00")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[Optional[bytes]] = [None] * num_blocks
        self._plain_free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._cached: dict[bytes, int] = {}  # hash -> block id

    # ------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take now (plain free + evictable cached)."""
        return len(self._plain_free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._evictable)

    def num_unreferenced(self, block_ids: Iterable[int]) -> int:
        """How many of these blocks are free now (acquiring them uses free capacity)."""
        return sum(1 for b in block_ids if self.ref_counts[b] == 0)

    def match_prefix(self, block_hashes: Sequence[bytes]) -> list[int]:
        """The blocks caching the longest leading run of these chained hashes."""
        if not self.enable_prefix_caching:
            return []
        matched = []
        for h in block_hashes:
            block_id = self._cached.get(h)
            if block_id is None:
                break
            matched.append(block_id)
        return matched

    def cached_block(self, block_hash: bytes) -> Optional[int]:
        """The block caching this hash, if any (None also when prefix caching is off)."""
        return self._cached.get(block_hash) if self.enable_prefix_caching else None

    # ------------------------------------------------------------ changes

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks found by ``match_prefix``."""
        for b in block_ids:
            if self.ref_counts[b] == 0:
                del self._evictable[b]
            self.ref_counts[b] += 1

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks with ref_count 1; raises if fewer are free (check first)."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} KV blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            if self._plain_free:
                b = self._plain_free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)  # least recently freed
                del self._cached[self.block_hashes[b]]
                self.block_hashes[b] = None
            self.ref_counts[b] = 1
            out.append(b)
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block. Tail blocks are released first so that,
        among one request's blocks, the end of its chain is evicted before its head."""
        for b in reversed(block_ids):
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"KV block {b} freed more often than referenced")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if self.block_hashes[b] is not None:
                    self._evictable[b] = None  # most recently used end
                else:
                    self._plain_free.append(b)

    def cache_block(self, block_id: int, block_hash: bytes) -> bool:
        """Publish a block that is full of computed KV. A second block with the same
        content (two requests computed it at once) stays private."""
        if not self.enable_prefix_caching or block_hash in self._cached:
            return False
        if self.ref_counts[block_id] <= 0 or self.block_hashes[block_id] is not None:
            raise RuntimeError(f"KV block {block_id} cannot be cached in its state")
        self.block_hashes[block_id] = block_hash
        self._cached[block_hash] = block_id
        return True

    # ------------------------------------------------------------ checks

    def check_invariants(self, expected_refs: Optional[dict[int, int]] = None) -> None:
        """Raise AssertionError when the pool is inconsistent (tests call this every step).
        ``expected_refs``: block id -> references the caller holds, to compare."""
        plain, evictable = set(self._plain_free), set(self._evictable)
        assert len(plain) == len(self._plain_free), "a block is twice in the free list"
        assert not plain & evictable, "a block is both plain free and evictable"
        for b in range(self.num_blocks):
            ref, h = self.ref_counts[b], self.block_hashes[b]
            assert ref >= 0, f"block {b} has ref_count {ref}"
            assert (ref == 0) == (b in plain or b in evictable), f"block {b}: ref {ref} vs free lists"
            assert (b in evictable) == (ref == 0 and h is not None), f"block {b} evictable state"
            if h is not None:
                assert self._cached.get(h) == b, f"block {b}'s hash is not mapped to it"
        assert len(self._cached) == sum(h is not None for h in self.block_hashes)
        assert self.num_free_blocks + sum(r > 0 for r in self.ref_counts) == self.num_blocks
        if expected_refs is not None:
            for b in range(self.num_blocks):
                assert self.ref_counts[b] == expected_refs.get(b, 0), (
                    f"block {b}: ref_count {self.ref_counts[b]}, holders {expected_refs.get(b, 0)}")
