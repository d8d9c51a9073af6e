"""The paged caches' memory: zero wherever nothing was written, resident only once written."""

from __future__ import annotations

import gc
import sys

import pytest
import torch

from specserve.kv_cache.pages import zeroed_pages


def _resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_pages_read_as_zeros_and_keep_what_is_written(dtype):
    x = zeroed_pages((37, 16, 2, 8), dtype)
    assert x.shape == (37, 16, 2, 8) and x.dtype == dtype and x.is_contiguous()
    assert int(x.count_nonzero()) == 0
    x[3, 5] = 7
    y = x[3]  # a view outlives the tensor it came from
    del x
    gc.collect()
    assert int(y[5].count_nonzero()) == y[5].numel() and int(y.count_nonzero()) == y[5].numel()
    assert zeroed_pages((0, 4), dtype).numel() == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_a_large_cache_costs_resident_memory_only_where_written():
    gc.collect()
    before = _resident_mib()
    x = zeroed_pages((512, 1024, 256), torch.float32)  # 512 MiB
    allocated = _resident_mib()
    assert allocated - before < 64, f"{allocated - before:.0f} MiB resident right after allocating 512 MiB"
    x[:128].fill_(1.0)  # a quarter written
    written = _resident_mib()
    assert 100 < written - before < 200
    del x
    gc.collect()
    assert _resident_mib() - before < 64  # returned to the system with the tensor
