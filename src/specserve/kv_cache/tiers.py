"""Lower tiers of the prefix cache: host memory, then local disk (then, in a disaggregated
deployment with --kv-store-gib, the deployment's store across hosts: `remote.py`).

The working pool (`block_pool.py`) holds the KV the model reads; when its free blocks are
handed out again their cached prefixes are gone. The tiers keep them:

- **Write-through, inclusive.** Every block the prefix cache registers (full, verified KV:
  never a draft's) is copied once, after the step that completed it, into the host tier and
  queued for the disk tier. A block is immutable while it is registered, so the copy needs no
  coordination with eviction: when the pool later reuses the block, the tiers already have it.
- **Host tier**: an LRU of payloads in process memory, bounded in bytes (`--kv-host-gib`).
- **Disk tier**: one self-verifying file per block under `--kv-disk-dir`, in a folder per
  model fingerprint, LRU by last use, bounded in bytes (`--kv-disk-gib`). A background thread
  writes each file to a temporary name and renames it into place, so a crash (kill -9) leaves
  at worst a temporary file, deleted at the next start. The directory is its own index: the
  next process scans the file headers and starts warm.
- **Verified on every use.** A disk file holds its block's chained hash, parent hash and token
  ids, a CRC-32 of each layer's bytes and a BLAKE2b digest over all of that and the payload; a
  hit must match the requested block exactly (hash, parent and tokens) and its checks, else it
  is counted as corrupt, deleted and treated as a miss, never served. Payload sizes are checked
  against the layout.

A hit in a lower tier becomes a fresh pool block registered under its hash; the runner writes
the payload into it in the step that first uses it (`SchedulerOutput.kv_loads`), so the request
counts those tokens as computed and prefills only the rest. A disk hit is checked only up to its
header when the step is scheduled (`DiskTier.locate`): its layers are read and checked against
their CRC-32 as the step loads them (`layer_load.LayerLoader`, layer by layer beside the forward
where a CPU is spare), and a block that fails then voids the step for the requests holding it,
which are requeued and recompute it. A direct `fetch` (and a file from before per-layer checks)
verifies the whole record's BLAKE2b instead.

Why files rather than a database for the disk index: a block file names and checks itself, so
there is nothing that can disagree with the data after a crash; SQLite (or diskcache on top of
it) would add a second record that a kill -9 can leave out of step with the files.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import itertools
import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from specserve.kv_cache.block_pool import BlockHash, chain_hash

logger = logging.getLogger(__name__)

MAGIC = b"SPECSERVE-KV\x01"
SUFFIX = ".kvb"
_HEADER_LEN = struct.Struct("<I")
_WRITE_QUEUE = 4096  # blocks waiting for the disk writer; beyond it new saves skip the disk
_SYNC_EVERY = 32  # a writer re-reads the shared directory's size after this many of its own writes


class DiskRef(NamedTuple):
    """A block file whose header names the requested block and promises a whole payload: read and
    verified layer by layer when the step that uses it runs (`LayerLoader`)."""

    block_hash: BlockHash
    path: Path
    payload_offset: int  # where the payload starts in the file
    layer_digests: tuple[int, ...]  # CRC-32 per layer of the payload; empty for a file without them
    # (device, inode) of the file whose header was read: a writer renames a new file into place,
    # so a replaced file has another inode (its mtime is no help: every read touches it)
    file_id: tuple[int, int] = (0, 0)


class TierBlock(NamedTuple):
    """A prefix block found in a lower tier: verified and in host memory, or (from the disk tier,
    for a step that loads layer by layer) a reference to its file, verified as it is read."""

    block_hash: BlockHash
    payload: torch.Tensor | DiskRef  # uint8, the block's K/V (and scales) of every layer, as the runner packs them
    tier: str  # "host", "disk" or "remote": where it was found


@dataclass
class TierStats:
    """Counters of one tier (blocks and bytes found, time spent loading)."""

    hits: int = 0
    hit_bytes: int = 0
    load_s: float = 0.0
    saved: int = 0


@dataclass
class TierCounters:
    """What the tiers did, for metrics and benchmarks."""

    host: TierStats = field(default_factory=TierStats)
    disk: TierStats = field(default_factory=TierStats)
    remote: TierStats = field(default_factory=TierStats)
    corrupt: int = 0  # disk files / store records refused (digest, header or size wrong, another block's content)
    disk_dropped: int = 0  # saves that skipped the disk because its writer fell behind
    disk_failed: int = 0  # saves the disk refused (full, read-only, removed): nothing of them is left there
    remote_dropped: int = 0  # saves that skipped the remote store because its sender fell behind


def _digest(header: dict, payload: memoryview | bytes) -> str:
    h = hashlib.blake2b(digest_size=32)
    h.update(json.dumps(header, sort_keys=True, separators=(",", ":")).encode())
    h.update(payload)
    return h.hexdigest()


def _writer_alive(tmp_name: str) -> bool:
    """Whether the process that names this temporary file (NAME.kvb.PID.THREAD.tmp) still runs."""
    try:
        pid = int(tmp_name.split(".")[-3])
    except (IndexError, ValueError):
        return False
    if pid == os.getpid():
        return False  # this process is only starting: nothing of its own is in flight
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's
    return True


def _header_length(head: bytes | memoryview) -> int:
    if len(head) < len(MAGIC) + _HEADER_LEN.size or bytes(head[: len(MAGIC)]) != MAGIC:
        raise ValueError("not a specserve KV block")
    (n,) = _HEADER_LEN.unpack_from(head, len(MAGIC))
    if n > 1 << 24:
        raise ValueError("header too long")
    return n


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_header(raw: bytes | memoryview, fingerprint: str) -> dict:
    """A block header's fields, refused (ValueError) when written for another model, incomplete,
    or holding a field of the wrong kind: whatever bytes a file or a store entry holds, reading
    its header raises nothing else (a header nested past the recursion limit included)."""
    try:
        header = json.loads(bytes(raw))
    except RecursionError as exc:
        raise ValueError("header nested too deeply") from exc
    if not isinstance(header, dict) or header.get("fingerprint") != fingerprint:
        raise ValueError("written for another model or layout")
    for key in ("value", "parent", "tokens", "digest", "payload_bytes"):
        if key not in header:
            raise ValueError(f"header lacks {key}")
    tokens, crcs = header["tokens"], header.get("layer_crc32", [])
    if not (_is_int(header["value"]) and (header["parent"] is None or _is_int(header["parent"]))
            and isinstance(tokens, list) and all(_is_int(t) for t in tokens)
            and isinstance(header["digest"], str) and _is_int(header["payload_bytes"])
            and isinstance(crcs, list) and all(_is_int(c) for c in crcs)):
        raise ValueError("header fields of the wrong kind")
    return header


def layer_digest(data: memoryview | bytes) -> int:
    """The check a block record keeps of one layer's bytes: CRC-32. It catches every error burst
    up to 32 bits and any other damage but for 2^-32 per layer, at 7.2 GB/s against BLAKE2b's 1.35
    (zlib vs hashlib on a Zen 4 core), which decides how fast a disk hit loads; a whole-record
    BLAKE2b would add nothing against someone who can write the directory (it is not keyed), and
    the header's identity fields (chained hash, parent, tokens) are compared exactly."""
    return zlib.crc32(data)


def layer_spans(layer_bytes: Sequence[int]) -> list[tuple[int, int]]:
    """(start, end) of each layer's bytes in a payload split into layers of these sizes."""
    bounds = [0, *itertools.accumulate(layer_bytes)]
    return list(zip(bounds, bounds[1:]))


def check_block(header: dict, block_hash: BlockHash, payload_bytes: int, stored_bytes: int) -> None:
    """ValueError unless a record's header (check_header's) names exactly this block and promises a
    payload of this layout's size, which is what the record holds (`stored_bytes`)."""
    if not (header["value"] == block_hash.value and header["parent"] == block_hash.parent_value
            and tuple(header["tokens"]) == block_hash.token_ids):
        raise ValueError("another block's record")
    if not header["payload_bytes"] == payload_bytes == stored_bytes:
        raise ValueError("payload size differs from the layout (a torn or foreign record)")


def block_prefix(fingerprint: str, block_hash: BlockHash, data: memoryview,
                 layer_bytes: Sequence[int] | None = None) -> bytes:
    """The self-verifying record of one block, up to its payload: magic, header length, header
    (the model's fingerprint, chained hash, parent, tokens, payload size, and a BLAKE2b digest
    over the header and the payload). A disk file and a remote store entry are prefix + payload.

    With `layer_bytes` (the payload's split into layers, in order) the header also holds a
    CRC-32 of each layer's bytes, so a reader can verify and use layer 0 before reading layer 1
    (`LayerLoader`); the whole-record digest covers those too."""
    header: dict[str, Any] = {"fingerprint": fingerprint, "value": block_hash.value, "parent": block_hash.parent_value,
                              "tokens": list(block_hash.token_ids), "payload_bytes": len(data)}
    if layer_bytes is not None:
        if sum(layer_bytes) != len(data):
            raise ValueError(f"layers of {sum(layer_bytes)} bytes for a payload of {len(data)}")
        header["layer_crc32"] = [layer_digest(data[a:b]) for a, b in layer_spans(layer_bytes)]
    header["digest"] = _digest(header, data)
    blob = json.dumps(header, separators=(",", ":")).encode()
    return MAGIC + _HEADER_LEN.pack(len(blob)) + blob


def verified_payload(record: bytes | memoryview, fingerprint: str, block_hash: BlockHash,
                     payload_bytes: int, layer_bytes: Sequence[int] | None = None) -> memoryview:
    """The payload of a block record (block_prefix + payload) if it is exactly this block of this
    model, whole and unaltered; ValueError otherwise. With `layer_bytes` (this cache's layout) and
    a record that carries per-layer CRC-32s, those are checked instead of the BLAKE2b (5x faster;
    see layer_digest for why that is enough)."""
    view = memoryview(record)
    offset = len(MAGIC) + _HEADER_LEN.size
    n = _header_length(view)
    data = view[offset + n :]
    header = check_header(view[offset : offset + n], fingerprint)
    check_block(header, block_hash, payload_bytes, len(data))
    claimed = header.pop("digest")
    crcs = header.get("layer_crc32")
    if layer_bytes is not None and isinstance(crcs, list) and len(crcs) == len(layer_bytes):
        for layer, (a, b) in enumerate(layer_spans(layer_bytes)):
            if layer_digest(data[a:b]) != crcs[layer]:
                raise ValueError(f"layer {layer} fails its CRC")
        return data
    if _digest(header, data) != claimed:
        raise ValueError("digest mismatch")
    return data


def enqueue(q: queue.Queue, lock: threading.Lock, queued: set[int], block_hash: BlockHash,
            payload: torch.Tensor) -> bool:
    """Hand a block (already marked in `queued`) to a writer thread; when its queue is full, unmark
    it and return False (the save is dropped: a writer that fell behind never blocks the engine)."""
    try:
        q.put_nowait((block_hash, payload))
        return True
    except queue.Full:
        with lock:
            queued.discard(block_hash.value)
        return False


def drained(q: queue.Queue, timeout_s: float) -> bool:
    """Wait until a writer thread has finished every item of its queue; False on timeout."""
    deadline = time.monotonic() + timeout_s
    while q.unfinished_tasks:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _delete(path: Path) -> bool:
    """Delete a block file if it is there and can be (True: it is gone): a folder that turned
    read-only leaves it in place and never fails the step (a file is verified whenever it is read)."""
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        logger.warning("KV disk tier: cannot delete %s (%s)", path, exc.strerror or exc)
        return False
    return True


def _check_writable(directory: Path) -> None:
    """Create the disk tier's directory, tried by writing first (files.output_dir), or raise a
    ConfigError that says which directory and why: a tier that cannot write is found at start."""
    from specserve.errors import ConfigError
    from specserve.files import output_dir

    try:
        output_dir(directory, "--kv-disk-dir")
        directory.mkdir(parents=True, exist_ok=True)
    except (ConfigError, OSError) as exc:
        raise ConfigError(f"the KV disk tier cannot write to {directory} ({getattr(exc, 'strerror', None) or exc}); "
                          "give --kv-disk-dir a writable directory, or leave it out for no disk tier.") from None


def block_file_name(value: int) -> str:
    """The disk tier's file name of the block whose chained hash is `value`."""
    return f"{value & 0xFFFFFFFFFFFFFFFF:016x}{SUFFIX}"


def _file_name(block_hash: BlockHash) -> str:
    return block_file_name(block_hash.value)


class HostTier:
    """Payloads in process memory, least recently used dropped first beyond `capacity_bytes`."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._blocks: OrderedDict[int, tuple[BlockHash, torch.Tensor]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def contains(self, block_hash: BlockHash) -> bool:
        """True if this exact block is held."""
        entry = self._blocks.get(block_hash.value)
        return entry is not None and entry[0] == block_hash

    def get(self, block_hash: BlockHash) -> torch.Tensor | None:
        """The payload of this exact block (marked most recently used), or None."""
        entry = self._blocks.get(block_hash.value)
        if entry is None or entry[0] != block_hash:
            return None
        self._blocks.move_to_end(block_hash.value)
        return entry[1]

    def put(self, block_hash: BlockHash, payload: torch.Tensor) -> None:
        """Keep a payload, dropping the least recently used ones to stay within capacity."""
        size = payload.numel()
        if size > self.capacity_bytes:
            return
        old = self._blocks.pop(block_hash.value, None)
        if old is not None:
            self.used_bytes -= old[1].numel()
        self._blocks[block_hash.value] = (block_hash, payload)
        self.used_bytes += size
        while self.used_bytes > self.capacity_bytes:
            _, (_, dropped) = self._blocks.popitem(last=False)
            self.used_bytes -= dropped.numel()

    def clear(self) -> int:
        """Drop everything; returns how many blocks were held."""
        n = len(self._blocks)
        self._blocks.clear()
        self.used_bytes = 0
        return n


class _DiskEntry(NamedTuple):
    block_hash: BlockHash
    path: Path
    size: int


class DiskTier:
    """One verified file per block under root/<fingerprint>/, LRU within `capacity_bytes`.

    Processes sharing the directory (the workers of one host) share the limit too: each keeps
    its own index (held to the limit as it writes), and every _SYNC_EVERY writes a writer lists
    the directory and deletes the least recently used files of any process until
    the whole directory fits (a read touches its file, so a file's mtime is its last use). Between
    two such passes the directory can exceed the limit by what the writers wrote since.
    """

    def __init__(self, root: str | Path, fingerprint: str, capacity_bytes: int, payload_bytes: int,
                 counters: TierCounters, layer_bytes: Sequence[int] | None = None) -> None:
        self.dir = Path(root) / fingerprint[:24]
        _check_writable(self.dir)
        self.fingerprint = fingerprint
        self.capacity_bytes = capacity_bytes
        self.payload_bytes = payload_bytes
        self.layer_bytes = None if layer_bytes is None else tuple(layer_bytes)
        self.counters = counters
        self.used_bytes = 0
        self._lock = threading.Lock()
        self._index: OrderedDict[int, _DiskEntry] = OrderedDict()  # least recently used first
        self._queue: queue.Queue[tuple[BlockHash, torch.Tensor] | None] = queue.Queue(_WRITE_QUEUE)
        self._queued: set[int] = set()
        self._writes_since_sync = 0
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="specserve-kv-disk", daemon=True)
        self._writer.start()
        atexit.register(self.close)  # queued blocks reach the disk when the process exits normally

    # ------------------------------------------------------------------ start-up
    def _scan(self) -> None:
        """Index the files a previous process left (oldest use first); delete temporaries and
        files whose header does not read back."""
        found: list[tuple[float, _DiskEntry]] = []
        for path in self.dir.iterdir():
            if path.name.endswith(".tmp"):
                if not _writer_alive(path.name):  # a write cut off by a crash
                    _delete(path)
                continue  # another live process sharing the directory is writing it
            if not path.name.endswith(SUFFIX):
                continue
            try:
                header, _, st = self._read_header(path)
            except (OSError, ValueError) as exc:
                logger.warning("KV disk tier: ignoring unreadable %s (%s)", path.name, exc)
                self.counters.corrupt += 1
                _delete(path)
                continue
            bh = BlockHash(header["value"], header["parent"], tuple(header["tokens"]))
            if chain_hash(bh.parent_value, bh.token_ids) != bh.value or path.name != _file_name(bh):  # not the block it names
                logger.warning("KV disk tier: %s holds tokens that do not hash to its block; deleted", path.name)
                self.counters.corrupt += 1
                _delete(path)
                continue
            found.append((st.st_mtime, _DiskEntry(bh, path, st.st_size)))
        for _, entry in sorted(found, key=lambda x: x[0]):
            self._index[entry.block_hash.value] = entry
            self.used_bytes += entry.size
        self._shrink()

    def _read_header(self, path: Path) -> tuple[dict, int, os.stat_result]:
        """The header of a block file (its first bytes only), where its payload starts, and the
        file's status."""
        with path.open("rb") as f:
            head = f.read(len(MAGIC) + _HEADER_LEN.size)
            n = _header_length(head)
            return check_header(f.read(n), self.fingerprint), len(MAGIC) + _HEADER_LEN.size + n, os.fstat(f.fileno())

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def _entry(self, block_hash: BlockHash) -> _DiskEntry | None:
        """The index entry of this exact block; a file another process sharing the directory
        wrote since this one started is picked up here (its content is verified when read)."""
        with self._lock:
            entry = self._index.get(block_hash.value)
        if entry is None:
            path = self.dir / _file_name(block_hash)
            try:
                size = path.stat().st_size
            except OSError:
                return None
            entry = _DiskEntry(block_hash, path, size)
            with self._lock:
                if block_hash.value not in self._index:
                    self._index[block_hash.value] = entry
                    self.used_bytes += size
                entry = self._index[block_hash.value]
        return entry if entry.block_hash == block_hash else None

    def contains(self, block_hash: BlockHash) -> bool:
        """True if a file claims this exact block (verified only when read)."""
        return self._entry(block_hash) is not None

    def read(self, block_hash: BlockHash) -> torch.Tensor | None:
        """The verified payload of this exact block, or None (missing, or corrupt: then deleted)."""
        entry = self._entry(block_hash)
        if entry is None:
            return None
        with self._lock:
            if block_hash.value in self._index:
                self._index.move_to_end(block_hash.value)
        try:
            blob = entry.path.read_bytes()
        except FileNotFoundError:  # another process sharing the directory evicted it: a miss
            self._forget(block_hash.value, entry)
            return None
        except OSError as exc:
            logger.warning("KV disk tier: %s unreadable (%s)", entry.path.name, exc)
            blob = b""
        try:
            data = verified_payload(blob, self.fingerprint, block_hash, self.payload_bytes, self.layer_bytes)
        except (ValueError, KeyError, TypeError) as exc:
            self.refuse(entry.path, block_hash, str(exc))
            return None
        self.touch(entry.path)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)  # a writable copy of its own

    def locate(self, block_hash: BlockHash) -> DiskRef | None:
        """This exact block's file, for a reader that verifies it layer by layer: its header is read
        and checked now (the block's identity, the payload size, the file's length), its payload
        later. None when there is no such file or its header is refused (then deleted, counted)."""
        entry = self._entry(block_hash)
        if entry is None:
            return None
        try:
            header, offset, st = self._read_header(entry.path)
            check_block(header, block_hash, self.payload_bytes, st.st_size - offset)
            layers = tuple(header.get("layer_crc32", ()))
            if layers and (self.layer_bytes is None or len(layers) != len(self.layer_bytes)
                           or not all(isinstance(d, int) for d in layers)):
                raise ValueError("layer digests do not match the layout")
        except FileNotFoundError:
            self._forget(block_hash.value, entry)
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self.refuse(entry.path, block_hash, str(exc))
            return None
        with self._lock:
            if block_hash.value in self._index:
                self._index.move_to_end(block_hash.value)
        return DiskRef(block_hash, entry.path, offset, layers, (st.st_dev, st.st_ino))

    def refuse(self, path: Path, block_hash: BlockHash, why: str) -> None:
        """Count a block file that failed verification and delete it: it is never served."""
        self.counters.corrupt += 1
        with self._lock:
            entry = self._index.get(block_hash.value)
        if entry is not None and entry.path == path:
            gone = self._remove(block_hash.value, entry)
        else:
            gone = _delete(path)
        logger.warning("KV disk tier: %s refused (%s); %s, the prefix is recomputed", path.name, why,
                       "deleted" if gone else "left in place")

    def vanished(self, block_hash: BlockHash) -> None:
        """A block file another process removed or replaced after this one read its header: a
        miss, not damage (the index forgets it; a replaced file is found again by name)."""
        with self._lock:
            entry = self._index.get(block_hash.value)
        if entry is not None:
            self._forget(block_hash.value, entry)

    @staticmethod
    def touch(path: Path) -> None:
        """Mark a file used now (its mtime orders the next start's LRU)."""
        with contextlib.suppress(OSError):
            os.utime(path)

    def _forget(self, value: int, entry: _DiskEntry) -> None:
        """Drop the index entry of a file another process sharing the directory removed."""
        with self._lock:
            if self._index.get(value) is entry:
                del self._index[value]
                self.used_bytes -= entry.size

    # ------------------------------------------------------------------ writes
    def save(self, block_hash: BlockHash, payload: torch.Tensor) -> None:
        """Queue a block for writing (nothing if it is on disk or queued already)."""
        with self._lock:
            if block_hash.value in self._queued:
                return
            entry = self._index.get(block_hash.value)
            if entry is not None and entry.block_hash == block_hash:
                return
            self._queued.add(block_hash.value)
        if not enqueue(self._queue, self._lock, self._queued, block_hash, payload):
            self.counters.disk_dropped += 1

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception as exc:  # noqa: BLE001 - a full or broken disk must not stop the engine
                self.counters.disk_failed += 1
                if self.counters.disk_failed in (1, 10) or self.counters.disk_failed % 1000 == 0:  # not once a block
                    logger.warning("KV disk tier: writing a block failed (%s; %d so far): such blocks are not kept on disk, "
                                   "the engine goes on", exc, self.counters.disk_failed)
            finally:
                if item is not None:
                    with self._lock:
                        self._queued.discard(item[0].value)
                self._queue.task_done()

    def _write(self, block_hash: BlockHash, payload: torch.Tensor) -> None:
        data = memoryview(payload.contiguous().numpy()).cast("B")
        prefix = block_prefix(self.fingerprint, block_hash, data, self.layer_bytes)
        path = self.dir / _file_name(block_hash)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with tmp.open("wb") as f:
                f.write(prefix)
                f.write(data)
            os.replace(tmp, path)  # atomic: readers see the old file or the whole new one
        except BaseException:  # a full disk: no part of the block stays behind
            _delete(tmp)
            raise
        size = len(prefix) + len(data)
        with self._lock:
            old = self._index.pop(block_hash.value, None)
            if old is not None:
                self.used_bytes -= old.size
            self._index[block_hash.value] = _DiskEntry(block_hash, path, size)
            self.used_bytes += size
        self.counters.disk.saved += 1
        self._writes_since_sync += 1
        if self._writes_since_sync >= _SYNC_EVERY:
            self.sync_with_directory()
        self._shrink()

    def sync_with_directory(self) -> int:
        """Hold the whole shared directory to the limit: delete the least recently used block files
        of any process until it fits, and forget the own entries whose files are gone (another
        process removed them). Returns the directory's bytes after."""
        self._writes_since_sync = 0
        files: list[tuple[float, int, Path]] = []
        with contextlib.suppress(OSError), os.scandir(self.dir) as it:
            for de in it:
                if de.name.endswith(SUFFIX):
                    with contextlib.suppress(OSError):  # removed meanwhile
                        st = de.stat()
                        files.append((st.st_mtime, st.st_size, Path(de.path)))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files, key=lambda f: f[0]):
            if total <= self.capacity_bytes:
                break
            _delete(path)
            total -= size
        with self._lock:
            for value, entry in list(self._index.items()):
                if not entry.path.exists():
                    del self._index[value]
                    self.used_bytes -= entry.size
        return total

    def _shrink(self) -> None:
        while True:
            with self._lock:
                if self.used_bytes <= self.capacity_bytes or not self._index:
                    return
                value, entry = next(iter(self._index.items()))
            self._remove(value, entry)

    def _remove(self, value: int, entry: _DiskEntry) -> bool:
        with self._lock:
            if self._index.get(value) is entry:
                del self._index[value]
                self.used_bytes -= entry.size
        return _delete(entry.path)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued block is written; False on timeout."""
        return drained(self._queue, timeout_s)

    def clear(self) -> int:
        """Delete every block file of this fingerprint; returns how many."""
        self.flush()
        with self._lock:
            entries = list(self._index.values())
            self._index.clear()
            self.used_bytes = 0
        for e in entries:
            _delete(e.path)
        return len(entries)

    def close(self) -> None:
        """Finish queued writes and stop the writer (idempotent)."""
        atexit.unregister(self.close)
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join(timeout=60)


class TieredKVStore:
    """The host, disk and remote tiers behind the working pool (any may be absent)."""

    def __init__(self, fingerprint: str, payload_bytes: int, *, host_bytes: int = 0,
                 disk_dir: str | Path | None = None, disk_bytes: int = 0, remote_store: Any = None,
                 layer_bytes: Sequence[int] | None = None) -> None:
        """`layer_bytes`: how a payload splits into layers (the runner's layout); with it, disk
        files carry per-layer digests and a disk hit can be loaded layer by layer."""
        self.fingerprint = fingerprint
        self.payload_bytes = payload_bytes
        self.layer_bytes = None if layer_bytes is None else tuple(layer_bytes)
        self.counters = TierCounters()
        self.host = HostTier(host_bytes) if host_bytes > 0 else None
        self.disk = (DiskTier(disk_dir, fingerprint, disk_bytes, payload_bytes, self.counters, layer_bytes)
                     if disk_dir is not None and disk_bytes > 0 else None)
        self.remote = None
        if remote_store is not None:  # the deployment's store (kv_cache/remote.py): Ray only then
            from specserve.kv_cache.remote import RemoteTier

            self.remote = RemoteTier(remote_store, fingerprint, payload_bytes, self.counters, layer_bytes=layer_bytes)

    def contains(self, block_hash: BlockHash) -> bool:
        """True if some tier holds (or claims) this exact block."""
        return ((self.host is not None and self.host.contains(block_hash))
                or (self.disk is not None and self.disk.contains(block_hash))
                or (self.remote is not None and self.remote.contains(block_hash)))

    def fetch_run(self, hashes: list[BlockHash], *, deferred: bool = False) -> list[TierBlock]:
        """The leading run of these blocks that the tiers hold, each verified: host and disk block
        by block, then what the remote store holds of the rest in one call (promoted to host).
        `deferred`: disk hits come as DiskRefs, read and verified when their step runs."""
        out: list[TierBlock] = []
        for block_hash in hashes:
            found = self.fetch(block_hash, deferred=deferred)
            if found is None:
                break
            out.append(found)
        rest = hashes[len(out):]
        if self.remote is not None and rest and self.remote.contains(rest[0]):
            t0 = time.perf_counter()
            payloads = self.remote.fetch_run(rest)
            for block_hash, payload in zip(rest, payloads):
                if self.host is not None:
                    self.host.put(block_hash, payload)
                out.append(TierBlock(block_hash, payload, "remote"))
            st = self.counters.remote
            st.hits += len(payloads)
            st.hit_bytes += sum(p.numel() for p in payloads)
            st.load_s += time.perf_counter() - t0
        return out

    def fetch(self, block_hash: BlockHash, *, deferred: bool = False) -> TierBlock | None:
        """This exact block from the highest tier holding it, verified; a disk hit is promoted.
        `deferred`: a disk hit whose file has per-layer digests comes as a DiskRef whose header is
        checked; its payload is read and verified by the step's LayerLoader, which reports back
        through `loaded` or `refused`."""
        t0 = time.perf_counter()
        if self.host is not None:
            payload = self.host.get(block_hash)
            if payload is not None:
                self._count(self.counters.host, payload, t0)
                return TierBlock(block_hash, payload, "host")
        if self.disk is not None:
            if deferred:
                ref = self.disk.locate(block_hash)
                if ref is None:
                    return None
                if ref.layer_digests:
                    return TierBlock(block_hash, ref, "disk")
            payload = self.disk.read(block_hash)
            if payload is not None:
                if self.host is not None:
                    self.host.put(block_hash, payload)
                self._count(self.counters.disk, payload, t0)
                return TierBlock(block_hash, payload, "disk")
        return None

    def loaded(self, ref: DiskRef, payload: torch.Tensor, seconds: float) -> None:
        """A deferred disk hit was read and every layer verified: count it, promote it to host."""
        st = self.counters.disk
        st.hits += 1
        st.hit_bytes += payload.numel()
        st.load_s += seconds
        if self.host is not None:
            self.host.put(ref.block_hash, payload)
        DiskTier.touch(ref.path)

    def vanished(self, ref: DiskRef) -> None:
        """A deferred disk hit whose file was removed or replaced between its lookup and its load."""
        assert self.disk is not None  # a DiskRef comes from the disk tier
        self.disk.vanished(ref.block_hash)

    def refused(self, ref: DiskRef, why: str) -> None:
        """A deferred disk hit failed verification while its step loaded it: counted, deleted."""
        assert self.disk is not None  # a DiskRef comes from the disk tier
        self.disk.refuse(ref.path, ref.block_hash, why)

    @staticmethod
    def _count(stats: TierStats, payload: torch.Tensor, t0: float) -> None:
        stats.hits += 1
        stats.hit_bytes += payload.numel()
        stats.load_s += time.perf_counter() - t0

    def save(self, block_hash: BlockHash, payload: torch.Tensor) -> None:
        """Keep a newly registered block in every tier."""
        if payload.numel() != self.payload_bytes:
            raise ValueError(f"a KV block payload of {payload.numel()} bytes, expected {self.payload_bytes}")
        if self.host is not None:
            self.host.put(block_hash, payload)
            self.counters.host.saved += 1
        if self.disk is not None:
            self.disk.save(block_hash, payload)
        if self.remote is not None:
            self.remote.save(block_hash, payload)

    def stats(self) -> dict[str, float]:
        """Flat counters and sizes for metrics."""
        c = self.counters
        out: dict[str, float] = {"corrupt_blocks": c.corrupt, "disk_dropped_blocks": c.disk_dropped,
                                 "disk_failed_blocks": c.disk_failed, "remote_dropped_blocks": c.remote_dropped}
        for name, tier, st in (("host", self.host, c.host), ("disk", self.disk, c.disk),
                               ("remote", self.remote, c.remote)):
            if tier is None:
                continue
            out |= {f"{name}_hits": st.hits, f"{name}_hit_bytes": st.hit_bytes, f"{name}_load_s": st.load_s,
                    f"{name}_saved": st.saved, f"{name}_blocks": len(tier), f"{name}_used_bytes": tier.used_bytes,
                    f"{name}_capacity_bytes": tier.capacity_bytes}
        return out

    def clear(self) -> int:
        """Forget every block of this process's tiers (disk files deleted; the deployment's remote
        store, shared with other workers, is left as it is); returns how many were held."""
        n = self.host.clear() if self.host is not None else 0
        return n + (self.disk.clear() if self.disk is not None else 0)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait for queued disk writes and remote sends."""
        disk = self.disk.flush(timeout_s) if self.disk is not None else True
        return (self.remote.flush(timeout_s) if self.remote is not None else True) and disk

    def close(self) -> None:
        """Finish disk writes and remote sends; the store is not used afterwards."""
        if self.disk is not None:
            self.disk.close()
        if self.remote is not None:
            self.remote.close()
