"""Lower-tier blocks loaded layer by layer beside the forward (kv_cache/layer_load.py): every
layer verified before use, a damaged layer named and its block refused, the forward never
overtaking the loader, and an engine that recovers from a block failing mid-step."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from specserve.kv_cache.block_pool import hash_block_tokens
from specserve.kv_cache.layer_load import LAYERS_PER_READ, KVLoad, LayerLoader
from specserve.kv_cache.tiers import (
    SUFFIX,
    DiskRef,
    TieredKVStore,
    block_file_name,
    block_prefix,
    verified_payload,
)

LAYERS = [16, 24, 8, 16, 8, 24]  # bytes per layer of one block; the payload is their sum
PAYLOAD = sum(LAYERS)


def _chain(n: int) -> list:
    hashes, parent = [], None
    for i in range(n):
        parent = hash_block_tokens(parent, [4 * i + j for j in range(4)])
        hashes.append(parent)
    return hashes


def _payload(seed: int) -> torch.Tensor:
    return (torch.arange(PAYLOAD, dtype=torch.int32) * 7 + seed).to(torch.uint8)


def _store(path: Path, host: int = 0, layers: list[int] | None = LAYERS) -> TieredKVStore:
    return TieredKVStore("fp", PAYLOAD, host_bytes=host, disk_dir=path, disk_bytes=1 << 20, layer_bytes=layers)


def _filled(path: Path, n: int, layers: list[int] | None = LAYERS) -> list:
    hs = _chain(n)
    store = _store(path, layers=layers)
    for i, h in enumerate(hs):
        store.save(h, _payload(i))
    assert store.flush()
    store.close()
    return hs


class Pool:
    """Destination blocks, and the order layers were written in."""

    def __init__(self, num_blocks: int = 8) -> None:
        self.data = np.zeros((num_blocks, PAYLOAD), dtype=np.uint8)
        self.writes: list[tuple[int, int]] = []
        self.offsets = [sum(LAYERS[:i]) for i in range(len(LAYERS))]

    def write(self, layer: int, block_id: int, data: np.ndarray) -> None:
        a = self.offsets[layer]
        self.data[block_id, a : a + LAYERS[layer]] = data
        self.writes.append((layer, block_id))


def test_disk_hits_load_layer_by_layer_verified_and_promoted(tmp_path):
    hs = _filled(tmp_path, 3)
    store = _store(tmp_path, host=1 << 20)
    run = store.fetch_run(hs, deferred=True)
    assert [b.tier for b in run] == ["disk"] * 3 and all(isinstance(b.payload, DiskRef) for b in run)
    assert store.counters.disk.hits == 0  # counted once the payload is verified, not at lookup
    pool = Pool()
    loader = LayerLoader([KVLoad(5 + i, b.payload) for i, b in enumerate(run)], LAYERS, pool.write, store)
    assert loader.reads_disk
    seen: list[int] = []

    def forward() -> None:  # what the model does: wait for layer l, then read it
        for layer in range(len(LAYERS)):
            loader.wait(layer + 1)
            seen.append(sum(1 for w in pool.writes if w[0] == layer))

    loader.start()
    t = threading.Thread(target=forward)
    t.start()
    t.join(timeout=30)
    assert loader.finish() == {}
    assert seen == [3] * len(LAYERS)  # every block's layer l was in place before layer l ran
    runs = [w[0] // LAYERS_PER_READ for w in pool.writes]
    assert runs == sorted(runs) and len(set(runs)) > 1  # layer-major, a run of layers per read
    for i in range(3):
        assert np.array_equal(pool.data[5 + i], _payload(i).numpy())
    assert store.counters.disk.hits == 3 and store.counters.disk.hit_bytes == 3 * PAYLOAD
    assert store.host is not None and all(store.host.contains(h) for h in hs)  # promoted
    store.close()


@pytest.mark.parametrize("damage", ["flip_layer_2", "truncated_after_lookup", "deleted_after_lookup",
                                    "replaced_after_lookup"])
def test_a_layer_that_fails_is_named_its_block_refused_and_the_others_load(tmp_path, damage):
    """Damage is counted and the file deleted; a file another process removed or renamed a new one
    over between the lookup and the load (LRU eviction, a rewrite) fails the block without either."""
    hs = _filled(tmp_path, 3)
    store = _store(tmp_path)
    run = store.fetch_run(hs, deferred=True)
    assert len(run) == 3
    victim = run[1].payload.path
    data = bytearray(victim.read_bytes())
    if damage == "flip_layer_2":  # the header is intact, so the lookup accepted it
        data[run[1].payload.payload_offset + LAYERS[0] + LAYERS[1] + 3] ^= 0x40
        victim.write_bytes(bytes(data))
    elif damage == "deleted_after_lookup":
        victim.unlink()
    elif damage == "replaced_after_lookup":  # as DiskTier._write does: a new file renamed into place
        tmp = victim.with_name(victim.name + ".tmp")
        tmp.write_bytes(bytes(data))
        tmp.replace(victim)
    else:
        victim.write_bytes(bytes(data[: len(data) - LAYERS[-1] // 2]))
    pool = Pool()
    loader = LayerLoader([KVLoad(i, b.payload) for i, b in enumerate(run)], LAYERS, pool.write, store)
    loader.start()
    failed = loader.finish()
    assert list(failed) == [1]
    if damage == "flip_layer_2":
        assert "layer 2" in failed[1]
        assert (2, 1) not in pool.writes and (1, 1) in pool.writes  # layers before the bad one were used
    for i in (0, 2):
        assert np.array_equal(pool.data[i], _payload(i).numpy())
    assert store.counters.disk.hits == 2
    if damage in ("deleted_after_lookup", "replaced_after_lookup"):
        assert "after the lookup" in failed[1] and store.counters.corrupt == 0
        assert victim.exists() == (damage == "replaced_after_lookup")  # nothing deleted that was not damaged
        if victim.exists():
            assert torch.equal(store.fetch(hs[1]).payload, _payload(1))  # the new file is found again
    else:
        assert store.counters.corrupt == 1 and not victim.exists()
        assert store.fetch(hs[1]) is None  # never served afterwards
    store.close()


def test_a_torn_file_is_refused_at_lookup_and_the_run_ends_there(tmp_path):
    hs = _filled(tmp_path, 3)
    victim = tmp_path / "fp" / block_file_name(hs[1].value)
    victim.write_bytes(victim.read_bytes()[:-5])
    store = _store(tmp_path)
    run = store.fetch_run(hs, deferred=True)
    assert len(run) == 1 and store.counters.corrupt == 1 and not victim.exists()
    store.close()


def test_files_without_layer_digests_are_read_whole_and_verified(tmp_path):
    hs = _filled(tmp_path, 2, layers=None)  # as an earlier specserve wrote them
    store = _store(tmp_path)
    run = store.fetch_run(hs, deferred=True)
    assert [b.tier for b in run] == ["disk", "disk"]
    assert all(isinstance(b.payload, torch.Tensor) for b in run)
    assert torch.equal(run[1].payload, _payload(1)) and store.counters.disk.hits == 2
    store.close()


def test_a_loader_whose_writer_raises_fails_every_block_and_never_hangs_the_forward(tmp_path):
    hs = _filled(tmp_path, 2)
    store = _store(tmp_path)
    run = store.fetch_run(hs, deferred=True)

    def broken(layer: int, block_id: int, data: np.ndarray) -> None:
        if layer == 1:
            raise RuntimeError("device gone")

    loader = LayerLoader([KVLoad(i, b.payload) for i, b in enumerate(run)], LAYERS, broken, store)
    loader.start()
    loader.wait(len(LAYERS))  # returns: the loader reports instead of leaving the forward waiting
    failed = loader.finish()
    assert set(failed) == {0, 1} and all("device gone" in why for why in failed.values())
    store.close()


def test_auto_loads_layer_by_layer_only_with_a_cpu_to_spare(smollm_llm, monkeypatch):
    import specserve.engine.runner as runner_mod
    from specserve import LLM
    from specserve.errors import ConfigError

    runner = smollm_llm.engine.runner
    assert runner.tier_load == "auto"
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(runner_mod, "usable_cpus", lambda: 2)
    assert not runner.loads_layer_wise()  # every CPU computes: loading beside them only slows them
    monkeypatch.setattr(runner_mod, "usable_cpus", lambda: 3)
    assert runner.loads_layer_wise()
    for mode, want in (("layer", True), ("whole", False)):
        monkeypatch.setattr(runner, "tier_load", mode)
        assert runner.loads_layer_wise() is want
    with pytest.raises(ConfigError, match="kv_tier_load"):
        LLM("smollm2-135m-instruct", kv_tier_load="sometimes")


def test_without_a_thread_to_spare_the_loader_loads_everything_in_finish(tmp_path, monkeypatch):
    hs = _filled(tmp_path, 2)
    store = _store(tmp_path)
    run = store.fetch_run(hs, deferred=True)
    pool = Pool()
    loader = LayerLoader([KVLoad(i, b.payload) for i, b in enumerate(run)], LAYERS, pool.write, store)

    def refuse(self) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    assert loader.start() is False  # the runner then loads before the forward
    assert loader.finish() == {}
    for i in range(2):
        assert np.array_equal(pool.data[i], _payload(i).numpy())
    store.close()


def test_a_whole_record_is_checked_by_its_layer_crcs_where_the_layout_is_known():
    """The remote store's records and eager disk reads: per-layer CRC-32s when the reader knows the
    layout, the BLAKE2b otherwise; damage is refused either way, naming the layer with the CRCs."""
    h = _chain(1)[0]
    data = memoryview(_payload(3).numpy()).cast("B")
    record = bytearray(block_prefix("fp", h, data, LAYERS) + bytes(data))
    assert bytes(verified_payload(bytes(record), "fp", h, PAYLOAD, LAYERS)) == bytes(data)
    assert bytes(verified_payload(bytes(record), "fp", h, PAYLOAD)) == bytes(data)  # BLAKE2b path
    record[-(LAYERS[-1] + 2)] ^= 0x10  # a byte of layer 4
    with pytest.raises(ValueError, match="layer 4 fails its CRC"):
        verified_payload(bytes(record), "fp", h, PAYLOAD, LAYERS)
    with pytest.raises(ValueError, match="digest mismatch"):
        verified_payload(bytes(record), "fp", h, PAYLOAD)
    plain = block_prefix("fp", h, data) + bytes(data)  # no per-layer CRCs: the BLAKE2b decides
    assert bytes(verified_payload(plain, "fp", h, PAYLOAD, LAYERS)) == bytes(data)


def test_a_payload_of_another_layout_is_refused():
    with pytest.raises(RuntimeError, match="does not match"):
        LayerLoader([KVLoad(0, torch.zeros(3, dtype=torch.uint8))], LAYERS, Pool().write, None)


# ---------------------------------------------------------------------- the engine
SYSTEM = "You are a careful assistant who answers in full sentences. " * 12
PROMPTS = [SYSTEM + f"Conversation {i}: " + f"tell me about item {i} and why it matters. " * (6 + i) for i in range(4)]


def _engine(ckpt, **kw):
    from specserve import LLM

    return LLM("smollm2-135m-instruct", checkpoint=ckpt, kv_cache_gib=0.02, num_threads=1, kv_tier_load="layer", **kw)


def _outputs(llm) -> list[list[int]]:
    from specserve import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_engine_loads_layer_by_layer_exactly_and_recovers_from_a_block_failing_mid_step(smollm_checkpoint, tmp_path):
    """4-bit blocks (the native decoder stack, run in groups of layers while loading): a
    restart on a disk tier loads prefixes beside the forward with outputs equal to no caching;
    a block whose payload is damaged behind an intact header fails mid-step, and the requests
    that read it are recomputed, exact, with the block refused and the cache consistent."""
    plain = _engine(smollm_checkpoint, quantization="int4", enable_prefix_caching=False)
    reference = _outputs(plain)
    del plain
    first = _engine(smollm_checkpoint, quantization="int4", kv_disk_dir=str(tmp_path))
    assert _outputs(first) == reference
    first.engine.close()

    again = _engine(smollm_checkpoint, quantization="int4", kv_disk_dir=str(tmp_path))
    assert again.engine.runner.model.model.native_stack is not None  # the group path is the one tested
    assert _outputs(again) == reference
    st = again.engine.stats()
    assert st["kv_tier_disk_hits"] >= 8 and st["kv_tier_layer_wise_steps"] >= 1
    assert st["kv_tier_corrupt_blocks"] == 0 and again.engine.check_integrity()
    assert "layer by layer beside the forward" in again.engine.describe()["KV tiers"]
    again.engine.close()

    # Damage the payload (not the header) of the system prompt's first block, which every prompt reads.
    first_block = next(f for f in sorted(tmp_path.rglob(f"*{SUFFIX}")) if b'"parent":null' in f.read_bytes()[:4096])
    data = bytearray(first_block.read_bytes())
    data[len(data) // 2] ^= 0x01
    first_block.write_bytes(bytes(data))
    third = _engine(smollm_checkpoint, quantization="int4", kv_disk_dir=str(tmp_path))
    assert _outputs(third) == reference
    st = third.engine.stats()
    assert st["kv_tier_corrupt_blocks"] == 1 and st["kv_tier_layer_wise_steps"] >= 1
    assert st["num_preemptions"] >= 1 and st["kv_tier_requeued_requests"] >= 1  # they went back to the queue
    assert third.engine.check_integrity() and third.engine.kv_manager.check_integrity([])
    # The damaged file was deleted; the block, recomputed, was written again, whole this time.
    disk = third.engine.kv_manager.tiers.disk
    assert disk.flush()
    entry = next(e for e in list(disk._index.values()) if e.path == first_block)
    assert disk.read(entry.block_hash) is not None and disk.counters.corrupt == 1
    third.engine.close()


@pytest.mark.slow
def test_engine_without_layer_wise_loads_is_exact_too(smollm_checkpoint, tmp_path):
    """The float path (module by module) and loads verified whole before the forward give the same tokens."""
    ref = _outputs(_engine(smollm_checkpoint, dtype="float32", quantization="none", enable_prefix_caching=False))
    first = _engine(smollm_checkpoint, dtype="float32", quantization="none", kv_disk_dir=str(tmp_path))
    _outputs(first)
    first.engine.close()
    for layer_wise in (True, False):
        llm = _engine(smollm_checkpoint, dtype="float32", quantization="none", kv_disk_dir=str(tmp_path))
        llm.engine.runner.tier_load = "layer" if layer_wise else "whole"
        assert _outputs(llm) == ref
        st = llm.engine.stats()
        assert st["kv_tier_disk_hits"] >= 8
        assert (st["kv_tier_layer_wise_steps"] > 0) == layer_wise
        assert ("beside the forward" if layer_wise else "before the forward") in llm.engine.describe()["KV tiers"]
        llm.engine.close()
