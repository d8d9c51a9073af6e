"""Block pool, prefix cache and manager: plain Python, no model."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from specserve.kv_cache.block_pool import BlockPool, hash_block_tokens
from specserve.kv_cache.manager import KVCacheIntegrityError, KVCacheManager


@dataclass
class Seq:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    extra: dict = field(default_factory=dict)


def test_chained_hash_depends_on_prefix():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    b = hash_block_tokens(hash_block_tokens(None, [9, 9, 9, 9]), [1, 2, 3, 4])
    assert a.token_ids == b.token_ids and a.value != b.value
    assert hash_block_tokens(None, [1, 2, 3, 4]) == a


def test_block_hashes_are_the_same_in_every_process():
    """The disk tier and the router compare hashes made by other processes: the first block of a
    chain must not hash its missing parent as None (hash(None) is an address before 3.12)."""
    import subprocess
    import sys

    code = ("from specserve.kv_cache.block_pool import hash_block_tokens as h; "
            "print(h(h(None, [1, 2, 3, 4]), [5, 6, 7, 8]).value)")
    here = hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 4]), [5, 6, 7, 8]).value
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert int(out.stdout) == here


def test_pool_lru_eviction_order_and_double_free():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    assert pool.num_free_blocks == 0
    for i, b in enumerate(blocks):
        pool.register(b, hash_block_tokens(None, [i]))
    pool.release([blocks[2], blocks[0]])  # 2 then 0 join the free queue
    assert pool.num_cached_blocks == 4
    (first,) = pool.allocate(1)
    assert first is blocks[2] and first.block_hash is None  # LRU head evicted
    assert pool.num_cached_blocks == 3
    with pytest.raises(RuntimeError):
        pool.release([blocks[0]])  # already at zero
    with pytest.raises(RuntimeError):
        pool.allocate(5)


def test_pool_hands_out_never_used_blocks_first_then_the_lru_queue():
    """Blocks are made on first use; the never-used ids come, in order, before every released
    block (as if the queue started 0..N-1), and the integrity check sees all of them."""
    pool = BlockPool(6)
    assert pool.num_free_blocks == 6 and pool.blocks == []
    a, b = pool.allocate(2)
    pool.register(a, hash_block_tokens(None, [1]))
    pool.release([a])
    assert pool.num_free_blocks == 5
    got = pool.allocate(5)
    assert [x.block_id for x in got] == [2, 3, 4, 5, 0] and got[-1] is a and a.block_hash is None
    assert pool.num_free_blocks == 0 and [x.block_id for x in pool.blocks] == list(range(6))
    refs = {i: 1 for i in range(6)}
    assert pool.check_integrity(refs) == []
    small = BlockPool(4)
    small.allocate(1)
    assert small.check_integrity({0: 1}) == []
    assert any("never used" in p for p in small.check_integrity({0: 1, 3: 1}))


def test_allocate_append_rollback_free():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    s = Seq("a", list(range(10)))
    assert kv.allocate_slots(s, 10)
    assert len(kv.block_ids("a")) == 3
    s.num_computed_tokens = 10
    # Room for one decode token plus 4 look-ahead draft slots: 15 tokens -> 4 blocks.
    assert kv.allocate_slots(s, 1, num_lookahead_tokens=4)
    assert len(kv.block_ids("a")) == 4
    # Verification accepted only up to 12 tokens: the 4th block is released.
    assert kv.rollback(s, 12) == 1
    assert len(kv.block_ids("a")) == 3
    assert kv.check_integrity(["a"])
    kv.free(s)
    assert kv.num_free_blocks == 10
    assert kv.check_integrity([])


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    s = Seq("a", list(range(20)))
    assert not kv.allocate_slots(s, 20)
    assert kv.num_free_blocks == 3 and kv.block_ids("a") == []
    assert kv.check_integrity([])


def test_prefix_hit_reuses_blocks_and_caps_at_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = Seq("a", list(range(12)))
    assert kv.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    kv.cache_blocks(a, 12)
    # Same 12 tokens: only 2 blocks may hit, the last token must be recomputed.
    b = Seq("b", list(range(12)))
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and [h.block_id for h in hits] == kv.block_ids("a")[:2]
    assert kv.allocate_slots(b, 12 - n, hits)
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert all(blk.ref_cnt == 2 for blk in hits)
    # A different continuation of the same first block shares only that block.
    c = Seq("c", [0, 1, 2, 3, 7, 7, 7, 7, 7])
    hits_c, n_c = kv.get_computed_blocks(c)
    assert n_c == 4
    kv.check_integrity(["a", "b"])


def test_freed_blocks_stay_cached_until_evicted():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = Seq("a", list(range(9)))
    kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    kv.cache_blocks(a, 9)
    kv.free(a)
    assert kv.num_free_blocks == 4
    b = Seq("b", list(range(9)))
    hits, n = kv.get_computed_blocks(b)
    assert n == 8  # revived from the free queue
    assert kv.can_allocate(b, 1, hits)
    # Reviving 2 free blocks leaves 2: asking for 3 fresh ones must fail.
    assert not kv.can_allocate(b, 1 + 8, hits)
    kv.allocate_slots(b, 1, hits)
    assert kv.num_free_blocks == 1
    kv.check_integrity(["b"])


def test_unverified_tokens_never_cached():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    s = Seq("s", [1, 2, 3])
    kv.allocate_slots(s, 3, num_lookahead_tokens=5)  # 3 real tokens + 5 draft slots
    s.num_computed_tokens = 3
    kv.cache_blocks(s, 3)  # only verified tokens: no full block yet
    assert kv.pool.num_cached_blocks == 0
    s.all_token_ids += [4, 5]
    s.num_computed_tokens = 5
    kv.cache_blocks(s, 5)
    assert kv.pool.num_cached_blocks == 1


def test_integrity_detects_leak():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    s = Seq("s", [1, 2, 3])
    kv.allocate_slots(s, 3)
    with pytest.raises(KVCacheIntegrityError):
        kv.check_integrity([])  # "s" is not live but still holds a block
    kv.pool.blocks[kv.block_ids("s")[0]].ref_cnt += 1
    with pytest.raises(KVCacheIntegrityError):
        kv.check_integrity(["s"])
