"""The deployment's KV block store across hosts: the store's LRU and change log, workers sharing
blocks through it (each record verified on read), and engines serving each other's prefixes."""

from __future__ import annotations

import pytest
import torch
from test_tiers import PAYLOAD, _chain, _payload

from specserve.kv_cache.remote import KVBlockStore
from specserve.kv_cache.tiers import TieredKVStore, block_prefix


def _record(block_hash, payload: torch.Tensor, fingerprint: str = "fp") -> bytes:
    data = memoryview(payload.numpy()).cast("B")
    return block_prefix(fingerprint, block_hash, data) + bytes(data)


def test_the_store_keeps_recent_records_within_its_bytes_and_logs_its_index():
    hs = _chain(4)
    sizes = [len(_record(h, _payload(i))) for i, h in enumerate(hs)]  # headers differ by a few bytes
    store = KVBlockStore(sizes[0] + sizes[1] + max(sizes[2], sizes[3]))  # room for three of the four
    v1 = store.put("fp", [(h.value, _record(h, _payload(i))) for i, h in enumerate(hs[:3])])
    assert store.held("fp", [h.value for h in hs]) == 3 and store.held("other", [hs[0].value]) == 0
    assert len(store.get_run("fp", [hs[0].value, hs[1].value])) == 2  # hs[0], hs[1] now most recently used
    store.put("fp", [(hs[3].value, _record(hs[3], _payload(3)))])  # over budget: hs[2] goes
    assert store.held("fp", [hs[2].value]) == 0 and store.stats()["evicted"] == 1
    assert store.get_run("fp", [h.value for h in hs]) == store.get_run("fp", [hs[0].value, hs[1].value])
    # The change log: what a reader at v1 must apply, in order; a reader at 0 gets the whole index.
    version, events, whole = store.changes("fp", v1)
    assert not whole and events == [(hs[3].value, True), (hs[2].value, False)]
    version0, all_events, whole0 = store.changes("fp", 0)
    assert whole0 and version0 == version and {v for v, _ in all_events} == {hs[0].value, hs[1].value, hs[3].value}
    assert store.changes("other", 0)[1] == []
    store.drop("fp", [hs[0].value])
    assert store.held("fp", [hs[0].value]) == 0 and store.changes("fp", version)[1] == [(hs[0].value, False)]


def test_a_record_larger_than_the_store_is_logged_as_gone_so_senders_forget_it():
    small, big = _chain(2)
    record = _record(small, _payload(0))
    store = KVBlockStore(len(record))
    version = store.put("fp", [(small.value, record)])
    store.put("fp", [(big.value, _record(big, torch.zeros(2 * PAYLOAD, dtype=torch.uint8)))])
    assert store.held("fp", [big.value]) == 0 and store.used_bytes == len(record)
    assert store.changes("fp", version)[1] == [(big.value, False)]  # a sender's refresh drops it from its index


class _Direct:
    """A KVBlockStore called as its Ray actor handle is (`store.put.remote(...)`), in process;
    `after_put` runs once a put is done, before the caller hears back."""

    def __init__(self, store: KVBlockStore) -> None:
        self.store = store
        self.after_put = lambda: None

    def __getattr__(self, name: str):  # noqa: ANN204
        method = getattr(self.store, name)

        def call(*args):  # noqa: ANN002, ANN202
            out = method(*args)
            if name == "put":
                self.after_put()
            return out

        return type("Method", (), {"remote": staticmethod(call)})()


def test_a_sender_never_keeps_a_record_the_store_refused_whenever_its_index_refreshes(monkeypatch):
    """The store logs a record larger than itself as gone; the sender's refresher may read that
    event before the sender hears its put is done, and the sender must not then add it back."""
    from specserve.kv_cache.remote import RemoteTier
    from specserve.kv_cache.tiers import TierCounters

    monkeypatch.setattr(RemoteTier, "_call", staticmethod(lambda ref: ref))
    small, big, later = _chain(3, start=300)
    store = _Direct(KVBlockStore(len(_record(small, _payload(0))) + 64))
    tier = RemoteTier(store, "fp", PAYLOAD, TierCounters(), refresh_s=3600)
    try:
        for refreshed_first in (True, False):
            block = big if refreshed_first else later
            store.after_put = tier.refresh if refreshed_first else (lambda: None)
            tier._send([(block, torch.zeros(2 * PAYLOAD, dtype=torch.uint8))])
            tier.refresh()
            assert not tier.contains(block)
        tier._send([(small, _payload(0))])
        assert tier.contains(small) and len(tier) == 1
    finally:
        tier.close()


@pytest.fixture(scope="module")
def ray_store():
    """A private local Ray with the deployment's store actor."""
    ray = pytest.importorskip("ray")

    from specserve.disagg.launch import init_ray
    from specserve.kv_cache.remote import start_kv_store

    if ray.is_initialized():
        ray.shutdown()
    init_ray(num_cpus=2)
    store = start_kv_store(64 << 20, name="specserve-kv-store-test")
    yield store
    ray.shutdown()


def test_workers_share_blocks_through_the_store_and_never_serve_a_bad_record(ray_store):
    """A block one worker saved reaches another worker (its index refreshed from the store's log)
    and comes back verified; a record that is not the block asked for (damaged, or another
    block's) is counted as corrupt, dropped from the store and ends the run; a block evicted
    since the last refresh is a plain miss."""
    import ray

    writer = TieredKVStore("fp", PAYLOAD, remote_store=ray_store)
    reader = TieredKVStore("fp", PAYLOAD, host_bytes=1 << 20, remote_store=ray_store)
    other_model = TieredKVStore("fp-other", PAYLOAD, remote_store=ray_store)
    fresh = TieredKVStore("fp", PAYLOAD, remote_store=ray_store)  # starts before the bad records arrive
    hs = _chain(4, start=100)
    try:
        for i, h in enumerate(hs[:3]):
            writer.save(h, _payload(i))
        assert writer.flush()
        reader.remote.refresh()
        other_model.remote.refresh()
        assert all(reader.contains(h) for h in hs[:3]) and not reader.contains(hs[3])
        assert not other_model.contains(hs[0])  # records are per model fingerprint
        run = reader.fetch_run(hs)
        assert [b.tier for b in run] == ["remote"] * 3
        assert all(torch.equal(b.payload, _payload(i)) for i, b in enumerate(run))
        assert reader.counters.remote.hits == 3 and reader.counters.remote.hit_bytes == 3 * PAYLOAD
        assert reader.fetch(hs[0]).tier == "host"  # promoted to the reader's host tier

        damaged = bytearray(_record(hs[1], _payload(1)))
        damaged[-1] ^= 0x55
        wrong = _record(hs[0], _payload(0))  # a valid record of another block under hs[2]'s name
        ray.get(ray_store.put.remote("fp", [(hs[1].value, bytes(damaged)), (hs[2].value, wrong)]))
        fresh.remote.refresh()
        run = fresh.fetch_run(hs)
        assert len(run) == 1 and fresh.counters.corrupt == 1  # hs[1] refused: the run ends there
        assert ray.get(ray_store.held.remote("fp", [hs[1].value])) == 0  # and the store dropped it
        ray.get(ray_store.put.remote("fp", [(hs[1].value, _record(hs[1], _payload(1)))]))
        fresh.remote.refresh()
        run = fresh.fetch_run(hs)
        assert len(run) == 2 and fresh.counters.corrupt == 2  # hs[2]'s record holds another block
        ray.get(ray_store.drop.remote("fp", [hs[0].value]))  # gone before the next refresh
        assert writer.fetch_run(hs) == [] and writer.counters.corrupt == 0
    finally:
        for s in (writer, reader, other_model, fresh):
            s.close()


def test_engines_serve_each_others_prefixes_from_the_store(smollm_checkpoint, ray_store):
    """Two engines (two workers, which may be on two hosts) with only the store behind their pools:
    the second finds the prompts' blocks the first computed, loads them verified, and decodes
    exactly what an engine without any cache decodes."""
    from specserve import LLM, SamplingParams

    system = "You are a careful assistant who answers in full sentences. " * 10
    prompts = [system + f"Question {i}: what is item {i} for? " * 3 for i in range(3)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def engine(**kw):
        return LLM("smollm2-135m-instruct", dtype="float32", checkpoint=smollm_checkpoint, kv_cache_gib=0.05,
                   num_threads=1, **kw)

    want = [o.outputs[0].token_ids for o in engine(enable_prefix_caching=False).generate(prompts, params, use_tqdm=False)]
    first = engine(kv_remote_store="specserve-kv-store-test")
    assert [o.outputs[0].token_ids for o in first.generate(prompts, params, use_tqdm=False)] == want
    assert first.engine.kv_manager.tiers.flush()
    second = engine(kv_remote_store="specserve-kv-store-test")
    second.engine.kv_manager.tiers.remote.refresh()
    outs = second.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    st = second.engine.stats()
    full = [(len(second.tokenizer.encode(p)) - 1) // 16 * 16 for p in prompts]  # each prompt's full blocks
    # The first prompt's blocks all came from the store; the others' shared system prompt then
    # from the pool, their own tails from the store: every full block was found somewhere.
    assert st["kv_tier_remote_hits"] >= full[0] // 16 + 1
    assert [o.metrics.num_cached_prompt_tokens for o in outs] == full
    assert st["kv_tier_corrupt_blocks"] == 0
    assert second.engine.check_integrity()
    for llm in (first, second):
        llm.engine.close()


def test_a_started_store_outlives_the_handle_its_starter_dropped(ray_store):
    """launch() starts the store and drops the handle; the workers find it by name later."""
    import gc
    import time

    import ray

    from specserve.kv_cache.remote import find_kv_store, start_kv_store

    start_kv_store(1 << 20, name="specserve-kv-store-dropped")
    gc.collect()
    time.sleep(1.0)
    assert ray.get(find_kv_store("specserve-kv-store-dropped").stats.remote())["capacity_bytes"] == 1 << 20


def test_a_missing_store_is_a_clear_error(smollm_checkpoint, ray_store):
    from specserve import LLM
    from specserve.errors import ConfigError

    with pytest.raises(ConfigError, match="no KV block store"):
        LLM("smollm2-135m-instruct", dtype="float32", checkpoint=smollm_checkpoint, kv_cache_gib=0.02,
            num_threads=1, kv_remote_store="no-such-store")
