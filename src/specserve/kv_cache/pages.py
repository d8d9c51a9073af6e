"""KV page memory: zero-filled tensors whose pages the operating system zeroes on first touch.

A paged cache is allocated whole at start-up (`--kv-cache-gib`) and must read as zeros where
nothing was written (masked slots are still multiplied by a zero weight). `torch.zeros` writes
every byte up front: about a second per GiB on a 2-core VM, paid by every engine start, and the
whole budget is resident from then on. On the CPU the cache is instead an anonymous memory map:
the kernel hands out zero pages as they are first written, so start-up costs nothing and
resident memory grows with the KV actually used. Other devices allocate as before.
"""

from __future__ import annotations

import math
import mmap

import torch


def zeroed_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A contiguous zero tensor; on the CPU backed by an anonymous, page-aligned memory map that
    lives as long as the tensor (or any view of it) does."""
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)
