"""Per-request block tables over a BlockPool: allocate, append, roll back, free, cache prefixes.

Plain Python over ids and counts: no tensors here, so the scheduler and its tests run without
a model. The runner turns block ids into slot indices (block_id * block_size + offset).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch

from specserve.kv_cache.block_pool import BlockHash, BlockPool, KVBlock
from specserve.kv_cache.layer_load import KVLoad
from specserve.kv_cache.prefix_cache import PREFIX_CACHES, PrefixCache
from specserve.kv_cache.tiers import TierBlock, TieredKVStore


def slot_indices(block_ids: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """Flat cache slots of token positions [start, end) of a request with this block table."""
    pos = torch.arange(start, end)
    return torch.tensor(block_ids, dtype=torch.long)[pos // block_size] * block_size + pos % block_size

class KVCacheIntegrityError(AssertionError):
    """Block reference counts disagree with the requests that hold them."""


class SequenceLike(Protocol):
    """What the manager needs to know about a request."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int


class KVCacheUsage(NamedTuple):
    """A snapshot of the pool for metrics."""

    num_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    prefix_hit_rate: float


class PrefixHit(NamedTuple):
    """Where a request's cached prefix lives: blocks of the working pool, then blocks found in
    the lower tiers (to be loaded into fresh pool blocks: verified payloads in host memory, or
    disk files verified layer by layer as the step loads them)."""

    blocks: list[KVBlock]
    loaded: list[TierBlock]
    num_tokens: int


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


class KVCacheManager:
    """Owns every request's block table in one KV cache (the target's or the draft's)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        name: str = "target",
        tiers: TieredKVStore | None = None,
    ) -> None:
        self.block_size = block_size
        self.name = name
        # Host and disk tiers below the pool (prefix caching only): blocks registered here are
        # saved to them after their step (pending_saves, by the engine, which reads the KV), and
        # prefix hits found in them are loaded into fresh blocks (pending_loads, by the runner).
        self.tiers = tiers if enable_prefix_caching else None
        self.pending_saves: list[tuple[int, BlockHash]] = []
        self.pending_loads: list[KVLoad] = []
        self.pool = BlockPool(num_blocks)
        cache_cls = PREFIX_CACHES["hash" if enable_prefix_caching else "none"]
        self.prefix_cache: PrefixCache = cache_cls(self.pool, block_size)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_hashes: dict[str, list[BlockHash]] = {}
        self.req_num_cached_blocks: dict[str, int] = {}

    # ---------------------------------------------------------------- queries
    @property
    def num_blocks(self) -> int:
        """Total blocks in the pool."""
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks available for allocation (evictable cached blocks included)."""
        return self.pool.num_free_blocks

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole pool can hold."""
        return self.pool.num_blocks * self.block_size

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table."""
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def slots(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """Flat cache slots ([blocks * block_size] view) of the request's tokens [start, end)."""
        return slot_indices(self.block_ids(request_id), start, end, self.block_size)

    def num_slots(self, request_id: str) -> int:
        """Token slots the request's blocks provide."""
        return len(self.req_blocks.get(request_id, ())) * self.block_size

    def usage(self) -> KVCacheUsage:
        """Snapshot of block usage for metrics."""
        free = self.pool.num_free_blocks
        return KVCacheUsage(
            self.pool.num_blocks, free, self.pool.num_blocks - free,
            self.pool.num_cached_blocks, self.prefix_cache.hit_rate,
        )

    # ---------------------------------------------------------------- prefix cache
    def get_computed_blocks(self, request: SequenceLike) -> tuple[list[KVBlock], int]:
        """Cached blocks covering a prefix of the request's tokens, and how many tokens they hold.

        At most num_tokens - 1 tokens come from the cache: the last token is always computed
        so the step has logits to sample from.
        """
        tokens = request.all_token_ids
        hashes = self._hashes(request, len(tokens))
        max_blocks = (len(tokens) - 1) // self.block_size
        hits = self.prefix_cache.match_prefix(hashes, max_blocks)
        self.prefix_cache.num_queried_tokens += len(tokens)
        self.prefix_cache.num_hit_tokens += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def num_cached_tokens(self, request: SequenceLike) -> int:
        """Tokens of the request's prefix the pool could serve now: a lookup only (nothing is
        held, counted or remembered for the request)."""
        tokens = request.all_token_ids
        hashes = PrefixCache.hash_blocks(tokens, self.block_size, list(self.req_hashes.get(request.request_id, ())), len(tokens))
        return len(self.prefix_cache.match_prefix(hashes, (len(tokens) - 1) // self.block_size)) * self.block_size

    def find_prefix(self, request: SequenceLike) -> PrefixHit:
        """The request's cached prefix: the working pool's run of hits, continued from the lower
        tiers where the pool's run ends (at most num_tokens - 1 tokens, as get_computed_blocks)."""
        hits, num_hit = self.get_computed_blocks(request)
        loaded: list[TierBlock] = []
        if self.tiers is not None:
            tokens = request.all_token_ids
            max_blocks = (len(tokens) - 1) // self.block_size
            # Never read more than the pool could take now: a request that waits for room looks
            # again every step, and a block it could not place would only be read again then.
            room = self.pool.num_free_blocks - sum(1 for b in hits if b.ref_cnt == 0)
            max_blocks = min(max_blocks, len(hits) + max(room, 0))
            loaded = self.tiers.fetch_run(self._hashes(request, len(tokens))[len(hits):max_blocks], deferred=True)
            self.prefix_cache.num_hit_tokens += len(loaded) * self.block_size
        return PrefixHit(hits, loaded, num_hit + len(loaded) * self.block_size)

    def take_pending_loads(self) -> list[KVLoad]:
        """Tier blocks to write into the pool before the next forward (the scheduler's step data)."""
        out, self.pending_loads = self.pending_loads, []
        return out

    def uncache(self, block_ids: Sequence[int]) -> None:
        """Forget the cached content of these blocks (lower-tier blocks that failed verification
        while their step loaded them): no later prefix lookup finds them."""
        for block_id in block_ids:
            self.pool.uncache(self.pool.blocks[block_id])

    def take_pending_saves(self) -> list[tuple[int, BlockHash]]:
        """Blocks registered since the last call that the tiers do not hold yet: (block id, hash)."""
        out, self.pending_saves = self.pending_saves, []
        return out

    def cache_blocks(self, request: SequenceLike, num_verified_tokens: int) -> None:
        """Register the request's full blocks within its first num_verified_tokens tokens.

        Only tokens that are both computed and accepted may be passed here: draft tokens that
        have not been verified must never become reusable prefix content.
        """
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        if not blocks:
            return
        n_full = min(num_verified_tokens // self.block_size, len(blocks))
        start = self.req_num_cached_blocks.get(rid, 0)
        if n_full <= start:
            return
        hashes = self._hashes(request, n_full * self.block_size)
        self.prefix_cache.insert_prefix(blocks[start:n_full], hashes[start:n_full])
        self.req_num_cached_blocks[rid] = n_full
        if self.tiers is not None:
            for block, block_hash in zip(blocks[start:n_full], hashes[start:n_full]):
                # Only blocks that now hold this content for the cache (not duplicates of a block
                # registered elsewhere), and only content the tiers lack.
                if block.block_hash == block_hash and not self.tiers.contains(block_hash):
                    self.pending_saves.append((block.block_id, block_hash))

    def _hashes(self, request: SequenceLike, upto: int) -> list[BlockHash]:
        known = self.req_hashes.setdefault(request.request_id, [])
        return PrefixCache.hash_blocks(request.all_token_ids, self.block_size, known, upto)

    # ---------------------------------------------------------------- allocation
    def num_blocks_needed(
        self, request: SequenceLike, num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock] = (), num_lookahead_tokens: int = 0,
        loaded: Sequence[TierBlock] = (),
    ) -> int:
        """Fresh blocks an allocate_slots call with these arguments would take from the pool
        (blocks loaded from a lower tier are fresh blocks too)."""
        held = len(self.req_blocks.get(request.request_id, ())) + len(new_computed_blocks)
        total = (
            request.num_computed_tokens + (len(new_computed_blocks) + len(loaded)) * self.block_size
            + num_new_tokens + num_lookahead_tokens
        )
        return max(0, cdiv(total, self.block_size) - held)

    def can_allocate(
        self, request: SequenceLike, num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock] = (), num_lookahead_tokens: int = 0,
        loaded: Sequence[TierBlock] = (),
    ) -> bool:
        """Whether allocate_slots would succeed right now."""
        need = self.num_blocks_needed(request, num_new_tokens, new_computed_blocks, num_lookahead_tokens, loaded)
        # Reviving a prefix hit that sits in the free queue takes it out of the free count.
        revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        return need <= self.pool.num_free_blocks - revived

    def allocate_slots(
        self, request: SequenceLike, num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock] = (), num_lookahead_tokens: int = 0,
        loaded: Sequence[TierBlock] = (),
    ) -> bool:
        """Make room for num_new_tokens (+ look-ahead) beyond the computed and prefix-hit tokens.

        new_computed_blocks are prefix-cache hits for a request with no blocks yet; they are
        referenced and put at the head of its block table. `loaded` (hits in a lower tier, after
        those) get the next fresh blocks, registered under their hashes at once, with a KVLoad
        each in pending_loads: the runner writes them before the step's forward. Returns False,
        changing nothing, when the pool cannot supply the blocks.
        """
        if not self.can_allocate(request, num_new_tokens, new_computed_blocks, num_lookahead_tokens, loaded):
            return False
        need = self.num_blocks_needed(request, num_new_tokens, new_computed_blocks, num_lookahead_tokens, loaded)
        blocks = self.req_blocks.setdefault(request.request_id, [])
        if new_computed_blocks or loaded:
            if blocks:
                raise RuntimeError("prefix hits can only seed a request that holds no blocks")
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            # Hit blocks are registered already; do not register them a second time.
            self.req_num_cached_blocks[request.request_id] = len(new_computed_blocks) + len(loaded)
        if need:
            fresh = self.pool.allocate(need)
            for block, hit in zip(fresh, loaded):
                self.pool.register(block, hit.block_hash)
                self.pending_loads.append(KVLoad(block.block_id, hit.payload))
            blocks.extend(fresh)
        return True

    def rollback(self, request: SequenceLike, num_tokens: int) -> int:
        """Keep KV slots for the first num_tokens tokens only; free blocks past them.

        Used after verification rejects draft tokens and when look-ahead room went unused.
        Returns the number of blocks released.
        """
        blocks = self.req_blocks.get(request.request_id)
        if not blocks:
            return 0
        keep = cdiv(num_tokens, self.block_size)
        if keep >= len(blocks):
            return 0
        dropped = blocks[keep:]
        del blocks[keep:]
        self.pool.release(reversed(dropped))
        cached = self.req_num_cached_blocks.get(request.request_id, 0)
        if cached > keep:
            self.req_num_cached_blocks[request.request_id] = keep
        return len(dropped)

    def free(self, request: SequenceLike | str) -> None:
        """Release every block of a finished, aborted or preempted request."""
        rid = request if isinstance(request, str) else request.request_id
        blocks = self.req_blocks.pop(rid, None)
        self.req_num_cached_blocks.pop(rid, None)
        if blocks:
            self.pool.release(reversed(blocks))

    def forget(self, request: SequenceLike | str) -> None:
        """Drop everything known about a request, including its cached block hashes."""
        rid = request if isinstance(request, str) else request.request_id
        self.free(rid)
        self.req_hashes.pop(rid, None)

    def reset_prefix_cache(self) -> int:
        """Forget all unreferenced cached content, the lower tiers' included; returns the number
        of pool blocks dropped."""
        if self.tiers is not None:
            self.tiers.clear()
            self.pending_saves.clear()
        return self.prefix_cache.evict()

    # ---------------------------------------------------------------- checks
    def check_integrity(self, live_request_ids: Sequence[str] | None = None) -> bool:
        """Raise KVCacheIntegrityError unless every block is free or held by its owners exactly.

        With live_request_ids, also require that no other request still holds blocks (so after
        all requests finish, every block is free or only kept by the prefix cache).
        """
        refs: dict[int, int] = {}
        problems = []
        for rid, blocks in self.req_blocks.items():
            ids = [b.block_id for b in blocks]
            if len(set(ids)) != len(ids):
                problems.append(f"request {rid} holds a block twice: {ids}")
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        if live_request_ids is not None:
            stale = set(self.req_blocks) - set(live_request_ids)
            if stale:
                problems.append(f"finished requests still hold blocks: {sorted(stale)}")
        problems += self.pool.check_integrity(refs)
        problems += self.prefix_cache.check_integrity()
        if problems:
            raise KVCacheIntegrityError(f"{self.name} KV cache: " + "; ".join(problems[:20]))
        return True
