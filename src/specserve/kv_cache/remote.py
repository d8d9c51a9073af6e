"""The deployment's KV block store across hosts: one Ray actor, blocks moved through Ray's object store.

A prefix block that one worker computed is useful to every worker of the deployment, on any
host. The disk tier shares blocks between the workers of one host (one directory); this store
shares them between hosts, Mooncake's point: a KV-centric store makes prefix hits global.

- **The store** (`KVBlockStore`, a Ray actor started once per deployment by `start_kv_store`,
  no CPU reserved) holds block records in its memory, least recently used dropped first beyond
  its byte budget (`--kv-store-gib`). A record is the disk tier's self-verifying format
  (`tiers.block_prefix` + payload: model fingerprint, chained hash, parent, tokens, a CRC-32
  per layer and a BLAKE2b digest), so the store never has to trust a writer and a reader never
  trusts the store.
- **Writes** (`RemoteTier.save`): every block a worker's prefix cache registers goes, write
  through like the disk tier, onto a queue; a background thread encodes batches and sends them
  (one actor call per batch; the worker's engine thread never waits on the network). A worker
  that falls behind drops saves (counted) rather than grow the queue without bound.
- **Index**: each worker keeps a copy of the store's index for its model (the chained hashes
  held), refreshed by a background thread from the store's change log every `refresh_s`. A
  lookup (`contains`) is local; a block evicted since the last refresh is a miss at read time.
- **Reads** (`fetch_run`): the run of a prompt's blocks the index says are held, in one actor
  call whose reply Ray moves through its object store (from another node when the store lives
  there). Each record is verified against the block asked for; one that fails is counted as
  corrupt, deleted from the store and ends the run (the rest of the prompt is recomputed).
- **The router** asks the store which of a prompt's blocks it holds (`held`): a prompt whose
  full blocks are all there skips the prefill worker, on any host.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from specserve.kv_cache.block_pool import BlockHash
from specserve.kv_cache.tiers import TierCounters, block_prefix, drained, enqueue, verified_payload

logger = logging.getLogger(__name__)

STORE_NAME = "specserve-kv-store"
_LOG_LEN = 1 << 16  # index changes the store remembers; a reader further behind gets the whole index
_BATCH = 32  # blocks per write call
_WRITE_QUEUE = 4096
_CALL_TIMEOUT_S = 10.0
_START_TIMEOUT_S = 120.0  # a new store actor coming up


class KVBlockStore:
    """Block records of every model (keyed by fingerprint and chained hash), LRU within a byte
    budget, with a change log per model so that workers can keep a copy of the index. Plain
    Python: `start_kv_store` runs it as a Ray actor; tests may call it directly."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"a KV block store needs a positive capacity, got {capacity_bytes} bytes")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._records: OrderedDict[tuple[str, int], bytes] = OrderedDict()  # least recently used first
        self._version = 0
        self._log: collections.deque[tuple[int, str, int, bool]] = collections.deque(maxlen=_LOG_LEN)
        self.counters = {"puts": 0, "gets": 0, "hits": 0, "evicted": 0, "dropped_corrupt": 0}
        # The actor serves several calls at once (a slow reply must not hold up the others): every
        # method takes this lock; replies are serialised by Ray after it is released.
        self._lock = threading.Lock()

    def put(self, fingerprint: str, items: list[tuple[int, bytes]]) -> int:
        """Keep these records (chained hash, record); returns the index version after."""
        with self._lock:
            return self._put(fingerprint, items)

    def _put(self, fingerprint: str, items: list[tuple[int, bytes]]) -> int:
        for value, record in items:
            if len(record) > self.capacity_bytes:  # never kept: the senders' indexes drop it at their refresh
                self._changed(fingerprint, value, False)
                continue
            key = (fingerprint, value)
            old = self._records.pop(key, None)
            if old is not None:
                self.used_bytes -= len(old)
            else:
                self._changed(fingerprint, value, True)
            self._records[key] = record
            self.used_bytes += len(record)
            self.counters["puts"] += 1
        while self.used_bytes > self.capacity_bytes:
            (fp, value), record = self._records.popitem(last=False)
            self.used_bytes -= len(record)
            self.counters["evicted"] += 1
            self._changed(fp, value, False)
        return self._version

    def _changed(self, fingerprint: str, value: int, added: bool) -> None:
        self._version += 1
        self._log.append((self._version, fingerprint, value, added))

    def get_run(self, fingerprint: str, values: list[int]) -> list[bytes]:
        """The records of the leading run of these blocks that the store holds (marked used)."""
        with self._lock:
            return self._get_run(fingerprint, values)

    def _get_run(self, fingerprint: str, values: list[int]) -> list[bytes]:
        out = []
        self.counters["gets"] += 1
        for value in values:
            key = (fingerprint, value)
            record = self._records.get(key)
            if record is None:
                break
            self._records.move_to_end(key)
            out.append(record)
        self.counters["hits"] += len(out)
        return out

    def held(self, fingerprint: str, values: list[int]) -> int:
        """How many of these blocks, from the first, the store holds."""
        n = 0
        with self._lock:
            for value in values:
                if (fingerprint, value) not in self._records:
                    break
                n += 1
        return n

    def drop(self, fingerprint: str, values: list[int]) -> None:
        """Forget records a reader found corrupt."""
        with self._lock:
            for value in values:
                record = self._records.pop((fingerprint, value), None)
                if record is not None:
                    self.used_bytes -= len(record)
                    self.counters["dropped_corrupt"] += 1
                    self._changed(fingerprint, value, False)

    def changes(self, fingerprint: str, since: int) -> tuple[int, list[tuple[int, bool]], bool]:
        """(version, events, whole) for one model since version `since`: events are (chained
        hash, added) in order; whole: the log no longer reaches back that far (or since is 0) and
        the events add the whole index."""
        with self._lock:
            return self._changes(fingerprint, since)

    def _changes(self, fingerprint: str, since: int) -> tuple[int, list[tuple[int, bool]], bool]:
        if since and (not self._log or self._log[0][0] <= since + 1):
            events = []
            for version, fp, value, added in reversed(self._log):
                if version <= since:
                    break
                if fp == fingerprint:
                    events.append((value, added))
            return self._version, events[::-1], False
        return self._version, [(v, True) for fp, v in self._records if fp == fingerprint], True

    def stats(self) -> dict[str, Any]:
        """Blocks, bytes and counters."""
        with self._lock:
            return {"blocks": len(self._records), "used_bytes": self.used_bytes,
                    "capacity_bytes": self.capacity_bytes, **self.counters}


_STARTED: dict[str, Any] = {}  # handles of the stores this process started: Ray ends an actor whose handles are gone


def start_kv_store(capacity_bytes: int, name: str = STORE_NAME) -> Any:
    """The deployment's store actor (created, or the running one of that name): no CPU reserved,
    it only moves bytes. It lives as long as the process that started it (the router's): this
    module keeps its handle, so a caller that drops the returned one does not end it."""
    import ray

    cls = ray.remote(num_cpus=0, max_concurrency=8)(KVBlockStore)
    handle = cls.options(name=name, get_if_exists=True).remote(capacity_bytes)
    _STARTED[name] = handle
    # Up before anyone calls it with the tiers' short timeout: a new actor's process can take
    # longer than that to start on a busy host (seen: > 10 s on 2 cores under a test run).
    try:
        ray.get(handle.stats.remote(), timeout=_START_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"the KV block store {name!r} did not start within {_START_TIMEOUT_S:g} s") from None
    return handle


def find_kv_store(name: str = STORE_NAME) -> Any:
    """The running store actor of that name (a ConfigError when there is none)."""
    import ray

    from specserve.errors import ConfigError

    try:
        return ray.get_actor(name)
    except ValueError as exc:
        raise ConfigError(f"no KV block store {name!r} is running in this Ray cluster; start the deployment "
                          "with --kv-store-gib (it creates the store), or leave kv_remote_store out.") from exc


class RemoteTier:
    """A worker's view of the deployment's store (see the module docstring)."""

    def __init__(self, store: Any, fingerprint: str, payload_bytes: int, counters: TierCounters,
                 refresh_s: float = 0.25, layer_bytes: Sequence[int] | None = None) -> None:
        self.store = store
        self.fingerprint = fingerprint
        self.payload_bytes = payload_bytes
        self.layer_bytes = None if layer_bytes is None else tuple(layer_bytes)  # records carry per-layer CRC-32s
        self.counters = counters
        self.refresh_s = refresh_s
        self._lock = threading.Lock()
        self._known: set[int] = set()  # chained hashes the store held at the last refresh (or we sent)
        self._version = 0
        self._queue: queue.Queue[tuple[BlockHash, torch.Tensor] | None] = queue.Queue(_WRITE_QUEUE)
        self._queued: set[int] = set()
        self._stop = threading.Event()
        self.capacity_bytes = int(self._call(store.stats.remote())["capacity_bytes"])
        self.refresh()
        # The threads hold the tier weakly: a tier nobody uses any more (its engine gone) stops them.
        me = weakref.ref(self)
        self._writer = threading.Thread(target=_write_loop, args=(me, self._queue), name="specserve-kv-remote-writer",
                                        daemon=True)
        self._writer.start()
        self._refresher = threading.Thread(target=_refresh_loop, args=(me, self._stop, refresh_s),
                                           name="specserve-kv-remote-index", daemon=True)
        self._refresher.start()

    @staticmethod
    def _call(ref: Any) -> Any:
        import ray

        return ray.get(ref, timeout=_CALL_TIMEOUT_S)

    # ------------------------------------------------------------------ index
    def refresh(self) -> None:
        """Bring the local copy of the store's index up to date (one call)."""
        version, events, whole = self._call(self.store.changes.remote(self.fingerprint, self._version))
        with self._lock:
            if whole:
                self._known = set()
            for value, added in events:
                if added:
                    self._known.add(value)
                else:
                    self._known.discard(value)
            self._version = version

    def __len__(self) -> int:
        with self._lock:
            return len(self._known)

    @property
    def used_bytes(self) -> int:
        """This model's bytes in the store, as far as the local index knows."""
        return len(self) * self.payload_bytes

    def contains(self, block_hash: BlockHash) -> bool:
        """True if the store held this block at the last refresh (verified only when read)."""
        with self._lock:
            return block_hash.value in self._known

    # ------------------------------------------------------------------ reads
    def fetch_run(self, hashes: list[BlockHash]) -> list[torch.Tensor]:
        """Verified payloads of the leading run of these blocks the store holds (one call)."""
        with self._lock:
            n = 0
            while n < len(hashes) and hashes[n].value in self._known:
                n += 1
        if n == 0:
            return []
        try:
            records = self._call(self.store.get_run.remote(self.fingerprint, [h.value for h in hashes[:n]]))
        except Exception as exc:  # noqa: BLE001 - an unreachable store is a miss, never an error
            logger.warning("KV store unreachable (%s); the prefix is recomputed", exc)
            return []
        out: list[torch.Tensor] = []
        for block_hash, record in zip(hashes, records):
            try:
                data = verified_payload(record, self.fingerprint, block_hash, self.payload_bytes, self.layer_bytes)
            except (ValueError, KeyError, TypeError) as exc:
                self.counters.corrupt += 1
                logger.warning("KV store: block %016x refused (%s); dropped, the prefix is recomputed",
                               block_hash.value & 0xFFFFFFFFFFFFFFFF, exc)
                with contextlib.suppress(Exception):  # rare: wait, so no reader after us is served it
                    self._call(self.store.drop.remote(self.fingerprint, [block_hash.value]))
                with self._lock:
                    self._known.discard(block_hash.value)
                break
            out.append(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        if len(records) < n:  # evicted since the last refresh
            with self._lock:
                self._known.difference_update(h.value for h in hashes[len(records) : n])
        return out

    # ------------------------------------------------------------------ writes
    def save(self, block_hash: BlockHash, payload: torch.Tensor) -> None:
        """Queue a block for the store (nothing if it holds it or it is queued already)."""
        with self._lock:
            if block_hash.value in self._known or block_hash.value in self._queued:
                return
            self._queued.add(block_hash.value)
        if not enqueue(self._queue, self._lock, self._queued, block_hash, payload):
            self.counters.remote_dropped += 1

    def _send(self, blocks: list[tuple[BlockHash, torch.Tensor]]) -> None:
        """Encode blocks and put them in the store (one call; the writer thread's work)."""
        items = []
        for block_hash, payload in blocks:
            data = memoryview(payload.contiguous().numpy()).cast("B")
            items.append((block_hash.value, block_prefix(self.fingerprint, block_hash, data, self.layer_bytes) + bytes(data)))
        version = self._call(self.store.put.remote(self.fingerprint, items))
        with self._lock:
            # Known at once, unless the refresher has already read the log past this put: then it
            # applied the put's own events (a record too large for the store, one evicted at once)
            # and adding them now would undo those.
            if self._version < version:
                self._known.update(value for value, _ in items)
        self.counters.remote.saved += len(items)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued block has been sent; False on timeout."""
        return drained(self._queue, timeout_s)

    def close(self) -> None:
        """Send what is queued and stop both threads (idempotent)."""
        self._stop.set()
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join(timeout=30)

    def __del__(self) -> None:
        self._stop.set()
        with contextlib.suppress(Exception):
            self._queue.put_nowait(None)


def _ray_up() -> bool:
    """Ray is still initialised in this process (a call after shutdown would start a new one)."""
    import ray

    return ray.is_initialized()


def _refresh_loop(tier_ref: weakref.ref[RemoteTier], stop: threading.Event, every_s: float) -> None:
    while not stop.wait(every_s):
        tier = tier_ref()
        if tier is None or not _ray_up():
            return
        try:
            tier.refresh()
        except Exception as exc:  # noqa: BLE001 - a store that is gone: no remote hits, nothing breaks
            logger.debug("KV store index refresh failed: %s", exc)
        del tier


def _write_loop(tier_ref: weakref.ref[RemoteTier], q: queue.Queue) -> None:
    while True:
        item = q.get()
        batch = [item]
        while item is not None and len(batch) < _BATCH:
            try:
                item = q.get_nowait()
            except queue.Empty:
                break
            batch.append(item)
        blocks = [b for b in batch if b is not None]
        tier = tier_ref()
        try:
            if blocks and tier is not None and _ray_up():
                tier._send(blocks)
        except Exception:  # noqa: BLE001 - a store that is gone must not stop the engine
            logger.exception("KV store: sending %d blocks failed", len(blocks))
        finally:
            if tier is not None:
                with tier._lock:
                    tier._queued.difference_update(bh.value for bh, _ in blocks)
            for _ in batch:
                q.task_done()
        if tier is None or any(b is None for b in batch):
            return
        del tier
