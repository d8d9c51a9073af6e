"""The paged caches' memory: zero wherever nothing was written, resident only once written."""

from __future__ import annotations

import gc
import sys

import pytest
import torch

from specserve.kv_cache.pages import LayerKV, zeroed_pages


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


def test_a_layer_kv_names_its_parts_and_iterates_only_those_present():
    """A float layer is (k, v), an int8 one (k, v, k_scale, v_scale); the names and the block
    size agree with the parts, and parts that cannot belong together are refused."""
    k, v = torch.zeros(5, 16, 2, 8, dtype=torch.int8), torch.zeros(5, 16, 2, 8, dtype=torch.int8)
    ks, vs = torch.zeros(5, 16, 2), torch.zeros(5, 16, 2)
    plain = LayerKV(k.float(), v.float())
    assert len(plain) == 2 and plain.scales is None and plain.k.shape == plain.v.shape == (5, 16, 2, 8)
    assert plain.block_bytes == 2 * 16 * 2 * 8 * 4
    q = LayerKV(k, v, ks, vs)
    assert len(q) == 4 and q.k is k and q.v is v and q.scales == (ks, vs) and list(q) == [k, v, ks, vs]
    assert q.block_bytes == 2 * (16 * 2 * 8 + 16 * 2 * 4)
    assert isinstance(q, tuple) and [t.shape[0] for t in q] == [5] * 4  # moved part by part as before
    with pytest.raises(ValueError, match="both k_scale and v_scale"):
        LayerKV(k, v, ks)
    with pytest.raises(ValueError, match="disagree in shape"):
        LayerKV(k, v[:, :8])
    with pytest.raises(ValueError, match="disagree in shape"):
        LayerKV(k, v, ks[:, :8], vs)


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


def _thp_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None

def _huge_page_eligible(addr: int) -> str | None:
    """/proc/self/smaps' THPeligible of the map holding addr (the kernel's verdict)."""
    eligible = None
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(a, 16) for a in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "THPeligible:":
                eligible = line.split()[1]
    return eligible


@pytest.mark.skipif(_thp_mode() in (None, "never"), reason="no transparent huge pages on this machine")
def test_a_large_cache_starts_on_a_huge_page_and_asks_for_them():
    """A cache of 2 MiB or more starts on a 2 MiB boundary and its map is eligible for huge pages
    even where they are madvise-only (the kernel's own verdict, /proc/self/smaps THPeligible)."""
    x = zeroed_pages((256, 16, 4, 64), torch.float32)  # 4 MiB
    assert x.data_ptr() % (2 << 20) == 0
    assert _huge_page_eligible(x.data_ptr()) == "1"
    small = zeroed_pages((4, 16, 2, 8), torch.float32)
    assert int(small.count_nonzero()) == 0 and int(x.count_nonzero()) == 0


@pytest.mark.skipif(_thp_mode() in (None, "never"), reason="no transparent huge pages on this machine")
def test_a_staggered_cache_starts_its_share_of_a_huge_page_past_a_boundary():
    """zeroed_pages(stagger=s) starts s of a huge page past a 2 MiB boundary (a small page's
    multiple), inside a huge page, so caches staggered apart fault their huge pages at different
    offsets; the contents read as zeros and keep what is written."""
    huge = 2 << 20
    for s in (0.0, 0.25, 0.5, 0.999):
        x = zeroed_pages((512, 16, 4, 64), torch.float32, stagger=s)  # 8 MiB
        offset = x.data_ptr() % huge
        assert offset % 4096 == 0 and abs(offset - s * huge) < 4096, (s, offset)
        assert _huge_page_eligible(x.data_ptr()) == "1"
        assert int(x.count_nonzero()) == 0
        x[-1].fill_(2.0)
        x[0].fill_(1.0)
        assert float(x.sum()) == 3.0 * x[0].numel()
    with pytest.raises(ValueError, match="stagger"):
        zeroed_pages((512, 16, 4, 64), torch.float32, stagger=1.0)


@pytest.mark.skipif(_thp_mode() in (None, "never"), reason="no transparent huge pages on this machine")
def test_the_runner_staggers_its_kv_parts_so_huge_page_faults_fall_on_different_blocks():
    """Every layer's K and V hold the same block ids: parts that all start on a 2 MiB boundary
    first write a new huge page at the same block, and the step that allocates it zeroes
    2 MiB per part at once (Qwen2.5 1.5B: 112 MiB, a 0.3 s decode step among 60 ms ones). The
    runner's parts start at distinct offsets, so each part's first block past a huge-page edge
    differs among parts of one kind (an int8 cache's scales are parts of another size)."""
    from conftest import tiny_checkpoint

    from specserve import LLM

    _, ckpt = tiny_checkpoint("llama", seed=5, vocab=256, layers=4)
    for kv in ("auto", "int8"):
        eng = LLM("tiny", dtype="float32", checkpoint=ckpt, kv_cache_gib=0.25, kv_cache_dtype=kv).engine
        huge = 2 << 20
        parts = [t for layer in eng.runner.kv_caches for t in layer]
        assert len(parts) == 4 * (4 if kv == "int8" else 2)
        crossings: dict[tuple[int, ...], list[int]] = {}
        for t in parts:
            block = t[0].numel() * t.element_size()
            offset = t.data_ptr() % huge
            crossings.setdefault(tuple(t.shape), []).append(-(-(huge - offset) // block) if offset else 0)
        for kind in crossings.values():
            assert len(set(kind)) == len(kind), crossings
        assert all(int(t.count_nonzero()) == 0 for t in parts)
