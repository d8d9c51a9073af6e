"""KV page memory: zero-filled tensors whose pages the operating system zeroes on first touch.

A paged cache is allocated whole at start-up (`--kv-cache-gib`) and must read as zeros where
nothing was written (masked slots are still multiplied by a zero weight). `torch.zeros` writes
every byte up front: about a second per GiB on a 2-core VM, paid by every engine start, and the
whole budget is resident from then on. On the CPU the cache is instead an anonymous memory map:
the kernel hands out zero pages as they are first written, so start-up costs nothing and
resident memory grows with the KV actually used. Other devices allocate as before.

Maps of 2 MiB or more are aligned to 2 MiB and advised as huge pages (where transparent huge
pages are `madvise`-only, as on many distributions, no torch allocation gets them): decode
attention gathers every key and value row of a long context, a TLB miss every 4 KiB and a page
edge the prefetchers stop at. Resident memory then grows by 2 MiB pages as blocks are first
written. ``$SPECSERVE_KV_HUGE=0`` keeps 4 KiB pages.

A first write into a huge page zeroes all 2 MiB of it (~5 ms on a 2-vCPU VM). Every layer's K and
V hold the same block ids, so with every part starting on a boundary the block that first crosses
into a new 2 MiB of each crossed it in all of them in one step: Qwen2.5 1.5B's 56 parts faulted
112 MiB at once, a 0.3 s decode step (0.27-0.33 s of it in the kernel's clear_page) every ~4,096
tokens of new KV, where the steps around it took 60 ms. The runner therefore staggers its parts:
each starts its own fraction of a huge page past a boundary, so the same faults fall on different
blocks, a few milliseconds each. The huge page a part starts in is advised too (every block keeps
its huge pages), so the gap before the start is resident with the first block: on average half a
huge page a part (Qwen2.5 1.5B: 56 MiB).

Staggered, the zeroing is spread, not gone: during the pool's first fill it lands on ~9% of a
SmolLM2 batch-8 loop's decode steps (two runs each: mean step 9.07 / 8.92 ms against 8.07 / 8.65
with the pool faulted in beforehand, p99 21.1 / 21.4 against 9.6 / 24.7), and a 2,000-token
prefill writes 46 MiB of new pages (2.30-2.55 s against 2.02-2.32 s). A server is often
idle between requests, so its engine thread faults in, while idle, the pages the next allocations
will write (KVPrefaulter: `madvise(MADV_POPULATE_WRITE)`, which leaves their contents as they are),
a bounded window ahead of the highest block the pool has handed out, so resident memory still
follows the KV used. ``$SPECSERVE_KV_PREFAULT=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import mmap
import os
import time

import torch

from specserve.kernels import HUGE_PAGE, madvise

logger = logging.getLogger(__name__)


class LayerKV(tuple):
    """One layer's paged KV cache: K and V pages [num_blocks, block_size, n_kv, d], and for an
    int8 cache their per-(slot, head) float32 scales [num_blocks, block_size, n_kv] after them.

    A tuple of exactly the tensors present (k, v[, k_scale, v_scale]): the code that moves KV as
    bytes (tier files, transfers, slot moves, native calls) iterates the parts in this order
    without caring what they are; attention asks for them by name."""

    __slots__ = ()

    def __new__(cls, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> LayerKV:
        if (k_scale is None) != (v_scale is None):
            raise ValueError("an int8 KV layer needs both k_scale and v_scale (a float one neither)")
        if k.shape != v.shape or (k_scale is not None and (k_scale.shape != k.shape[:3] or v_scale.shape != k.shape[:3])):
            raise ValueError(f"KV layer parts disagree in shape: k {tuple(k.shape)}, v {tuple(v.shape)}"
                             + (f", scales {tuple(k_scale.shape)} / {tuple(v_scale.shape)}" if k_scale is not None else ""))
        return super().__new__(cls, (k, v) if k_scale is None else (k, v, k_scale, v_scale))

    @property
    def k(self) -> torch.Tensor:
        """Key pages [num_blocks, block_size, n_kv, d]."""
        return self[0]

    @property
    def v(self) -> torch.Tensor:
        """Value pages [num_blocks, block_size, n_kv, d]."""
        return self[1]

    @property
    def scales(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k_scale, v_scale) of an int8 cache, else None."""
        return (self[2], self[3]) if len(self) == 4 else None

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over every part (what a tier file or a transfer moves per block)."""
        return sum(t[0].numel() * t.element_size() for t in self)


def zeroed_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu",
                 stagger: float = 0.0) -> torch.Tensor:
    """A contiguous zero tensor; on the CPU backed by an anonymous, page-aligned memory map that
    lives as long as the tensor (or any view of it) does. A huge-page map starts `stagger` (in
    [0, 1)) of a huge page past a 2 MiB boundary, rounded down to a small page, in a huge page
    (see above)."""
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE") or os.environ.get("SPECSERVE_KV_HUGE") == "0":
        return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)
    if not 0.0 <= stagger < 1.0:
        raise ValueError(f"stagger is a fraction of a huge page in [0, 1), got {stagger}")
    # Room to start `offset` past a 2 MiB boundary. The pages before the boundary are never
    # touched, so never resident; the gap after it is, within the first huge page.
    offset = int(stagger * HUGE_PAGE) // mmap.PAGESIZE * mmap.PAGESIZE
    m = mmap.mmap(-1, nbytes + 2 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    boundary = -ctypes.addressof(ctypes.c_char.from_buffer(m)) % HUGE_PAGE
    start = boundary + offset
    with contextlib.suppress(OSError):  # advice only: small pages work too
        m.madvise(mmap.MADV_HUGEPAGE, boundary, (offset + nbytes) // HUGE_PAGE * HUGE_PAGE)
    return torch.frombuffer(m, dtype=dtype, offset=start, count=math.prod(shape)).view(shape)


def layer_pages(num_layers: int, parts: list[tuple[tuple[int, ...], torch.dtype]],
                device: torch.device | str = "cpu") -> list[LayerKV]:
    """A paged cache's layers, each a LayerKV of zeroed `parts` (shape, dtype), every part
    starting its own share of a huge page past a boundary (see above)."""
    total = num_layers * len(parts)
    return [LayerKV(*(zeroed_pages(shape, dtype, device, stagger=(layer * len(parts) + j) / total)
                      for j, (shape, dtype) in enumerate(parts)))
            for layer in range(num_layers)]


_MADV_POPULATE_WRITE = 23  # Linux 5.14 and later


class KVPrefaulter:
    """Faults in a CPU paged cache's pages ahead of its allocator, a slice at a time (see above).

    The block pool hands out never-used block ids in increasing order, so the next allocations
    write blocks from its high-water mark on; `advance(upto, deadline)` faults every part's pages
    of blocks [0, upto) not yet faulted, in slices of about a huge page per part, until the
    deadline. Contents never change (MADV_POPULATE_WRITE faults a page in as a write would, without
    writing), so a block an engine writes meanwhile is safe. Where the OS cannot (another OS, a
    kernel before 5.14, no libc), `available` turns False at the first try and nothing more is done."""

    def __init__(self, layers: list[LayerKV]) -> None:
        self.parts = [t for layer in layers for t in layer if t.device.type == "cpu" and t.numel() > 0]
        self.block_bytes = [t[0].numel() * t.element_size() for t in self.parts]
        self.num_blocks = self.parts[0].shape[0] if self.parts else 0
        # Blocks per slice: about one huge page of the largest part.
        self.slice_blocks = max(1, HUGE_PAGE // max(self.block_bytes, default=1))
        self.done = 0  # blocks [0, done) faulted in every part
        self._part = 0  # the next part to fault of the slice [done, _slice_end)
        self._slice_end = 0
        self.faulted_bytes = 0
        self.available = bool(self.parts) and os.environ.get("SPECSERVE_KV_PREFAULT") != "0"

    def _populate(self, t: torch.Tensor, start: int, stop: int) -> bool:
        """Fault in bytes [start, stop) of t's storage for writing (page-rounded outwards: the
        pages lie within t's memory map)."""
        addr = t.data_ptr() + start
        lo = addr - addr % mmap.PAGESIZE
        hi = t.data_ptr() + stop
        hi += -hi % mmap.PAGESIZE
        err = madvise(lo, hi - lo, _MADV_POPULATE_WRITE)
        if err == 0:
            self.faulted_bytes += stop - start
            return True
        logger.debug("KV prefault off: madvise(MADV_POPULATE_WRITE) failed (%s)",
                     os.strerror(err) if err > 0 else "no madvise here")
        self.available = False
        return False

    def advance(self, upto: int, deadline: float) -> bool:
        """Fault blocks [done, upto) until `deadline` (time.monotonic()); True while some remain.
        At least one part's slice is faulted per call."""
        upto = min(upto, self.num_blocks)
        while self.available and self.done < upto:
            if self._part == 0:
                self._slice_end = min(upto, self.done + self.slice_blocks)
            t, bb = self.parts[self._part], self.block_bytes[self._part]
            if not self._populate(t, self.done * bb, self._slice_end * bb):
                return False
            self._part += 1
            if self._part == len(self.parts):
                self._part, self.done = 0, self._slice_end
            if time.monotonic() >= deadline:
                break
        return self.available and self.done < upto
