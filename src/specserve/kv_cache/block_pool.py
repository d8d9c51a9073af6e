"""A fixed pool of KV blocks with reference counts and an LRU queue of reusable blocks.

A block whose reference count drops to zero goes to the tail of the free queue but keeps its
content hash: until the block is handed out again it can still be revived by a prefix-cache
hit. Allocation takes blocks from the head, so the least recently released block is the one
evicted first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple


class BlockHash(NamedTuple):
    """Identity of a full block: chained hash plus the exact tokens, compared on lookup."""

    value: int  # hash((parent.value, token_ids)); chaining makes it a hash of the whole prefix
    parent_value: int | None
    token_ids: tuple[int, ...]


_ROOT = 0x5EC5E12FE0F1A5E  # stands for "no parent": hash(None) differs between processes before Python 3.12


def chain_hash(parent_value: int | None, tokens: tuple[int, ...]) -> int:
    """The chained hash of a block's tokens after the block whose hash is parent_value.

    Python's hash of a tuple of ints is deterministic across processes (no hash randomisation
    for ints), so the same prefix hashes the same on every worker and in every run (the disk
    tier relies on it); the first block hashes with an int in place of its missing parent.
    """
    return hash((_ROOT if parent_value is None else parent_value, tokens))


def hash_block_tokens(parent: BlockHash | None, token_ids: Iterable[int]) -> BlockHash:
    """Hash one full block's tokens chained to the hash of the block before it (chain_hash)."""
    tokens = tuple(token_ids)
    parent_value = parent.value if parent is not None else None
    return BlockHash(chain_hash(parent_value, tokens), parent_value, tokens)


@dataclass(eq=False)
class KVBlock:
    """One page of KV memory: block_size token slots in every layer's cache."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set once the block is full and registered

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    """Owns every KVBlock: allocation, reference counting, the free LRU and the hash index."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("a block pool needs at least one block")
        self.num_blocks = num_blocks
        # Blocks are made when first handed out, in id order: `blocks[i]` is block i for every i
        # below len(blocks), and the ids from len(blocks) on were never used. (A tiny model's 1 GiB
        # pool holds 131k blocks: making them all up front cost half a second per engine.)
        self.blocks: list[KVBlock] = []
        # Released blocks with ref_cnt == 0, least recently freed first (insertion order is the
        # LRU order). The never-used ids come before all of them: allocation takes those first.
        self._free: OrderedDict[int, KVBlock] = OrderedDict()
        # Content hash value -> the block holding that content.
        self._cached: dict[int, KVBlock] = {}
        self.num_evictions = 0
        # Called with the hash of every cached content the pool drops (reuse or reset): whoever
        # indexes this pool's content from outside (a disaggregated router) learns of it.
        self.on_evict: Callable[[BlockHash], None] | None = None

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (including evictable cached ones)."""
        return len(self._free) + self.num_blocks - len(self.blocks)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently registered in the hash index."""
        return len(self._cached)

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        """The block caching exactly this content, or None (a hash collision is a miss)."""
        block = self._cached.get(block_hash.value)
        if block is None or block.block_hash != block_hash:
            return None
        return block

    # ------------------------------------------------------------------ changes
    def allocate(self, n: int) -> list[KVBlock]:
        """Take n blocks from the LRU head, evicting any cached content they still hold."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} blocks with only {self.num_free_blocks} free")
        fresh = min(n, self.num_blocks - len(self.blocks))
        out = [KVBlock(i, ref_cnt=1) for i in range(len(self.blocks), len(self.blocks) + fresh)]
        self.blocks += out
        for _ in range(n - fresh):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on blocks found by a prefix hit, reviving them from the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference per block; blocks reaching zero join the tail of the free queue.

        Callers pass a request's blocks tail first so that, among them, the end of a sequence is
        evicted before its (more shareable) beginning.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block!r}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def register(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Record that a full block holds this content so later requests can reuse it."""
        if block.block_hash is not None:
            return  # already registered (e.g. a prefix hit)
        if block_hash.value in self._cached:
            return  # the same content lives in another block already; keep that one
        block.block_hash = block_hash
        self._cached[block_hash.value] = block

    def uncache(self, block: KVBlock) -> None:
        """Forget the content registered for this block (it stays allocated to its holders)."""
        self._evict(block)

    def evict_unused(self, n: int | None = None) -> int:
        """Drop cached content of up to n unreferenced blocks (all when n is None)."""
        count = 0
        for block in list(self._free.values()):
            if n is not None and count >= n:
                break
            if block.block_hash is not None:
                self._evict(block)
                count += 1
        return count

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            dropped = block.block_hash
            if self._cached.get(dropped.value) is block:
                del self._cached[dropped.value]
                if self.on_evict is not None:
                    self.on_evict(dropped)
            block.block_hash = None
            self.num_evictions += 1

    # ------------------------------------------------------------------ checks
    def check_integrity(self, expected_refs: dict[int, int]) -> list[str]:
        """Compare reference counts with the owners' view; return the problems found."""
        problems = [f"block {i}: never used, owners hold {n}" for i, n in expected_refs.items()
                    if n and not 0 <= i < len(self.blocks)]
        for block in self.blocks:
            want = expected_refs.get(block.block_id, 0)
            if block.ref_cnt != want:
                problems.append(f"block {block.block_id}: ref_cnt {block.ref_cnt}, owners hold {want}")
            in_free = block.block_id in self._free
            if (block.ref_cnt == 0) != in_free:
                problems.append(f"block {block.block_id}: ref_cnt {block.ref_cnt} but in_free={in_free}")
        for value, block in self._cached.items():
            if block.block_hash is None or block.block_hash.value != value:
                problems.append(f"hash index entry {value} points at {block!r} with another hash")
        return problems
