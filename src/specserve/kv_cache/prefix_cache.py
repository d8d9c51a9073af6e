"""Prefix caches behind one interface, picked from a registry by name."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from specserve.kv_cache.block_pool import BlockHash, BlockPool, KVBlock, hash_block_tokens


class PrefixCache(ABC):
    """Finds KV blocks already holding a token prefix and records new full blocks."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @abstractmethod
    def match_prefix(self, block_hashes: Sequence[BlockHash], max_blocks: int) -> list[KVBlock]:
        """Longest run of leading blocks whose content is cached (not yet referenced)."""

    @abstractmethod
    def insert_prefix(self, blocks: Sequence[KVBlock], block_hashes: Sequence[BlockHash]) -> None:
        """Register full, verified blocks (blocks[i] holds block_hashes[i])."""

    def evict(self, n: int | None = None) -> int:
        """Forget up to n unreferenced cached blocks; returns how many were dropped."""
        return self.pool.evict_unused(n)

    def check_integrity(self) -> list[str]:
        """Problems in the cache's own bookkeeping (the pool checks reference counts)."""
        return []

    @property
    def hit_rate(self) -> float:
        """Fraction of queried prompt tokens served from the cache."""
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    @staticmethod
    def hash_blocks(
        token_ids: Sequence[int], block_size: int, known: list[BlockHash], upto: int
    ) -> list[BlockHash]:
        """Extend `known` in place with the hashes of full blocks within token_ids[:upto]."""
        n_full = upto // block_size
        while len(known) < n_full:
            i = len(known)
            parent = known[-1] if known else None
            known.append(hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size]))
        return known


class HashPrefixCache(PrefixCache):
    """Prefix cache keyed by chained block hashes, tokens compared on every hit."""

    def match_prefix(self, block_hashes: Sequence[BlockHash], max_blocks: int) -> list[KVBlock]:
        hits: list[KVBlock] = []
        for block_hash in block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def insert_prefix(self, blocks: Sequence[KVBlock], block_hashes: Sequence[BlockHash]) -> None:
        for block, block_hash in zip(blocks, block_hashes):
            self.pool.register(block, block_hash)

    def check_integrity(self) -> list[str]:
        problems = []
        for block in self.pool.blocks:
            if block.block_hash is not None and self.pool.lookup(block.block_hash) is not block:
                problems.append(f"{block!r} carries a hash the index does not map to it")
        return problems


class NoPrefixCache(PrefixCache):
    """Prefix caching switched off: nothing is ever found or kept."""

    def match_prefix(self, block_hashes: Sequence[BlockHash], max_blocks: int) -> list[KVBlock]:
        return []

    def insert_prefix(self, blocks: Sequence[KVBlock], block_hashes: Sequence[BlockHash]) -> None:
        return None


PREFIX_CACHES: dict[str, type[PrefixCache]] = {"hash": HashPrefixCache, "none": NoPrefixCache}
