"""A two-node Ray cluster on this machine: workers on different nodes exchange KV through Ray."""

from __future__ import annotations

import pytest

from specserve import SamplingParams

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # a second Ray node on 2 cores: about 40 s

from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from specserve.disagg.launch import DisaggClient, connect, start_worker  # noqa: E402

MODEL = "smollm2-135m-instruct"
ENGINE = dict(dtype="float32", quantization="none", kv_cache_gib=0.25, num_threads=1)  # as smollm_llm


def test_prefill_and_decode_on_two_ray_nodes(smollm_path, smollm_llm):
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    client = None
    try:
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        assert len(nodes) == 2

        def on(node):
            return NodeAffinitySchedulingStrategy(node, soft=False)

        actors = [start_worker("prefill", 0, MODEL, ENGINE, scheduling_strategy=on(nodes[0])),
                  start_worker("decode", 0, MODEL, ENGINE, scheduling_strategy=on(nodes[1]))]
        router = connect(MODEL, actors, local_prefill_tokens=0)
        assert router.prefill[0].node_id != router.decode[0].node_id
        client = DisaggClient(router)
        prompts = ["The three primary colours are", "Write a haiku about rain. " * 3]
        params = SamplingParams(max_tokens=16, temperature=0.0)
        outs = client.generate(prompts, params)
        want = [o.outputs[0].token_ids for o in smollm_llm.generate(prompts, params, use_tqdm=False)]
        assert [o.outputs[0].token_ids for o in outs] == want
        assert [p["transport"] for p in router.prefills] == ["ray", "ray"]  # chosen by node, not forced
        assert all(t["ok"] for t in router.transfers)
        for w in router.prefill + router.decode:
            assert ray.get(w.actor.check_integrity.remote())
    finally:
        if client is not None:
            client.close()
        ray.shutdown()
        cluster.shutdown()


def test_the_kv_store_moves_blocks_between_two_ray_nodes():
    """The deployment's block store across hosts: blocks a process on one node saved are found,
    fetched through Ray's object store and verified by a worker on the other node."""
    import torch

    from specserve.kv_cache.block_pool import hash_block_tokens
    from specserve.kv_cache.remote import start_kv_store
    from specserve.kv_cache.tiers import TieredKVStore

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    try:
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        here = ray.get_runtime_context().get_node_id()
        there = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here)
        store = start_kv_store(16 << 20, name="specserve-kv-store-2n")
        hashes, parent = [], None
        for i in range(3):
            parent = hash_block_tokens(parent, [7 * i + j for j in range(16)])
            hashes.append(parent)
        payloads = [torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))
                    for i in range(3)]
        writer = TieredKVStore("fp-2n", 4096, remote_store=store)
        for h, p in zip(hashes, payloads):
            writer.save(h, p)
        assert writer.flush()

        def fetch_elsewhere(store, hashes):  # runs on the other node
            reader = TieredKVStore("fp-2n", 4096, remote_store=store)
            try:
                run = reader.fetch_run(hashes)
                return ray.get_runtime_context().get_node_id(), [b.payload for b in run], [b.tier for b in run]
            finally:
                reader.close()

        task = ray.remote(num_cpus=1, scheduling_strategy=NodeAffinitySchedulingStrategy(there, soft=False))(fetch_elsewhere)
        node, got, tiers = ray.get(task.remote(store, hashes), timeout=120)
        assert node == there != here
        assert tiers == ["remote"] * 3 and all(torch.equal(a, b) for a, b in zip(got, payloads))
        writer.close()
    finally:
        ray.shutdown()
        cluster.shutdown()
