"""A two-node Ray cluster on this machine: workers on different nodes exchange KV through Ray."""

from __future__ import annotations

import pytest

from specserve import SamplingParams

ray = pytest.importorskip("ray")

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
