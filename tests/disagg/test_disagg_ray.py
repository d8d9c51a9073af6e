"""Disaggregated serving on a local Ray instance: exactness, speculation, worker death, Ray transport."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from specserve import SamplingParams

ray = pytest.importorskip("ray")

from specserve.disagg.launch import DisaggClient, connect, init_ray, start_worker  # noqa: E402
from specserve.server.async_engine import EngineStoppedError  # noqa: E402

MODEL = "smollm2-135m-instruct"
# float32 like the colocated smollm_llm it is compared with (a GGUF path alone would default to `auto`)
ENGINE = dict(dtype="float32", quantization="none", kv_cache_gib=0.25, num_threads=1, max_num_batched_tokens=64)
TOPICS = ["the sea", "bread", "a robot", "winter", "trains", "music", "the moon", "cats", "rivers", "chess"]
PROMPTS = ([f"Write one sentence about {t}." for t in TOPICS]
           + [f"def {name}(x):\n    # " + "step by step, " * (3 + i) for i, name in enumerate(TOPICS)])


@pytest.fixture(scope="module")
def deployment(smollm_path):
    """One prefill worker and two decode workers (n-gram speculation) on a private local Ray."""
    if ray.is_initialized():
        ray.shutdown()
    init_ray(num_cpus=2)
    actors = [start_worker("prefill", 0, MODEL, ENGINE, transfer_timeout_s=20)]
    actors += [start_worker("decode", i, MODEL, ENGINE | {"spec_method": "ngram"}, transfer_timeout_s=20)
               for i in range(2)]
    router = connect(MODEL, actors, transfer_timeout_s=20, local_prefill_tokens=0)  # every prompt goes remote
    client = DisaggClient(router)
    yield client
    client.close()
    ray.shutdown()


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _integrity(client):
    for w in client.router.prefill + client.router.decode:
        if w.alive:
            assert ray.get(w.actor.check_integrity.remote())


def test_disagg_greedy_equals_colocated_with_and_without_speculation(deployment, smollm_llm):
    params = SamplingParams(max_tokens=24, temperature=0.0)
    want = _tokens(smollm_llm.generate(PROMPTS, params, use_tqdm=False))
    assert len(PROMPTS) == 20
    spec_outs = deployment.generate(PROMPTS, params)
    assert [o.error for o in spec_outs] == [None] * 20
    assert _tokens(spec_outs) == want
    assert sum(o.metrics.extra.get("num_draft_tokens", 0) for o in spec_outs) > 0  # it did speculate
    deployment.router.set_speculation(False)
    try:
        plain_outs = deployment.generate(PROMPTS, params)
    finally:
        deployment.router.set_speculation(True)
    assert _tokens(plain_outs) == want
    assert sum(o.metrics.extra.get("num_draft_tokens", 0) for o in plain_outs) == 0
    used = {o.metrics.extra["decode_worker"] for o in spec_outs + plain_outs}
    assert used == {"decode-0", "decode-1"}  # both decode workers took requests
    assert deployment.router.transfers and all(t["ok"] for t in deployment.router.transfers)
    # What the server's /v1/models card names (audit --url computes its reference in it): the decode workers'
    assert deployment.router.engine.precision == {"quantization": "none", "dtype": "float32", "kv_cache_dtype": "auto"}
    _integrity(deployment)


def test_forced_ray_transport_matches(deployment, smollm_llm):
    prompts = [f"A long story about {t}: " + "and then, " * (5 + i) for i, t in enumerate(TOPICS[:4])]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    want = _tokens(smollm_llm.generate(prompts, params, use_tqdm=False))
    deployment.router.transport = "ray"
    n0 = len(deployment.router.prefills)
    try:
        outs = deployment.generate(prompts, params)
    finally:
        deployment.router.transport = "auto"
    assert _tokens(outs) == want
    assert [p["transport"] for p in deployment.router.prefills[n0:]] == ["ray"] * 4


def test_short_prompts_are_prefilled_on_the_decode_worker(deployment, smollm_llm):
    router = deployment.router
    params = SamplingParams(max_tokens=8, temperature=0.0)
    prompts = ["Name a colour.", "Tell me a fairly long story about " + "a curious cat and " * 10 + "a dog."]
    want = _tokens(smollm_llm.generate(prompts, params, use_tqdm=False))
    router.local_prefill_tokens = 16
    n0 = len(router.prefills)
    try:
        outs = deployment.generate(prompts, params)
    finally:
        router.local_prefill_tokens = 0
    assert _tokens(outs) == want
    assert len(router.prefills) == n0 + 1  # only the long prompt used the prefill worker


def test_prompt_logprobs_are_computed_on_the_decode_worker(deployment, smollm_llm):
    """Scoring a prompt (echo with logprobs; lm-eval-harness) needs every prompt row's logits, which
    a prefill worker does not send: the router has the decode worker compute the whole prompt, and
    the values equal a co-located engine's, cached prompt or not."""
    prompts = ["Repeat after me: " + "the quick brown fox jumps over the lazy dog. " * 4, PROMPTS[12]]
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=True, prompt_logprobs=2)
    want = smollm_llm.generate(prompts, params, use_tqdm=False)
    n0 = len(deployment.router.prefills)
    for _ in range(2):  # the second time the decode worker holds the prompt in its prefix cache
        got = deployment.generate(prompts, params)
        assert [o.error for o in got] == [None, None]
        for o, w in zip(got, want):
            assert o.outputs[0].token_ids == w.outputs[0].token_ids
            assert len(o.prompt_logprobs) == len(w.prompt_logprobs) == len(w.prompt_token_ids)
            assert o.prompt_logprobs[0] is None and o.prompt_top_logprobs[0] is None
            assert o.prompt_logprobs[1:] == pytest.approx(w.prompt_logprobs[1:], abs=1e-3)
            for a, b in zip(o.prompt_top_logprobs[1:], w.prompt_top_logprobs[1:]):
                assert [t for t, _ in a] == [t for t, _ in b] and [v for _, v in a] == pytest.approx([v for _, v in b], abs=1e-3)
    assert len(deployment.router.prefills) == n0  # no prefill worker: it would not send those rows
    _integrity(deployment)


def test_full_prefix_hit_skips_prefill(deployment, smollm_llm):
    prompt = "Repeat after me: " + "the quick brown fox jumps over the lazy dog. " * 4
    params = SamplingParams(max_tokens=8, temperature=0.0)
    first = deployment.generate([prompt], params)[0]
    n0 = len(deployment.router.prefills)
    again = deployment.generate([prompt], params)[0]
    assert len(deployment.router.prefills) == n0  # no prefill worker involved the second time
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.metrics.num_cached_prompt_tokens >= 32
    _integrity(deployment)


@pytest.mark.slow
def test_workers_sharing_a_disk_tier_are_one_kv_store(deployment, smollm_llm, tmp_path):
    """Prefill and decode workers given the same --kv-disk-dir write every prefix block there; a
    prompt whose blocks are all stored goes to a decode worker without any prefill worker, and
    that worker loads them (verified) from the store: same tokens, no second prefill."""
    engine = ENGINE | {"kv_disk_dir": str(tmp_path)}
    actors = [start_worker("prefill", 0, MODEL, engine, transfer_timeout_s=20),
              start_worker("decode", 0, MODEL, engine, transfer_timeout_s=20),
              start_worker("decode", 1, MODEL, engine, transfer_timeout_s=20)]
    router = connect(MODEL, actors, transfer_timeout_s=20, local_prefill_tokens=0)
    client = DisaggClient(router)
    try:
        assert router.kv_store is not None and router.kv_store.startswith(str(tmp_path)), \
            [w.info.get("kv_store") for w in router.prefill + router.decode]
        prompt = PROMPTS[-1] * 3  # ~150 tokens: several full blocks
        params = SamplingParams(max_tokens=12, temperature=0.0)
        (want,) = _tokens(smollm_llm.generate([prompt], params, use_tqdm=False))
        (first,) = client.generate([prompt], params)
        assert first.outputs[0].token_ids == want and len(router.prefills) == 1
        for w in router.prefill + router.decode:  # every worker's writes reach the store
            ray.get(w.actor.check_integrity.remote())
        import time

        time.sleep(1.0)
        router._prefix_index.clear()  # no worker's pool counts: only the store can answer
        # The other decode worker, which never saw the prompt, gets it: it must load the blocks.
        served = first.metrics.extra["decode_worker"]
        other = next(w for w in router.decode if w.name != served)
        for w in router.decode:
            w.alive = w is other
        (again,) = client.generate([prompt], params)
        assert again.outputs[0].token_ids == want and again.metrics.extra["decode_worker"] == other.name
        assert len(router.prefills) == 1  # the prompt was not prefilled a second time
        tier = ray.get(other.actor.stats.remote())["kv_tier"]
        assert tier["disk_hits"] >= 5 and tier["corrupt_blocks"] == 0
    finally:
        client.close()
        for a in actors:
            ray.kill(a)


def test_killing_a_decode_worker_mid_stream_loses_no_request(deployment, smollm_llm):
    """Really SIGKILL a decode worker's process while it streams; every request still completes."""
    router = deployment.router
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    prompts = PROMPTS[:6]
    want = _tokens(smollm_llm.generate(prompts, params, use_tqdm=False))
    killed: list[str] = []
    lock = threading.Lock()

    def on_output(out):
        if killed or len(out.outputs[0].token_ids) < 8 or out.finished:
            return
        job = router._jobs.get(out.request_id)
        with lock:
            if killed or job is None or job.worker is None:
                return
            victim = job.worker
            killed.append(victim.name)
        os.kill(victim.info["pid"], signal.SIGKILL)

    outs = deployment.generate(prompts, params, on_output=on_output)
    assert killed, "the kill never happened"
    assert [o.error for o in outs] == [None] * len(outs)
    assert _tokens(outs) == want  # resumed requests continue exactly where they stopped
    assert any(o.metrics.extra.get("attempts", 1) > 1 for o in outs)
    dead = [w for w in router.decode if not w.alive]
    assert [w.name for w in dead] == killed
    _integrity(deployment)  # the survivors leak nothing

    # With no decode worker left, requests end with a clear error instead of hanging.
    for w in router.decode:
        if w.alive:
            ray.kill(w.actor)
    # Whether the router has already seen the last death decides which clear error comes back:
    # refused at submission (no live workers) or ended with an error once routing finds none.
    try:
        err = deployment.generate(["hello"], SamplingParams(max_tokens=4), timeout=120)[0]
    except EngineStoppedError as exc:
        assert "no live workers" in str(exc)
    else:
        assert err.finish_reason == "error" and "no decode worker" in err.error


@pytest.mark.slow
def test_a_draft_models_prompt_kv_travels_over_both_transports(deployment, smollm_llm):
    """Decode workers speculating with a draft model get the draft's prompt KV from the prefill
    worker (which holds the same draft, its policy off), through shared memory and through Ray:
    outputs equal co-located plain decoding and every draft transfer arrives."""
    draft = {"draft_model": MODEL, "draft_num_layers": 6, "spec_policy": "always", "num_spec_tokens": 3,
             "profile_spec_costs": False}
    actors = [start_worker("prefill", 7, MODEL, ENGINE | draft, transfer_timeout_s=20),
              start_worker("decode", 7, MODEL, ENGINE | draft, transfer_timeout_s=20)]
    client = DisaggClient(connect(MODEL, actors, transfer_timeout_s=20, local_prefill_tokens=0))
    try:
        router = client.router
        pre, dec = router.prefill[0], router.decode[0]
        assert pre.info["drafts_for_decode"] and pre.info["draft_kv"] == dec.info["draft_kv"] is not None
        prompts = [f"A long story about {t}: " + "and then, " * (6 + i) for i, t in enumerate(TOPICS[:4])]
        params = SamplingParams(max_tokens=12, temperature=0.0)
        want = _tokens(smollm_llm.generate(prompts, params, use_tqdm=False))
        outs = client.generate(prompts[:2], params)
        router.transport = "ray"
        outs += client.generate(prompts[2:], params)
        assert _tokens(outs) == want
        assert sum(o.metrics.extra.get("num_draft_tokens", 0) for o in outs) > 0
        deadline = time.time() + 10
        while len(router.draft_transfers) < 4 and time.time() < deadline:
            time.sleep(0.1)
        assert [d["ok"] for d in router.draft_transfers] == [True] * 4
        assert [p["transport"] for p in router.prefills] == ["shm", "shm", "ray", "ray"]
        assert all(p["draft_bytes"] > 0 for p in router.prefills)
        # A one-token answer over Ray ends before its draft's KV: the prefill worker asks the
        # decode worker between its draft passes and stops.
        long_prompt = "Once upon a time, " * 200  # ~1k tokens: 16 draft passes of 64
        m = len(smollm_llm.tokenizer.encode(long_prompt)) - 1
        out = client.generate([long_prompt], SamplingParams(max_tokens=1, temperature=0.0))[0]
        assert out.error is None
        deadline = time.time() + 30
        while len(router.prefills) < 5 and time.time() < deadline:  # its prefill returns after the draft
            time.sleep(0.05)
        assert router.prefills[-1]["num_tokens"] == m
        full = m * pre.info["draft_kv"]["layout"]["num_layers"] * 2 * 3 * 64 * 4  # 3 kv heads x 64, float32
        assert 0 < router.prefills[-1]["draft_bytes"] < full / 2
        _integrity(client)
    finally:
        client.close()
        for a in actors:
            ray.kill(a)


@pytest.mark.slow
def test_launch_with_a_kv_store_shares_prefill_blocks_through_it(deployment, smollm_llm):
    """launch(kv_store_gib=...) starts the deployment's block store and points every worker at it:
    the prefill worker's blocks land there, the router sees a prompt stored in full (which would
    then skip the prefill worker), and outputs equal co-located decoding."""
    from specserve.disagg.launch import launch
    from specserve.kv_cache.remote import STORE_NAME, find_kv_store

    client = DisaggClient(launch(MODEL, ENGINE, 1, 1, kv_store_gib=0.25, local_prefill_tokens=0, transfer_timeout_s=20))
    try:
        router = client.router
        assert router.remote_store is not None
        prompt = "A long story about the store: " + "and then, " * 12
        params = SamplingParams(max_tokens=8, temperature=0.0)
        want = _tokens(smollm_llm.generate([prompt], params, use_tqdm=False))
        assert _tokens(client.generate([prompt], params)) == want
        tokens = smollm_llm.tokenizer.encode(prompt)
        hashes = router._hashes(tokens[: len(tokens) - 1])
        assert len(hashes) >= 2
        deadline = time.time() + 10  # the workers send their blocks from a background thread
        while not client.call(router._stored(hashes)) and time.time() < deadline:
            time.sleep(0.1)
        assert client.call(router._stored(hashes))
        assert ray.get(find_kv_store(STORE_NAME).stats.remote())["blocks"] >= len(hashes)
        _integrity(client)
    finally:
        client.close()
        for w in client.router.prefill + client.router.decode:
            ray.kill(w.actor)
