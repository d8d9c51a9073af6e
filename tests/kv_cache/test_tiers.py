"""The prefix cache's host and disk tiers: LRU bounds, verified disk blocks, crash safety, the
manager's bookkeeping, and an engine that stays exact and warms from a restart."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specserve.kv_cache.block_pool import hash_block_tokens
from specserve.kv_cache.manager import KVCacheManager
from specserve.kv_cache.tiers import (
    _HEADER_LEN,
    MAGIC,
    SUFFIX,
    HostTier,
    TieredKVStore,
    block_file_name,
)

PAYLOAD = 64


def Seq(request_id: str, tokens: list[int]) -> SimpleNamespace:  # noqa: N802 - reads like the manager's requests
    """What the manager reads of a request."""
    return SimpleNamespace(request_id=request_id, all_token_ids=tokens, num_computed_tokens=0)


def _chain(n: int, start: int = 0) -> list:
    hashes, parent = [], None
    for i in range(n):
        parent = hash_block_tokens(parent, [start + 4 * i + j for j in range(4)])
        hashes.append(parent)
    return hashes


def _payload(seed: int) -> torch.Tensor:
    return torch.arange(PAYLOAD, dtype=torch.uint8) ^ seed


def _store(tmp_path: Path, fingerprint: str = "fp", host: int = 0, disk: int = 1 << 20) -> TieredKVStore:
    return TieredKVStore(fingerprint, PAYLOAD, host_bytes=host, disk_dir=tmp_path, disk_bytes=disk)


def _files(store: TieredKVStore) -> list[Path]:
    assert store.disk is not None
    return sorted(store.disk.dir.glob(f"*{SUFFIX}"))


# ---------------------------------------------------------------------- tiers alone
def test_host_tier_keeps_the_most_recently_used_within_its_bytes():
    host = HostTier(3 * PAYLOAD)
    hs = _chain(4)
    for i, h in enumerate(hs[:3]):
        host.put(h, _payload(i))
    assert host.get(hs[0]) is not None  # used: now the most recent
    host.put(hs[3], _payload(3))
    assert not host.contains(hs[1]) and all(host.contains(h) for h in (hs[0], hs[2], hs[3]))
    assert host.used_bytes == 3 * PAYLOAD
    other = hash_block_tokens(None, [9, 9, 9, 9])._replace(value=hs[0].value)  # same value, other tokens
    assert host.get(other) is None


def test_disk_blocks_round_trip_across_processes_and_stay_within_size(tmp_path):
    hs = _chain(5)
    probe = _store(tmp_path / "probe")
    probe.save(hs[0], _payload(0))
    assert probe.flush()
    size = _files(probe)[0].stat().st_size  # one block file (the header holds the tokens)
    probe.close()
    store = _store(tmp_path, disk=3 * size + size // 2)  # room for 3 files
    for i, h in enumerate(hs):
        store.save(h, _payload(i))
        assert store.flush()
    assert store.disk is not None and len(store.disk) == 3 and store.disk.used_bytes <= 3 * size + size // 2
    assert not store.contains(hs[0]) and not store.contains(hs[1]) and store.contains(hs[4])
    assert len(_files(store)) == 3
    store.close()
    again = _store(tmp_path, disk=3 * size + size // 2)  # a new process: the directory is the index
    found = again.fetch(hs[4])
    assert found is not None and found.tier == "disk" and torch.equal(found.payload, _payload(4))
    assert again.fetch(hs[0]) is None and again.counters.corrupt == 0
    assert again.counters.disk.hits == 1 and again.counters.disk.hit_bytes == PAYLOAD
    again.close()


@pytest.mark.parametrize("damage", ["flip_payload", "truncate", "flip_header", "other_block", "garbage"])
def test_a_damaged_block_file_is_counted_deleted_and_never_served(tmp_path, damage):
    store = _store(tmp_path)
    hs = _chain(2)
    store.save(hs[0], _payload(0))
    store.save(hs[1], _payload(1))
    assert store.flush()
    store.close()
    victim, other = (store.disk.dir / f"{h.value & 0xFFFFFFFFFFFFFFFF:016x}{SUFFIX}" for h in hs)
    data = bytearray(victim.read_bytes())
    if damage == "flip_payload":
        data[-3] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) - 10]
    elif damage == "flip_header":
        i = data.index(b'"tokens":[') + len(b'"tokens":[')
        data[i] = ord("7") if data[i] != ord("7") else ord("8")
    elif damage == "other_block":  # a valid file, but of another block, under this block's name
        data = bytearray(other.read_bytes())
    else:
        data = bytearray(b"\x00" * 40)
    victim.write_bytes(bytes(data))
    again = _store(tmp_path)
    assert again.fetch(hs[0]) is None
    assert again.counters.corrupt == 1 and not victim.exists()
    found = again.fetch(hs[1])  # the intact one is still served
    assert found is not None and torch.equal(found.payload, _payload(1))
    again.close()


def _with_header(record: bytes, edit) -> bytes:  # noqa: ANN001 - edit(header dict) -> header bytes
    """A block record whose header `edit` rewrote (magic, length and payload kept)."""
    start = len(MAGIC) + _HEADER_LEN.size
    (n,) = _HEADER_LEN.unpack_from(record, len(MAGIC))
    blob = edit(json.loads(record[start : start + n]))
    return MAGIC + _HEADER_LEN.pack(len(blob)) + blob + record[start + n :]


@pytest.mark.parametrize("edit", [
    lambda h: json.dumps({**h, "tokens": 5}).encode(),
    lambda h: json.dumps({**h, "value": str(h["value"])}).encode(),
    lambda h: json.dumps({**h, "parent": [1]}).encode(),
    lambda h: json.dumps({**h, "payload_bytes": "64"}).encode(),
    lambda h: json.dumps({**h, "layer_crc32": "0"}).encode(),
    lambda h: b"[" * 100_000,  # JSON nested past the recursion limit
], ids=["tokens", "value", "parent", "payload_bytes", "layer_crc32", "nested"])
def test_a_block_file_whose_header_is_malformed_is_refused_at_start_up_and_when_it_appears(tmp_path, edit):
    store = _store(tmp_path)
    hs = _chain(2)
    for i, h in enumerate(hs):
        store.save(h, _payload(i))
    assert store.flush()
    store.close()
    victim = store.disk.dir / block_file_name(hs[0].value)
    good = victim.read_bytes()
    victim.write_bytes(_with_header(good, edit))
    again = _store(tmp_path)  # start-up reads every header
    assert again.counters.corrupt == 1 and not victim.exists() and again.fetch(hs[0]) is None
    for deferred in (True, False):  # a file another process wrote after start-up: found when asked for
        victim.write_bytes(_with_header(good, edit))
        assert again.fetch_run(hs[:1], deferred=deferred) == [] and not victim.exists()
    assert again.counters.corrupt == 3
    found = again.fetch(hs[1])
    assert found is not None and torch.equal(found.payload, _payload(1))
    again.close()


def test_a_disk_that_refuses_writes_leaves_no_partial_files_and_the_store_goes_on(tmp_path, monkeypatch):
    import specserve.kv_cache.tiers as tiers

    store = _store(tmp_path)
    hs = _chain(3)

    def full(src, dst):  # noqa: ANN001, ANN202 - the disk filled up as the block was written
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tiers.os, "replace", full)
    for i, h in enumerate(hs[:2]):
        store.save(h, _payload(i))
    assert store.flush()
    assert store.counters.disk_failed == 2 and store.counters.disk.saved == 0
    assert list(store.disk.dir.iterdir()) == [] and store.disk.used_bytes == 0 and store.fetch(hs[0]) is None
    monkeypatch.undo()
    store.save(hs[2], _payload(2))  # room again: the next block lands
    assert store.flush()
    found = store.fetch(hs[2])
    assert found is not None and torch.equal(found.payload, _payload(2)) and len(_files(store)) == 1
    store.close()


def test_a_damaged_file_that_cannot_be_deleted_is_still_only_a_miss(tmp_path, monkeypatch):
    store = _store(tmp_path)
    h = _chain(1)[0]
    store.save(h, _payload(0))
    assert store.flush()
    victim = store.disk.dir / block_file_name(h.value)
    victim.write_bytes(victim.read_bytes()[:-3])  # torn; and the folder turned read-only meanwhile:

    def read_only(self, missing_ok=False):  # noqa: ANN001, ANN202
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "unlink", read_only)
    for deferred in (True, False):
        assert store.fetch_run([h], deferred=deferred) == []
    assert store.counters.corrupt == 2 and victim.exists()
    monkeypatch.undo()
    store.close()


def test_a_disk_tier_directory_that_cannot_be_written_is_refused_at_start(tmp_path):
    from specserve.errors import ConfigError

    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(ConfigError, match="cannot write to .*a-file.*--kv-disk-dir"):
        _store(tmp_path / "a-file" / "kv")


def test_start_up_removes_interrupted_writes_and_ignores_other_models(tmp_path):
    store = _store(tmp_path, fingerprint="model-a")
    h = _chain(1)[0]
    store.save(h, _payload(5))
    assert store.flush()
    store.close()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (store.disk.dir / f"0000000000000001{SUFFIX}.{int(dead.stdout)}.456.tmp").write_bytes(b"half a block")
    # A live process sharing the directory (here: pid 1) may be writing this one right now.
    (store.disk.dir / f"0000000000000002{SUFFIX}.1.789.tmp").write_bytes(b"being written")
    other = _store(tmp_path, fingerprint="model-b")  # another model's folder: nothing of a's
    assert other.fetch(h) is None and other.counters.corrupt == 0
    other.close()
    again = _store(tmp_path, fingerprint="model-a")
    assert [p.name for p in again.disk.dir.glob("*.tmp")] == [f"0000000000000002{SUFFIX}.1.789.tmp"]
    assert again.fetch(h) is not None
    again.close()


def test_workers_sharing_a_directory_find_each_others_blocks(tmp_path):
    """A directory shared by several processes is one store: a block another process wrote after
    this one started is found (and verified) on lookup; one it deleted is a miss, not corruption."""
    writer, reader = _store(tmp_path), _store(tmp_path)  # both started on an empty directory
    hs = _chain(2)
    writer.save(hs[0], _payload(3))
    writer.save(hs[1], _payload(4))
    assert writer.flush()
    found = reader.fetch(hs[0])
    assert found is not None and found.tier == "disk" and torch.equal(found.payload, _payload(3))
    assert reader.contains(hs[1])
    writer.disk.clear()  # the writer's size limit (or a reset) removed its files
    assert reader.fetch(hs[1]) is None and reader.counters.corrupt == 0
    writer.close()
    reader.close()


def test_processes_sharing_a_directory_share_its_size_limit(tmp_path, monkeypatch):
    """Each writer holds its own files to the limit; together they would hold twice as much. A
    writer's periodic pass over the directory deletes the least recently used files of any
    process until the whole directory fits, and the other forgets what it lost (a miss)."""
    probe = _store(tmp_path / "probe")
    probe.save(_chain(1)[0], _payload(0))
    assert probe.flush()
    size = _files(probe)[0].stat().st_size
    probe.close()
    limit = 3 * size + size // 2  # room for 3 files
    a, b = _store(tmp_path, disk=limit), _store(tmp_path, disk=limit)
    ha, hb = _chain(3), _chain(3, start=100)
    for i, h in enumerate(ha):
        a.save(h, _payload(i))
    assert a.flush()
    for i, h in enumerate(hb):
        b.save(h, _payload(10 + i))
    assert b.flush()
    assert len(_files(a)) == 6  # each within its own limit: the directory at twice the limit
    now = time.time()
    for age, h in enumerate([*hb[::-1], *ha[::-1]]):  # a's blocks used longest ago, a's first the oldest
        os.utime(a.disk.dir / block_file_name(h.value), (now - age, now - age))
    assert b.disk.sync_with_directory() <= limit
    assert len(_files(a)) == 3 and all(b.contains(h) for h in hb)
    assert a.fetch(ha[0]) is None and a.counters.corrupt == 0  # deleted by b's pass: a miss
    assert a.disk.sync_with_directory() <= limit and a.disk.used_bytes == 0  # a forgets its lost files

    monkeypatch.setattr("specserve.kv_cache.tiers._SYNC_EVERY", 1)  # every write checks the directory
    for i, h in enumerate(_chain(4, start=200)):
        a.save(h, _payload(20 + i))
        assert a.flush()
        assert sum(p.stat().st_size for p in _files(a)) <= limit
    a.close()
    b.close()


def test_a_payload_of_the_wrong_size_is_refused(tmp_path):
    store = _store(tmp_path)
    with pytest.raises(ValueError, match="expected 64"):
        store.save(_chain(1)[0], torch.zeros(10, dtype=torch.uint8))
    store.close()


# ---------------------------------------------------------------------- the manager
def test_manager_continues_a_prefix_from_the_tiers_and_queues_loads_and_saves(tmp_path):
    store = TieredKVStore("fp", PAYLOAD, host_bytes=1 << 20)
    kv = KVCacheManager(num_blocks=8, block_size=4, tiers=store)
    first = Seq("a", list(range(17)))  # 4 full blocks + 1 token
    assert kv.allocate_slots(first, 17)
    first.num_computed_tokens = 17
    kv.cache_blocks(first, 17)
    saves = kv.take_pending_saves()
    assert [bid for bid, _ in saves] == kv.block_ids("a")[:4]
    for bid, h in saves:  # what the engine does after the step
        store.save(h, _payload(bid))
    kv.free(first)
    kv.reset_prefix_cache()  # the pool forgets; the tiers are cleared too ...
    assert not store.contains(saves[0][1])
    for bid, h in saves:  # ... so put them back, as blocks evicted from the pool would be
        store.save(h, _payload(bid))
    kv.prefix_cache.evict()

    second = Seq("b", list(range(17)) + [99])
    hit = kv.find_prefix(second)
    assert hit.blocks == [] and len(hit.loaded) == 4 and hit.num_tokens == 16
    assert [t.tier for t in hit.loaded] == ["host"] * 4
    assert kv.num_blocks_needed(second, 2, hit.blocks, loaded=hit.loaded) == 5
    assert kv.allocate_slots(second, 2, hit.blocks, loaded=hit.loaded)
    loads = kv.take_pending_loads()
    assert [ld.block_id for ld in loads] == kv.block_ids("b")[:4]
    assert all(torch.equal(ld.payload, _payload(bid)) for ld, (bid, _) in zip(loads, saves))
    # Registered at once: a third request finds them in the pool, no second load.
    third = Seq("c", list(range(17)) + [7])
    hit3 = kv.find_prefix(third)
    assert len(hit3.blocks) == 4 and not hit3.loaded
    second.num_computed_tokens = 18
    kv.cache_blocks(second, 18)
    assert kv.take_pending_saves() == []  # the tiers hold those blocks already
    kv.free(second)
    assert kv.check_integrity([])


def test_a_failed_allocation_of_a_tier_hit_changes_nothing():
    store = TieredKVStore("fp", PAYLOAD, host_bytes=1 << 20)
    kv = KVCacheManager(num_blocks=4, block_size=4, tiers=store)
    for h in _chain(4):
        store.save(h, _payload(1))
    seq = Seq("a", list(range(16)) + [1, 2, 3, 4, 5])
    hit = kv.find_prefix(seq)
    assert len(hit.loaded) == 4
    assert not kv.can_allocate(seq, 5, hit.blocks, loaded=hit.loaded)  # 4 loaded + 2 new > 4 blocks
    assert not kv.allocate_slots(seq, 5, hit.blocks, loaded=hit.loaded)
    assert kv.take_pending_loads() == [] and kv.num_free_blocks == 4 and kv.pool.num_cached_blocks == 0


def test_a_request_waiting_for_room_reads_no_more_tier_blocks_than_the_pool_can_take():
    store = TieredKVStore("fp", PAYLOAD, host_bytes=1 << 20)
    kv = KVCacheManager(num_blocks=4, block_size=4, tiers=store)
    for h in _chain(4):
        store.save(h, _payload(1))
    holder = Seq("x", list(range(100, 109)))
    assert kv.allocate_slots(holder, 9)  # 3 of the 4 blocks taken
    hit = kv.find_prefix(Seq("a", list(range(16)) + [1]))
    assert len(hit.loaded) == 1 and store.counters.host.hits == 1  # one free block: one block read


# ---------------------------------------------------------------------- the engine
SYSTEM = "You are a careful assistant who answers in full sentences. " * 12
PROMPTS = [SYSTEM + f"Conversation {i}: " + f"tell me about item {i} and why it matters. " * (8 + i) for i in range(8)]


def _engine(ckpt, **kw):
    from specserve import LLM

    return LLM("smollm2-135m-instruct", dtype="float32", checkpoint=ckpt, kv_cache_gib=0.02, num_threads=1, **kw)


def _outputs(llm) -> list[list[int]]:
    from specserve import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(smollm_checkpoint) -> list[list[int]]:
    return _outputs(_engine(smollm_checkpoint, enable_prefix_caching=False))


def test_engine_with_tiers_is_exact_and_serves_evicted_prefixes(smollm_checkpoint, reference, tmp_path):
    llm = _engine(smollm_checkpoint, kv_host_gib=0.25, kv_disk_dir=str(tmp_path))
    eng = llm.engine
    total = sum(len(llm.tokenizer.encode(p)) for p in PROMPTS)
    assert total > 3 * eng.kv_manager.capacity_tokens  # the working set does not fit in the pool
    assert _outputs(llm) == reference
    assert _outputs(llm) == reference  # second round: prefixes evicted from the pool come back
    st = eng.stats()
    assert st["kv_tier_host_hits"] > 20 and st["kv_tier_corrupt_blocks"] == 0
    assert eng.check_integrity()
    eng.close()
    assert st["kv_tier_disk_blocks"] > 0 or len(list(tmp_path.rglob(f"*{SUFFIX}"))) > 0

    # A restart on the same directory starts warm, from disk; a damaged file is skipped.
    files = sorted(tmp_path.rglob(f"*{SUFFIX}"))
    data = bytearray(files[0].read_bytes())
    data[-1] ^= 0x55
    files[0].write_bytes(bytes(data))
    again = _engine(smollm_checkpoint, kv_disk_dir=str(tmp_path))
    assert _outputs(again) == reference
    st = again.engine.stats()
    assert st["kv_tier_disk_hits"] > 20
    assert st["kv_tier_corrupt_blocks"] <= 1  # at most the damaged file, if a prompt reached it
    again.engine.close()


_WRITER = textwrap.dedent("""
    import sys
    from specserve import LLM, SamplingParams
    llm = LLM("smollm2-135m-instruct", dtype="float32", quantization="none", kv_cache_gib=0.02, num_threads=1,
              kv_disk_dir=sys.argv[1])  # as the test's engine: the same KV bytes, the same folder
    print("ready", flush=True)
    i = 0
    while True:  # distinct prompts: every completed block is a new file
        llm.generate([f"Story {i}: " + "once more, a longer and longer tale " * 12], SamplingParams(max_tokens=4))
        i += 1
""")


@pytest.mark.slow
def test_kill_9_while_writing_blocks_never_serves_a_corrupt_block(smollm_checkpoint, reference, tmp_path):
    """SIGKILL an engine in the middle of writing its disk tier, then restart on the directory:
    every block it finds is verified (a damaged one is refused and counted), outputs are exact."""
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 120
        while len(list(tmp_path.rglob(f"*{SUFFIX}"))) < 40:
            assert time.monotonic() < deadline and proc.poll() is None, "the writer wrote too little"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    files = sorted(tmp_path.rglob(f"*{SUFFIX}"))
    damaged = files[len(files) // 2]
    damaged.write_bytes(damaged.read_bytes()[:-7])  # as a torn write would leave it
    llm = _engine(smollm_checkpoint, kv_disk_dir=str(tmp_path))
    disk = llm.engine.kv_manager.tiers.disk
    assert len(list(tmp_path.iterdir())) == 1  # one model, one fingerprint folder
    assert not list(tmp_path.rglob("*.tmp"))  # interrupted writes removed at start
    served = 0
    for f in sorted(tmp_path.rglob(f"*{SUFFIX}")):  # read every block back as a hit would
        entry = next(e for e in disk._index.values() if e.path == f)
        payload = disk.read(entry.block_hash)
        if f == damaged:
            assert payload is None
        else:
            assert payload is not None and payload.numel() == disk.payload_bytes
            served += 1
    assert served >= 39 and llm.engine.kv_manager.tiers.counters.corrupt == 1
    assert _outputs(llm) == reference
    llm.engine.close()


@pytest.mark.slow
def test_served_tiers_export_metrics_and_flush_the_disk_at_shutdown(smollm_checkpoint, reference, tmp_path):
    import httpx

    from tests.server.conftest import serve

    llm = _engine(smollm_checkpoint, kv_host_gib=0.25, kv_disk_dir=str(tmp_path))
    with serve(llm, "smollm2") as live:
        for _ in range(2):
            for prompt, want in zip(PROMPTS, reference):
                body = {"prompt": prompt, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
                r = httpx.post(live.base_url + "/v1/completions", json=body, timeout=120)
                assert r.status_code == 200
                assert llm.tokenizer.encode(r.json()["choices"][0]["text"], add_special_tokens=False) == want
        text = httpx.get(live.base_url + "/metrics").text
    hits = [ln for ln in text.splitlines() if ln.startswith('specserve_kv_tier_hit_blocks_total{model="smollm2",tier="host"}')]
    assert hits and float(hits[0].split()[-1]) > 20
    for name in ("specserve_kv_tier_hit_bytes_total", "specserve_kv_tier_load_seconds_total",
                 "specserve_kv_tier_used_bytes", "specserve_kv_tier_corrupt_blocks_total",
                 "specserve_kv_tier_layer_wise_steps_total", "specserve_kv_tier_requeued_requests_total"):
        assert name in text, name
    disk = llm.engine.kv_manager.tiers.disk
    assert not disk._writer.is_alive() and disk._queue.unfinished_tasks == 0  # shutdown wrote every block
    assert len(list(tmp_path.rglob(f"*{SUFFIX}"))) == len(disk) > 0


def test_engines_whose_kernels_differ_keep_their_blocks_apart(tiny_llama, tmp_path):
    """float32 products through torch's dense matmul and through oneDNN round differently: the
    same prompt's KV differs in its last bits, so neither may serve the other's blocks."""
    from specserve import LLM

    dirs = {}
    for backend in ("dense", "onednn"):
        llm = LLM("tiny", dtype="float32", checkpoint=tiny_llama[1], linear_backend=backend, kv_disk_dir=str(tmp_path),
                  kv_host_gib=0)
        dirs[backend] = llm.engine.kv_manager.tiers.disk.dir
    assert dirs["dense"] != dirs["onednn"] and dirs["dense"].parent == dirs["onednn"].parent == tmp_path
