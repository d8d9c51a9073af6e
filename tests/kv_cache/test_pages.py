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


def _can_populate() -> bool:
    """Whether this OS faults pages in on request (a kernel before 5.14 refuses the advice: the
    prefaulter then turns itself off at its first try)."""
    from specserve.kv_cache.pages import KVPrefaulter

    pf = KVPrefaulter([LayerKV(zeroed_pages((4, 16, 1, 8), torch.float32), zeroed_pages((4, 16, 1, 8), torch.float32))])
    pf.advance(4, deadline=float("inf"))
    return pf.available and pf.done == 4


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_the_prefaulter_makes_pages_resident_ahead_of_the_allocator_without_changing_them():
    """KVPrefaulter faults in every part's pages of blocks [done, upto) a slice at a time, until
    its deadline (at least one part's slice a call), never past the pool; what is in the blocks
    stays (a block written meanwhile keeps its values), the rest reads as zeros."""
    from specserve.kv_cache.pages import KVPrefaulter

    if not _can_populate():
        pytest.skip("KV prefaulting is off here (SPECSERVE_KV_PREFAULT=0, or a kernel before 5.14 without MADV_POPULATE_WRITE)")
    gc.collect()
    shape = (256, 16, 4, 64)  # 16 KiB a block and part: 4 MiB a part
    layers = [LayerKV(zeroed_pages(shape, torch.float32, stagger=0.25 * i), zeroed_pages(shape, torch.float32, stagger=0.25 * i + 0.125))
              for i in range(4)]
    layers[2].v[200, 3, 1, 7] = 5.0  # written before: kept
    pf = KVPrefaulter(layers)
    assert pf.available and pf.num_blocks == 256 and pf.slice_blocks == 128
    before = _resident_mib()
    assert pf.advance(256, deadline=0.0)  # a past deadline: one part's slice, and more to do
    assert pf.done == 0 and pf.faulted_bytes == 128 * 16384
    assert not pf.advance(100, deadline=float("inf"))  # the slice in progress ends where it began
    assert pf.done == 128 and pf.faulted_bytes == 8 * 128 * 16384
    grown = _resident_mib() - before
    # 2 MiB a part faulted; a staggered part's slice may straddle two huge pages
    assert 8 * 2 - 1 < grown < 8 * 4 + 4, f"{grown:.1f} MiB resident for 16 MiB faulted"
    assert not pf.advance(10_000, deadline=float("inf")) and pf.done == 256  # never past the pool
    assert pf.faulted_bytes == 8 * 256 * 16384
    assert float(layers[2].v[200, 3, 1, 7]) == 5.0
    assert all(int(t.count_nonzero()) == (1 if t is layers[2].v else 0) for layer in layers for t in layer)


def test_an_idle_server_faults_in_the_kv_its_next_requests_write(monkeypatch):
    """The server's engine thread, idle, faults in the pages past the pool's highest block handed
    out (Engine.prefault_kv), a bounded window; requests served afterwards are unchanged."""
    import asyncio
    import time

    from conftest import tiny_checkpoint

    from specserve import LLM, SamplingParams
    from specserve.engine import engine as engine_mod
    from specserve.server.async_engine import AsyncEngine

    if not _can_populate():
        pytest.skip("KV prefaulting is off here (SPECSERVE_KV_PREFAULT=0, or a kernel before 5.14 without MADV_POPULATE_WRITE)")
    _, ckpt = tiny_checkpoint("llama", seed=5, vocab=256, layers=4)
    llm = LLM("tiny", dtype="float32", checkpoint=ckpt, kv_cache_gib=0.25)
    eng = llm.engine
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids
    pf = eng._kv_prefaulter
    assert pf is not None and pf.done == 0  # nothing faulted by a busy engine
    monkeypatch.setattr(engine_mod, "PREFAULT_AHEAD_BYTES", 64 * eng.runner.block_payload_bytes())
    target = min(pf.num_blocks, len(eng.kv_manager.pool.blocks) + 64)

    async def serve() -> list[int]:
        ae = AsyncEngine(eng)
        ae.start(asyncio.get_running_loop())
        try:
            deadline = time.monotonic() + 30
            while pf.done < target and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert pf.done >= target and pf.done < pf.num_blocks, (pf.done, target, pf.num_blocks)
            out = None
            async for _, out in ae.submit([eng.prepare_request([5, 6, 7, 8], params)]):
                if out.finished:
                    break
            return list(out.outputs[0].token_ids)
        finally:
            await ae.shutdown(5)

    assert asyncio.run(serve()) == list(want)
    assert eng.kv_manager.check_integrity([])
