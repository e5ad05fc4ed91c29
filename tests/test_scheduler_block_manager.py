"""BlockManager alone: allocation, ref counts, chained prefix hashes, LRU eviction."""

import pytest

from pocketllm.scheduler.block_manager import BlockManager, blocks_for, hash_block


def chain(blocks):
    hashes, parent = [], None
    for toks in blocks:
        parent = hash_block(parent, toks)
        hashes.append(parent)
    return hashes


def test_blocks_for():
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_free_counts_and_limits():
    bm = BlockManager(4, 2)
    a = bm.allocate(3)
    assert len(set(a)) == 3 and bm.num_free_blocks == 1 and bm.num_used_blocks == 3
    with pytest.raises(RuntimeError):
        bm.allocate(2)
    bm.free(a)
    assert bm.num_free_blocks == 4
    with pytest.raises(RuntimeError):
        bm.free([a[0]])
    bm.check_invariants({})


def test_hash_chain_depends_on_parent():
    # Same tokens in block 2, different block 1: no match beyond the first block.
    assert chain([[1, 2], [3, 4]])[1] != chain([[9, 9], [3, 4]])[1]
    assert chain([[1, 2], [3, 4]]) == chain([[1, 2], [3, 4]])
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1])


def test_cached_blocks_survive_free_and_match_with_refcounts():
    bm = BlockManager(4, 2)
    h = chain([[1, 2], [3, 4], [5, 6]])
    blocks = bm.allocate(3)
    for b, hh in zip(blocks, h):
        assert bm.cache_block(b, hh)
    assert bm.match_prefix(h) == blocks
    assert bm.match_prefix(chain([[1, 2], [3, 5]])) == blocks[:1]
    bm.acquire(blocks[:2])  # a second holder while the first still holds them
    assert bm.ref_counts[blocks[0]] == 2
    bm.free(blocks)
    assert bm.num_free_blocks == 2 and bm.num_cached_free_blocks == 1
    bm.free(blocks[:2])
    assert bm.num_free_blocks == 4 and bm.num_cached_free_blocks == 3
    assert bm.match_prefix(h) == blocks  # still cached after everyone let go
    bm.acquire(blocks[:1])  # a hit takes the block out of the evictable set
    assert bm.num_free_blocks == 3
    bm.check_invariants({blocks[0]: 1})


def test_duplicate_content_stays_private():
    bm = BlockManager(4, 2)
    h = hash_block(None, [1, 2])
    a, b = bm.allocate(2)
    assert bm.cache_block(a, h) and not bm.cache_block(b, h)
    bm.free([b])
    assert bm.num_cached_free_blocks == 0  # b went back as a plain free block
    bm.check_invariants({a: 1})


def test_eviction_prefers_plain_blocks_then_lru():
    bm = BlockManager(4, 2)
    h = chain([[1, 1], [2, 2], [3, 3]])
    blocks = bm.allocate(3)
    for b, hh in zip(blocks, h):
        bm.cache_block(b, hh)
    bm.free(blocks[2:])  # freed first: least recently used
    bm.free(blocks[:2])  # freed tail-first: blocks[1] then blocks[0]
    got = bm.allocate(1)
    # the plain free block goes first: all three cached blocks stay cached
    assert bm.num_cached_free_blocks == 3 and got[0] not in blocks
    assert bm.allocate(1) == [blocks[2]] and bm.num_cached_free_blocks == 2
    assert bm.block_hashes[blocks[2]] is None  # evicted: its hash is gone
    assert bm.match_prefix(h) == blocks[:2]  # the head of the chain is still there
    assert bm.allocate(1) == [blocks[1]]
    assert bm.match_prefix(h) == blocks[:1]
    bm.check_invariants({got[0]: 1, blocks[2]: 1, blocks[1]: 1})


def test_disabled_cache():
    off = BlockManager(2, 2, enable_prefix_caching=False)
    (b,) = off.allocate(1)
    assert not off.cache_block(b, hash_block(None, [1, 2]))
    assert off.match_prefix([hash_block(None, [1, 2])]) == []
