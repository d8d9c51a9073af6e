"""Loading lower-tier prefix blocks into the KV pool layer by layer, beside the step's forward.

A step that admits a request whose prefix was found in a lower tier (kv_cache/tiers.py) must
write those blocks into their pool blocks before attention reads them. Done all at once, the
load sits in front of the forward: read every file, verify it, copy it, then compute the rest
of the prompt. The KV of layer l is only read by layer l's attention, so the loader here goes
layer-major instead, on a thread of its own: layer 0 of every block (read, checked against that
layer's CRC-32 in the block's header, copied), then layer 1, and so on (one read per
LAYERS_PER_READ layers), while the forward runs
layer 0 as soon as layer 0 has arrived and waits (`wait`) only where it would overtake the
loader. File reads (`os.preadv`) and zlib's CRC-32 release the GIL; the copies are NumPy stores into
views of the cache tensors, so the thread starts no torch parallel region of its own.

Verification stays complete: a block is used layer by layer only after that layer's bytes
match their CRC-32, and the header's identity (hash, parent, tokens, size) is checked before the
step is scheduled. A layer that fails (torn file, flipped bit, file gone) leaves that block's
layer unwritten; the loader still loads every other block in full, and `finish` names the failed
blocks. The engine then drops the step's results of every request whose block table holds one,
forgets the block's cached content and sends those requests back to the queue (they recompute
from the last good block): a bad block is counted and deleted, never served.

Whether it pays depends on a spare CPU: the loader's reads, checks and copies are CPU work, and
on a machine whose every CPU runs the forward's threads they only take turns with them (and
OpenMP's barriers wait for whichever thread was descheduled). `--kv-tier-load auto` therefore
loads beside the forward only when a CPU is spare; otherwise the same loader runs before it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from specserve.kv_cache.tiers import DiskRef, TieredKVStore, layer_digest, layer_spans

# Layers read from a block file in one call (then verified and written one by one): fewer, larger
# reads than one per layer, and as many layers as the model runs in one native call (LAYER_GROUP).
LAYERS_PER_READ = 4

# Writes one layer's bytes of one block: (layer index, block id, bytes as uint8 NumPy array).
LayerWriter = Callable[[int, int, np.ndarray], None]


class KVLoad(NamedTuple):
    """A lower tier's block to be written into a pool block before the step that reads it."""

    block_id: int
    payload: object  # torch.Tensor (uint8, verified) or DiskRef (verified as it is read)


class _Replaced(Exception):
    """The block file was replaced after its header was read."""


class LayerLoader:
    """Writes a step's KVLoads into the pool, layer-major; `start` runs it on a thread of its own,
    `finish` runs what is left on the caller's thread, waits for the thread, and reports."""

    def __init__(self, loads: Sequence[KVLoad], layer_bytes: Sequence[int], write: LayerWriter,
                 tiers: TieredKVStore | None) -> None:
        self.loads = list(loads)
        self.layer_bytes = list(layer_bytes)
        self.num_layers = len(self.layer_bytes)
        self.payload_bytes = sum(self.layer_bytes)
        self._offsets = [a for a, _ in layer_spans(self.layer_bytes)]
        self._write = write
        self._tiers = tiers
        self._ready = 0  # layers [0, ready) are in place for every block that has not failed
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self.failed: dict[int, str] = {}  # block id -> why
        self._vanished: set[int] = set()  # failed blocks whose file went away or changed: not damage
        self._bufs: dict[int, bytearray] = {}  # index in loads -> the payload read so far (disk refs)
        self._fds: dict[int, int] = {}
        self._replaced: set[int] = set()  # indexes in loads whose file is not the one looked up
        self._seconds: dict[int, float] = {}
        for load in self.loads:
            payload = load.payload
            if isinstance(payload, torch.Tensor):
                if payload.dtype != torch.uint8 or payload.numel() != self.payload_bytes:
                    raise RuntimeError(f"a KV block load for block {load.block_id} does not match this cache's layout")
            elif not isinstance(payload, DiskRef):
                raise RuntimeError(f"a KV block load for block {load.block_id} carries {type(payload).__name__}")

    @property
    def reads_disk(self) -> bool:
        """True when some block comes from a file (then overlapping the load with compute pays)."""
        return any(isinstance(load.payload, DiskRef) for load in self.loads)

    def start(self) -> bool:
        """Load on a background thread; the forward calls `wait` before each layer it runs. False
        (nothing started) when no thread can be started: then `finish` loads everything."""
        self._prefetch()
        thread = threading.Thread(target=self._run, name="specserve-kv-layer-load", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # "can't start new thread": the process is at its limit
            return False
        self._thread = thread
        return True

    def wait(self, num_layers: int) -> None:
        """Block until layers [0, num_layers) are in place."""
        if self._ready >= num_layers:
            return
        with self._cond:
            while self._ready < num_layers:
                self._cond.wait()

    def finish(self) -> dict[int, str]:
        """Complete every layer (on this thread unless `start` did), close the files, report each
        disk block to the tiers (loaded and promoted, or refused and deleted); returns the
        failed blocks: {block id: why}."""
        if self._thread is not None:
            self._thread.join()
        else:
            self._run()
        for i, load in enumerate(self.loads):
            ref = load.payload
            if not isinstance(ref, DiskRef) or self._tiers is None:
                continue
            if load.block_id in self._vanished:
                self._tiers.vanished(ref)
            elif load.block_id in self.failed:
                self._tiers.refused(ref, self.failed[load.block_id])
            else:
                self._tiers.loaded(ref, torch.frombuffer(self._bufs[i], dtype=torch.uint8), self._seconds.get(i, 0.0))
        return dict(self.failed)

    # ------------------------------------------------------------------ the loader
    def _run(self) -> None:
        try:
            for first in range(self._ready, self.num_layers, LAYERS_PER_READ):
                layers = range(first, min(first + LAYERS_PER_READ, self.num_layers))
                for i, load in enumerate(self.loads):
                    if load.block_id not in self.failed:
                        self._load(i, load, layers)
                with self._cond:
                    self._ready = layers.stop
                    self._cond.notify_all()
        except BaseException as exc:  # never leave the forward waiting: report every unfinished block
            for load in self.loads:
                self.failed.setdefault(load.block_id, f"loader failed: {type(exc).__name__}: {exc}")
            with self._cond:
                self._ready = self.num_layers
                self._cond.notify_all()
        finally:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def _load(self, i: int, load: KVLoad, layers: range) -> None:
        """These consecutive layers of one block: one read, then each layer verified and written
        in order (a layer that fails stops the block there)."""
        payload = load.payload
        if isinstance(payload, torch.Tensor):
            for layer in layers:
                start = self._offsets[layer]
                self._write(layer, load.block_id, payload[start : start + self.layer_bytes[layer]].numpy())
            return
        t0 = time.perf_counter()
        start = self._offsets[layers.start]
        end = self._offsets[layers.stop - 1] + self.layer_bytes[layers.stop - 1]
        try:
            got = self._read(i, payload, start, end)
        except FileNotFoundError:  # another process sharing the directory evicted it
            self._vanish(load.block_id, "its file was removed after the lookup")
            return
        except _Replaced:
            self._vanish(load.block_id, "its file was replaced after the lookup")
            return
        except OSError as exc:
            self.failed[load.block_id] = f"unreadable: {exc}"
            return
        buf = self._bufs[i]
        for layer in layers:
            a, n = self._offsets[layer], self.layer_bytes[layer]
            if got < a + n - start or layer_digest(memoryview(buf)[a : a + n]) != payload.layer_digests[layer]:
                self.failed[load.block_id] = f"layer {layer} is short or fails its digest"
                return
            self._write(layer, load.block_id, np.frombuffer(buf, dtype=np.uint8, count=n, offset=a))
        self._seconds[i] = self._seconds.get(i, 0.0) + time.perf_counter() - t0

    def _vanish(self, block_id: int, why: str) -> None:
        self.failed[block_id] = why
        self._vanished.add(block_id)

    def _read(self, i: int, ref: DiskRef, start: int, end: int) -> int:
        """Read payload bytes [start, end) of a block file into its buffer; returns bytes read."""
        fd = self._fds.get(i)
        if fd is None:
            fd = self._open(i, ref)
        if i in self._replaced:
            raise _Replaced
        return os.preadv(fd, [memoryview(self._bufs[i])[start:end]], ref.payload_offset + start)

    def _open(self, i: int, ref: DiskRef) -> int:
        """Open a block file once; the descriptor keeps reading that file even if another process
        renames a new one over it, so it only has to be the file the lookup read (same inode:
        else _Replaced on the first read)."""
        fd = self._fds[i] = os.open(ref.path, os.O_RDONLY)
        self._bufs[i] = bytearray(self.payload_bytes)
        st = os.fstat(fd)
        if ref.file_id != (0, 0) and (st.st_dev, st.st_ino) != ref.file_id:
            self._replaced.add(i)
        return fd

    def _prefetch(self) -> None:
        """Ask the OS to start reading every file now (POSIX_FADV_WILLNEED), so a cold block's
        later layers arrive while its first ones are used; a file that is gone fails when read."""
        for i, load in enumerate(self.loads):
            ref = load.payload
            if not isinstance(ref, DiskRef):
                continue
            try:
                fd = self._open(i, ref)
            except OSError:
                continue
            if hasattr(os, "posix_fadvise"):
                with contextlib.suppress(OSError):  # a hint: a file system that refuses it is read as it comes
                    os.posix_fadvise(fd, ref.payload_offset, self.payload_bytes, os.POSIX_FADV_WILLNEED)
