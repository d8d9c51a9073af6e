"""Worker failures in disaggregated serving: recovery, truthful health, no leaked files or gauges."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from prometheus_client import CollectorRegistry

from specserve import SamplingParams
from specserve.disagg.kv_transfer import (
    SHM_DIR,
    ChannelFiles,
    KVLayout,
    TransferDescriptor,
    new_transfer_id,
)
from specserve.disagg.router import DisaggFrontend, DisaggRouter, WorkerHandle
from specserve.engine.engine import RequestPreparer
from specserve.server.async_engine import EngineStoppedError
from specserve.server.metrics import DisaggMetrics, ServerMetrics

MODEL = "smollm2-135m-instruct"
# float32 like the colocated smollm_llm the outputs are compared with
ENGINE = dict(
    dtype="float32",
    quantization="none",
    kv_cache_gib=0.25,
    num_threads=1,
    max_num_batched_tokens=64,
)
TOPICS = ["the sea", "bread", "a robot", "winter", "trains", "music"]
PROMPTS = [
    f"Tell me a long story about {t}: " + "and then, " * (4 + i) for i, t in enumerate(TOPICS)
]


def _our_channel_files() -> set[str]:
    """Channel files named by this process's routers (transfer ids start with the router's pid)."""
    return {f for f in os.listdir(SHM_DIR) if f.startswith(f"specserve-kv-{os.getpid()}-")}


def _wait_until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


# ---------------------------------------------------------------------- without Ray
def _info(name: str, role: str) -> dict:
    fp = {
        "model": "m",
        "layout": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 4, "dtype": "float32"},
        "quantization": "none",
        "kv_cache_dtype": "auto",
        "vocab_size": 10,
        "tokenizer": "t",
    }
    return {
        "name": name,
        "role": role,
        "fingerprint": fp,
        "speculation": "none",
        "block_size": 4,
        "num_blocks": 100,
        "max_num_seqs": 8,
    }


def _router(num_prefill: int = 1, num_decode: int = 2) -> DisaggRouter:
    workers = [WorkerHandle(None, _info(f"prefill-{i}", "prefill")) for i in range(num_prefill)]
    workers += [WorkerHandle(None, _info(f"decode-{i}", "decode")) for i in range(num_decode)]
    front = DisaggFrontend("m", RequestPreparer(None, 10, 64, 400), None, False)
    return DisaggRouter(front, workers)


def test_worker_tier_counters_reach_metrics_as_they_grow_and_after_a_restart():
    """A disaggregated server exports each worker's lower-tier hits, bytes, load time and refused
    blocks (cumulative figures in its reports), per tier."""
    registry = CollectorRegistry()
    metrics = DisaggMetrics(registry)

    def value(name, **labels):
        return registry.get_sample_value(name, {"role": "decode", "worker": "decode-0", **labels})

    metrics.observe_worker("decode", "decode-0", {"kv_tier": {"remote_hits": 4, "remote_hit_bytes": 400,
                                                              "remote_load_s": 0.5, "corrupt_blocks": 1}})
    metrics.observe_worker("decode", "decode-0", {"kv_tier": {"remote_hits": 6, "remote_hit_bytes": 600,
                                                              "remote_load_s": 0.75, "corrupt_blocks": 1,
                                                              "disk_hits": 2, "disk_hit_bytes": 200, "disk_load_s": 0.1}})
    assert value("specserve_worker_kv_tier_hit_blocks_total", tier="remote") == 6
    assert value("specserve_worker_kv_tier_hit_bytes_total", tier="disk") == 200
    assert value("specserve_worker_kv_tier_load_seconds_total", tier="remote") == 0.75
    assert value("specserve_worker_kv_tier_corrupt_blocks_total") == 1
    metrics.observe_worker("decode", "decode-0", {"kv_tier": {"remote_hits": 3}})  # restarted: counts from zero
    assert value("specserve_worker_kv_tier_hit_blocks_total", tier="remote") == 9
    metrics.observe_worker("decode", "decode-0", {})  # no tiers: nothing moves
    assert value("specserve_worker_kv_tier_hit_blocks_total", tier="remote") == 9


def _totals(**figures) -> dict:
    """A worker's engine totals (server.metrics.engine_totals) with the given figures, zero elsewhere."""
    out = dict.fromkeys(("prompt_tokens", "generated_tokens", "preemptions", "num_drafts", "num_draft_tokens",
                         "num_accepted_tokens", "draft_time_s", "verify_time_s", "decode_time_s", "guard_holds",
                         "guard_probes", "running", "waiting", "kv_blocks", "kv_used_blocks", "prefix_queried_tokens",
                         "prefix_hit_tokens", "drafter_bytes", "suffix_tokens", "layer_wise_loads",
                         "failed_load_requeues"), 0)
    out.update(spec_enabled=True, accepted_lengths=[0, 0, 0], drafted_per_position=[0, 0],
               accepted_per_position=[0, 0], kv_tier=None)
    return {**out, **figures}


def test_a_disaggregated_server_fills_the_co_located_metrics_from_its_workers():
    """Dashboards on the co-located names (tokens, speculation, running / waiting, KV usage) read
    the deployment's figures under --disagg too: decode workers' answers and drafts summed (a
    prefill worker's one-token requests are no answers), a restarted worker counted from zero."""
    server = ServerMetrics("m")
    metrics = DisaggMetrics(server.registry, server)
    value = lambda name, **labels: server.registry.get_sample_value(name, {"model": "m", **labels})  # noqa: E731
    metrics.observe_worker("prefill", "prefill-0", {"engine": _totals(prompt_tokens=900, generated_tokens=9,
                                                                       waiting=2, running=1, kv_blocks=50,
                                                                       prefix_queried_tokens=900,
                                                                       prefix_hit_tokens=300)})
    for name, gen in (("decode-0", 40), ("decode-1", 60)):
        metrics.observe_worker("decode", name, {"engine": _totals(
            prompt_tokens=450, generated_tokens=gen, num_drafts=10, num_draft_tokens=30, num_accepted_tokens=20,
            accepted_lengths=[2, 3, 5], running=3, waiting=1, kv_blocks=100, kv_used_blocks=25,
            prefix_queried_tokens=450)})
    assert value("specserve_generation_tokens_total") == 100 and value("specserve_prompt_tokens_total") == 900
    assert value("specserve_spec_draft_tokens_total") == 60 and value("specserve_spec_accepted_tokens_total") == 40
    assert value("specserve_spec_accepted_length_count") == 20 and value("specserve_spec_accepted_length_sum") == 26
    assert value("specserve_num_requests_running") == 6 and value("specserve_num_requests_waiting") == 2 + 3
    assert value("specserve_kv_cache_usage_ratio") == 0.25 and value("specserve_speculation_enabled") == 1
    assert value("specserve_prefix_cache_hit_rate") == 300 / 1800

    metrics.worker_gone("decode", "decode-1")  # its replacement reports from zero: nothing is lost or doubled
    metrics.observe_worker("decode", "decode-1", {"engine": _totals(generated_tokens=5, kv_blocks=100,
                                                                     spec_enabled=False)})
    metrics.observe_worker("decode", "decode-0", {"engine": _totals(generated_tokens=41, num_draft_tokens=30,
                                                                     kv_blocks=100, spec_enabled=False)})
    assert value("specserve_generation_tokens_total") == 106 and value("specserve_spec_draft_tokens_total") == 60
    assert value("specserve_num_requests_running") == 0 and value("specserve_speculation_enabled") == 0


def test_prefill_time_is_counted_per_prefill_worker():
    registry = CollectorRegistry()
    metrics = DisaggMetrics(registry)
    for worker, wall in (("prefill-0", 0.5), ("prefill-1", 0.25), ("prefill-1", 0.75)):
        metrics.observe_prefill({"worker": worker, "wall_s": wall, "send_s": 0.01})
    count = lambda w: registry.get_sample_value("specserve_prefill_seconds_count", {"worker": w})  # noqa: E731
    assert (count("prefill-0"), count("prefill-1")) == (1, 2)
    assert registry.get_sample_value("specserve_prefill_seconds_sum", {"worker": "prefill-1"}) == 1.0


def test_health_tells_degraded_from_stopped_and_forgets_dead_workers():
    r = _router()
    registry = CollectorRegistry()
    metrics = DisaggMetrics(registry)
    r.metrics = metrics
    for w in r.prefill + r.decode:
        metrics.observe_worker(w.role, w.name, {"running": 1, "kv_free_blocks": 7})
    assert r.health()["status"] == "ok"
    hashes = r._hashes(list(range(12)))
    r._index(hashes, "prefill-0", "decode-0")

    r._worker_failed(r.prefill[0], RuntimeError("killed\nwith a long Ray trace"))
    h = r.health()
    assert r.is_alive and h["status"] == "degraded"
    assert (
        "prefill pool down" in h["degraded"]
        and "decode workers prefill prompts themselves" in h["degraded"]
    )
    assert h["workers"][0] == {
        "name": "prefill-0",
        "role": "prefill",
        "alive": False,
        "state": "dead",
        "restarts": 0,
        "error": "RuntimeError: killed",
    }
    assert r.pick_prefill(hashes, 12, set()) is None  # prompts now go to decode workers whole
    assert r._matched(hashes, "prefill-0") == 0  # its cache died with it

    r._worker_failed(r.decode[0], RuntimeError("killed"))
    d0, d1 = ({"role": "decode", "worker": f"decode-{i}"} for i in range(2))
    assert registry.get_sample_value("specserve_worker_alive", d0) == 0
    assert registry.get_sample_value("specserve_worker_requests_running", d0) is None  # not frozen
    assert registry.get_sample_value("specserve_worker_kv_blocks_free", d0) is None
    assert registry.get_sample_value("specserve_worker_requests_running", d1) == 1
    assert r._matched(hashes, "decode-0") == 0
    assert "decode-0 (dead) down" in r.health()["degraded"]

    r._worker_failed(r.decode[1], RuntimeError("killed"))
    h = r.health()
    assert not r.is_alive and h["status"] == "stopped" and "every decode worker died" in h["error"]
    with pytest.raises(EngineStoppedError, match="no live workers: no decode worker is alive"):
        r.submit([])


def test_a_worker_that_ran_long_enough_gets_its_restart_budget_back():
    """Restarts stop a worker that keeps crashing, not the fourth crash of a long-lived server: a
    worker whose budget is spent is restarted again once it ran restart_renew_s before dying."""
    r = _router(num_decode=3)
    r.restart = lambda name: None
    spawned: list[str] = []

    def spawn(coro):
        spawned.append(coro.cr_frame.f_locals["dead"].name)
        coro.close()

    r._spawn = spawn
    young, old, fresh = r.decode
    young.restarts = old.restarts = r.max_restarts
    young.started = time.monotonic() - r.restart_renew_s / 2
    old.started = time.monotonic() - r.restart_renew_s - 1
    r._worker_failed(young, RuntimeError("killed"))
    r._worker_failed(old, RuntimeError("killed"))
    r._worker_failed(fresh, RuntimeError("killed"))  # never restarted yet: restarted at once
    assert spawned == ["decode-1", "decode-2"]
    assert (young.restarts, old.restarts, fresh.restarts) == (r.max_restarts, 0, 0)
    states = {w["name"]: w["state"] for w in r.health()["workers"]}
    assert states == {"prefill-0": "alive", "decode-0": "dead", "decode-1": "restarting", "decode-2": "restarting"}


class _Remote:
    """A Ray method stand-in: `.remote(...)` calls the function."""

    def __init__(self, fn: Callable) -> None:
        self.remote = fn


class _FakePrefillActor:
    """Holds a prefill open until it is aborted, as a busy prefill worker does."""

    def __init__(self) -> None:
        import concurrent.futures

        self.aborted: list[str] = []
        self.pending: concurrent.futures.Future = concurrent.futures.Future()
        self.priorities: list[int] = []
        self.descs: list[TransferDescriptor] = []
        self.prefill = _Remote(self._prefill)
        self.abort = _Remote(self._abort)

    def _prefill(self, rid: str, tokens: list[int], desc: TransferDescriptor, priority: int = 0) -> object:
        self.priorities.append(priority)
        self.descs.append(desc)
        return type("Ref", (), {"future": lambda _: self.pending})()

    def _abort(self, ids: list[str]) -> None:
        from specserve.disagg.kv_transfer import KVTransferError

        self.aborted += ids
        if not self.pending.done():  # what the worker answers: its prefill ended by the abort
            self.pending.set_exception(KVTransferError("prefill-0: aborted"))


class _FakeDecodeActor:
    def __init__(self) -> None:
        self.aborted: list[str] = []

        async def added() -> None:
            return None

        self.add_decode = _Remote(lambda req, desc, chars: added())
        self.abort = _Remote(lambda ids: self.aborted.extend(ids))


def test_abort_during_prefill_stops_the_prefill_worker_and_is_no_failure(caplog):
    """A client leaving while its prompt is prefilled: the prefill worker is told to stop (no
    compute for nobody), and the prefill that ends that way counts as no failure of the worker."""
    import asyncio

    r = _router(num_prefill=1, num_decode=1)
    pre_actor, dec_actor = _FakePrefillActor(), _FakeDecodeActor()
    r.prefill[0].actor, r.decode[0].actor = pre_actor, dec_actor
    prepared = r.engine.prepare_request([1, 2, 3, 4, 5, 6, 7, 8] * 5, SamplingParams(max_tokens=4), priority=-2)
    rid = prepared.request.request_id

    async def scenario() -> None:
        r._loop = asyncio.get_running_loop()
        r.submit([prepared])
        _deadline = time.monotonic() + 5
        while r._jobs[rid].prefill_worker is None:  # the prefill is running
            assert time.monotonic() < _deadline, "the prefill never started"
            await asyncio.sleep(0.01)
        r.abort([rid])
        await asyncio.sleep(0.1)  # the router's attempt sees the prefill end

    with caplog.at_level("WARNING", logger="specserve.disagg.router"):
        asyncio.run(scenario())
    internal = f"{rid}#1"
    assert pre_actor.priorities == [-2]  # the prompt keeps its priority on the prefill pool
    assert pre_actor.aborted == [internal] and set(dec_actor.aborted) == {internal}
    assert r.prefill[0].num_failures == 0 and r.prefill[0].alive
    assert not [rec for rec in caplog.records if "failed" in rec.getMessage()]
    assert not _our_channel_files()


class _SlowQueueDecodeActor:
    """A decode worker whose add_decode answers only when told, and which, like the real actor
    (many threads), may run an abort sent meanwhile first: it records what its engine thread
    would see, in order."""

    def __init__(self) -> None:
        import asyncio

        self.seen: list[tuple[str, str]] = []
        self.gate = asyncio.Event()

        async def add(req) -> None:  # noqa: ANN001
            await self.gate.wait()
            self.seen.append(("decode", req.request_id))

        self.add_decode = _Remote(lambda req, desc, chars: add(req))
        self.abort = _Remote(lambda ids: self.seen.extend(("abort", i) for i in ids))


def test_a_client_leaving_while_its_request_is_queued_leaves_nothing_running():
    """The abort a router sends while its decode worker is still queuing the request can reach
    the worker's engine thread before the request does; the router aborts again once the worker
    has it and starts no prefill, so nothing decodes for a client that left."""
    import asyncio

    r = _router(num_prefill=1, num_decode=1)
    pre_actor, dec_actor = _FakePrefillActor(), _SlowQueueDecodeActor()
    r.prefill[0].actor, r.decode[0].actor = pre_actor, dec_actor
    prepared = r.engine.prepare_request([1, 2, 3, 4, 5, 6, 7, 8] * 5, SamplingParams(max_tokens=4))
    rid = prepared.request.request_id

    async def scenario() -> None:
        r._loop = asyncio.get_running_loop()
        r.submit([prepared])
        await asyncio.sleep(0.05)  # the router waits on add_decode
        r.abort([rid])
        dec_actor.gate.set()
        await asyncio.sleep(0.1)

    asyncio.run(scenario())
    internal = f"{rid}#1"
    assert dec_actor.seen[-1] == ("abort", internal) and ("decode", internal) in dec_actor.seen
    assert pre_actor.priorities == []  # no prefill for it
    assert not r._jobs and not r._by_internal and r.decode[0].reserved_blocks == 0
    assert not _our_channel_files()


def test_requests_wait_for_a_restarting_decode_worker_and_resume_on_it():
    """A lone decode worker's crash: while it is restarted, its requests wait and then resume on
    the fresh worker (they ended with finish_reason 'error' at once)."""
    import asyncio

    r = _router(num_prefill=1, num_decode=1)
    first, fresh = _RecordingDecodeActor(), _RecordingDecodeActor()
    r.decode[0].actor = first
    prepared = r.engine.prepare_request([1, 2, 3], SamplingParams(max_tokens=4))
    rid = prepared.request.request_id

    async def scenario() -> None:
        r._loop = asyncio.get_running_loop()
        r.submit([prepared])
        await asyncio.sleep(0.1)
        dead = r.decode[0]
        r._worker_failed(dead, RuntimeError("killed"))
        dead.restarting = True  # (what a router given a restart function does)
        await asyncio.sleep(0.3)
        assert not r._jobs[rid].finished and r._jobs[rid].attempts == 1  # waiting; no try spent
        r.decode[0] = WorkerHandle(fresh, _info("decode-0", "decode"))
        dead.restarting = False
        await asyncio.sleep(0.2)

    asyncio.run(scenario())
    assert [q.request_id for q in first.added] == [f"{rid}#1"] and [q.request_id for q in fresh.added] == [f"{rid}#2"]
    assert not r._jobs[rid].finished


class _DyingDecodeActor:
    """A decode worker that dies once it has taken a request."""

    def __init__(self) -> None:
        import asyncio

        self.added: list = []

        async def add(req) -> None:  # noqa: ANN001
            self.added.append(req)

        async def poll(timeout: float) -> tuple[list, dict]:
            await asyncio.sleep(timeout)
            if self.added:
                raise RuntimeError("the decode worker died")
            return [], {}

        self.add_decode = _Remote(lambda req, desc, chars: add(req))
        self.poll = _Remote(poll)
        self.abort = _Remote(lambda ids: None)


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_no_worker_could_finish_is_a_503_with_the_reason(stream):
    """The router's failures reach the client: a whole answer is a 503 naming the reason, a stream
    ends with an error event (both were answers with finish_reason 'error' and no message)."""
    import json

    from fastapi.testclient import TestClient

    from specserve.server.app import OpenAIServer, build_app

    r = _router(num_prefill=1, num_decode=1)
    r.decode[0].actor = _DyingDecodeActor()
    server = OpenAIServer(None, "m", router_factory=lambda metrics: r)
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    with TestClient(build_app(server)) as client:
        answer = client.post("/v1/completions", json=body)
    if not stream:
        assert answer.status_code == 503 and answer.headers["retry-after"]
        assert "no decode worker is alive" in answer.json()["error"]["message"]
    else:
        events = [json.loads(line[6:]) for line in answer.text.split("\n") if line.startswith("data: {")]
        assert "no decode worker is alive" in events[-1]["error"]["message"] and answer.text.endswith("[DONE]\n\n")
        # the error event ends it: no choice claims a finish ('error' is none of OpenAI's), no usage after it
        assert not [c for e in events[:-1] for c in e.get("choices", []) if c.get("finish_reason")]


def test_prompts_arriving_together_spread_over_the_prefill_pool_and_know_their_queue():
    """Four prompts submitted in one go: each is counted on its prefill worker before any await,
    so they go two and two, and the second on each worker knows one prompt is queued ahead of it
    (its transfer's patience grows by that: prefill_budget_s)."""
    import asyncio

    r = _router(num_prefill=2, num_decode=1)
    pres = [_FakePrefillActor(), _FakePrefillActor()]
    r.prefill[0].actor, r.prefill[1].actor = pres
    r.decode[0].actor = dec = _RecordingDecodeActor()
    real_add = dec.add_decode.remote

    async def add_over_the_wire(req, desc, chars) -> None:  # noqa: ANN001
        await asyncio.sleep(0.01)  # a Ray call answers later: the other prompts' tasks run meanwhile
        await real_add(req, desc, chars)

    dec.add_decode = _Remote(add_over_the_wire)
    prepared = [r.engine.prepare_request([1 + i, 2, 3, 4, 5, 6, 7, 8] * 5, SamplingParams(max_tokens=4)) for i in range(4)]

    async def scenario() -> None:
        r._loop = asyncio.get_running_loop()
        r.submit(prepared)
        await asyncio.sleep(0.2)
        r.abort([p.request.request_id for p in prepared])
        await asyncio.sleep(0.1)

    asyncio.run(scenario())
    m = 39
    assert [sorted(d.queued_tokens for d in a.descs) for a in pres] == [[0, m], [0, m]]
    assert all(w.pending_tokens == 0 for w in r.prefill)


class _RecordingDecodeActor:
    """Takes requests and keeps them (as a decode worker that has not stepped yet)."""

    def __init__(self) -> None:
        self.added: list = []

        async def added(req) -> None:
            self.added.append(req)

        self.add_decode = _Remote(lambda req, desc, chars: added(req))
        self.abort = _Remote(lambda ids: None)


def test_request_resumed_after_its_decode_worker_died_keeps_every_logprob():
    """A request moved to another decode worker mid-generation carries what it already
    streamed: its tokens, their logprobs and their top_logprobs, and its sampling parameters."""
    import asyncio

    from specserve.outputs import CompletionOutput, RequestMetrics, RequestOutput

    r = _router(num_prefill=1, num_decode=2)
    r.local_prefill_tokens = 64  # a short prompt: its decode worker prefills it
    first, second = _RecordingDecodeActor(), _RecordingDecodeActor()
    r.decode[0].actor, r.decode[1].actor = first, second
    params = SamplingParams(max_tokens=8, temperature=0.7, seed=3, logprobs=True, top_logprobs=2)
    prepared = r.engine.prepare_request([1, 2, 3], params)
    rid = prepared.request.request_id
    tops = [[(5, -0.1), (6, -2.5)], [(7, -0.3), (5, -1.4)]]

    async def scenario() -> None:
        r._loop = asyncio.get_running_loop()
        r.submit([prepared])
        deadline = time.monotonic() + 5
        while not (first.added or second.added):
            assert time.monotonic() < deadline, "never routed"
            await asyncio.sleep(0.01)
        holder = first if first.added else second
        internal = holder.added[0].request_id
        c = CompletionOutput(0, "ab", [5, 7], logprobs=[-0.1, -0.3], delta_text="ab",
                             delta_token_ids=[5, 7], top_logprobs=tops)
        r._on_output(RequestOutput(internal, None, [1, 2, 3], [c], False, RequestMetrics()))
        dead = r.decode[0] if holder is first else r.decode[1]
        r._worker_failed(dead, RuntimeError("killed"))
        other = second if holder is first else first
        while not other.added:
            assert time.monotonic() < deadline, "never resumed"
            await asyncio.sleep(0.01)
        moved = other.added[0]
        assert moved.request_id.endswith("#2")
        assert moved.output_token_ids == [5, 7]
        assert moved.output_logprobs == [-0.1, -0.3]
        assert moved.output_top_logprobs == tops
        assert moved.sampling_params == params
        r.abort([rid])

    asyncio.run(scenario())


def test_router_forgets_prefixes_a_worker_evicted_and_sends_no_request_to_a_stale_full_hit():
    r = _router(num_prefill=1, num_decode=2)
    tokens = list(range(1, 9)) * 3  # 6 full blocks of 4
    hashes = r._hashes(tokens)
    for w, free in zip(r.decode, (10, 90)):
        w.stats = {"kv_free_blocks": free}
    r._index(hashes, "prefill-0", "decode-0")
    assert r.pick_decode(hashes) == (r.decode[0], True)  # the cached worker, though it has less room
    # decode-0's pool reuses one of those blocks (its report arrives with its next poll).
    r._observe(r.decode[0], {"kv_free_blocks": 10, "evicted": [hashes[3]]})
    assert r.pick_decode(hashes) == (r.decode[1], False)  # no stale full hit: the roomiest worker
    assert r._matched(hashes, "decode-0") == 3 and r._matched(hashes, "prefill-0") == 6
    r._observe(r.prefill[0], {"evicted": hashes})
    r._observe(r.decode[0], {"kv_free_blocks": 10, "evicted": hashes})
    assert r._prefix_index == {}  # nothing left behind: the index does not grow for ever


def test_a_worker_reports_the_blocks_its_pool_evicts(smollm_checkpoint):
    from specserve import LLM
    from specserve.disagg.worker import WorkerCore
    from specserve.kv_cache.block_pool import hash_block_tokens

    llm = LLM(MODEL, dtype="float32", checkpoint=smollm_checkpoint, num_kv_blocks=12, num_threads=1)
    core = WorkerCore("decode", llm.engine, "decode-t")
    try:
        pool = llm.engine.kv_manager.pool
        blocks = pool.allocate(2)
        hs = [hash_block_tokens(None, list(range(16))), hash_block_tokens(None, list(range(1, 17)))]
        for b, h in zip(blocks, hs):
            pool.register(b, h)
        pool.release(blocks)
        assert core.stats()["evicted"] == []
        pool.allocate(12)  # reuses every block, the cached two included
        assert sorted(core.stats()["evicted"]) == sorted(h.value for h in hs)
        assert core.stats()["evicted"] == []  # each eviction reported once
    finally:
        core.shutdown()


def test_channel_files_are_deleted_when_prefill_ends_a_worker_dies_or_at_shutdown():
    layout = KVLayout(2, 1, 4, "float32")
    files = ChannelFiles()
    descs = [TransferDescriptor(new_transfer_id(), "shm", 4, layout) for _ in range(3)]
    for d, dec in zip(descs, ["decode-0", "decode-1", "decode-1"], strict=True):
        open(d.shm_path, "wb").close()  # as the decode worker would create it
        files.track(d, "prefill-0", dec)
    files.track(TransferDescriptor(new_transfer_id(), "ray", 4, layout), "prefill-0", "decode-0")
    assert len(files) == 3  # Ray transfers have no file
    files.release(descs[0])
    assert not os.path.exists(descs[0].shm_path)
    files.release_worker("decode-1")
    assert not any(os.path.exists(d.shm_path) for d in descs) and len(files) == 0
    open(descs[2].shm_path, "wb").close()
    files.track(descs[2], "prefill-0", "decode-1")
    files.release_all()
    assert not os.path.exists(descs[2].shm_path)


# ---------------------------------------------------------------------- on Ray
ray = pytest.importorskip("ray")

from specserve.disagg.launch import DisaggClient, WorkerSpec, connect  # noqa: E402


@pytest.fixture(scope="module")
def local_ray(smollm_path):
    """A private local Ray for this module's deployments."""
    from specserve.disagg.launch import init_ray

    if ray.is_initialized():
        ray.shutdown()
    init_ray(num_cpus=2)
    yield
    ray.shutdown()


def _spec(name: str) -> WorkerSpec:
    role, index = name.rsplit("-", 1)
    kwargs = ENGINE | ({"spec_method": "ngram"} if role == "decode" else {})
    return WorkerSpec(role, int(index), MODEL, kwargs, transfer_timeout_s=20)


def _kill_all(router: DisaggRouter) -> None:
    for w in router.prefill + router.decode:
        with contextlib.suppress(Exception):
            ray.kill(w.actor)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _live_disagg_server(router_factory: Callable) -> Iterator[tuple[object, str]]:
    """The OpenAI server on a router, served by uvicorn on loopback in a background thread."""
    import uvicorn

    from specserve.server.app import OpenAIServer, build_app

    server = OpenAIServer(None, "smollm2", router_factory=router_factory, drain_timeout_s=5)
    port = _free_port()
    uv = uvicorn.Server(
        uvicorn.Config(
            build_app(server), host="127.0.0.1", port=port, log_level="warning", lifespan="on"
        )
    )
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    _wait_until(lambda: uv.started or not thread.is_alive(), 60, "the server to start")
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(60)


@pytest.mark.slow
def test_killed_prefill_worker_degrades_to_local_prefill_then_restarts(local_ray, smollm_llm):
    """SIGKILL the prefill worker with prompts in it: every request is still served, /health says
    'degraded' while the decode worker prefills for itself, then 'ok' once a fresh worker is up."""
    import httpx

    gate = threading.Event()  # holds the restart back so the degraded state can be observed

    def restart(name: str):
        gate.wait(120)
        return _spec(name).start()

    def make_router(metrics):
        actors = [_spec("prefill-0").start(), _spec("decode-0").start()]
        return connect(
            MODEL,
            actors,
            transfer_timeout_s=20,
            local_prefill_tokens=0,
            metrics=DisaggMetrics(metrics.registry),
            on_output=metrics.on_finished,
            restart=restart,
        )

    params = SamplingParams(max_tokens=12, temperature=0.0)
    want = [o.outputs[0].text for o in smollm_llm.generate(PROMPTS, params, use_tqdm=False)]
    in_flight, while_down, after_restart = PROMPTS[:4], 4, 5  # fresh prompts: no prefix-cache hits
    before = _our_channel_files()
    router = None
    try:
        with (
            _live_disagg_server(make_router) as (server, url),
            httpx.Client(base_url=url, timeout=180) as http,
        ):
            router = server.async_engine
            assert http.get("/health").json()["status"] == "ok"

            def complete(i: int) -> None:
                body = {
                    "model": "smollm2",
                    "prompt": PROMPTS[i],
                    "max_tokens": 12,
                    "temperature": 0,
                }
                resp = http.post("/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
                choice = resp.json()["choices"][0]
                assert choice["finish_reason"] == "length" and choice["text"] == want[i]
                done.append(i)

            # Mid-load: every prompt waits in the (stalled) prefill worker when it is killed.
            pre = router.prefill[0]
            ray.get(pre.actor.pause.remote(True))
            done: list[int] = []
            senders = [threading.Thread(target=complete, args=(i,)) for i in range(len(in_flight))]
            for t in senders:
                t.start()
            _wait_until(
                lambda: ray.get(pre.actor.stats.remote())["waiting"] == len(in_flight),
                60,
                "every prompt to reach the prefill worker",
            )
            os.kill(pre.info["pid"], signal.SIGKILL)
            for t in senders:
                t.join(180)
            assert sorted(done) == list(range(len(in_flight)))  # served: 200, right text

            # Degraded: the decode worker prefills new prompts itself while prefill-0 restarts.
            health = http.get("/health")
            body = health.json()
            assert health.status_code == 200 and body["status"] == "degraded", body
            assert "prefill pool down" in body["degraded"]
            assert body["workers"][0]["name"] == "prefill-0"
            assert body["workers"][0]["state"] == "restarting" and not body["workers"][0]["alive"]
            gauge = 'specserve_worker_alive{role="prefill",worker="prefill-0"} 0.0'
            assert gauge in http.get("/metrics").text
            n_prefills = len(router.prefills)
            complete(while_down)
            assert len(router.prefills) == n_prefills  # no prefill worker took part

            # Restarted: health is ok again and prompts go to the fresh prefill worker.
            gate.set()
            _wait_until(lambda: http.get("/health").json()["status"] == "ok", 240, "the restart")
            body = http.get("/health").json()
            assert body["workers"][0] == {
                "name": "prefill-0",
                "role": "prefill",
                "alive": True,
                "state": "alive",
                "restarts": 1,
            }
            complete(after_restart)
            assert len(router.prefills) == n_prefills + 1
            assert router.prefills[-1]["worker"] == "prefill-0"
    finally:
        gate.set()
        if router is not None:
            _kill_all(router)
    assert _our_channel_files() <= before  # the server has shut down: nothing left in /dev/shm


def test_killed_decode_worker_leaves_no_channel_files_or_frozen_gauges(local_ray, smollm_llm):
    """SIGKILL a decode worker holding received-but-unstarted transfers; its requests finish on
    the other decode worker, its gauges go, and after shutdown no channel file is left."""
    registry = CollectorRegistry()
    metrics = DisaggMetrics(registry)
    actors = [_spec(name).start() for name in ("prefill-0", "decode-0", "decode-1")]
    router = connect(MODEL, actors, transfer_timeout_s=20, local_prefill_tokens=0, metrics=metrics)
    client = DisaggClient(router)
    before = _our_channel_files()
    params = SamplingParams(max_tokens=12, temperature=0.0)
    want = [o.outputs[0].token_ids for o in smollm_llm.generate(PROMPTS, params, use_tqdm=False)]
    try:
        victim = router.decode[0]
        ray.get(victim.actor.pause.remote(True))  # it takes requests and their KV, but never steps
        outs: list = []
        running = threading.Thread(target=lambda: outs.extend(client.generate(PROMPTS, params)))
        running.start()
        _wait_until(
            lambda: any(p["decode_worker"] == "decode-0" for p in router.prefills),
            120,
            "a transfer to decode-0",
        )
        _wait_until(
            lambda: (
                registry.get_sample_value(
                    "specserve_worker_requests_waiting", {"role": "decode", "worker": "decode-0"}
                )
                is not None
            ),
            30,
            "decode-0's gauges",
        )
        os.kill(victim.info["pid"], signal.SIGKILL)
        running.join(180)
        assert [o.error for o in outs] == [None] * len(PROMPTS)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert any(o.metrics.extra["attempts"] > 1 for o in outs)  # resumed on decode-1

        for gauge in ("running", "waiting"):
            name = f"specserve_worker_requests_{gauge}"
            assert registry.get_sample_value(name, {"role": "decode", "worker": "decode-0"}) is None
            assert (
                registry.get_sample_value(name, {"role": "decode", "worker": "decode-1"})
                is not None
            )
        assert (
            registry.get_sample_value(
                "specserve_worker_kv_blocks_free", {"role": "decode", "worker": "decode-0"}
            )
            is None
        )
        assert (
            registry.get_sample_value(
                "specserve_worker_alive", {"role": "decode", "worker": "decode-0"}
            )
            == 0
        )
        health = router.health()
        assert health["status"] == "degraded" and "decode-0 (dead) down" in health["degraded"]
    finally:
        client.close()
        _kill_all(router)
    assert _our_channel_files() <= before


def test_prefill_and_decode_pools_are_tuned_on_their_own():
    from specserve.cli import build_parser, engine_kwargs, role_engine_kwargs
    from specserve.disagg.launch import worker_specs
    from specserve.errors import ConfigError

    args = build_parser().parse_args(["serve", "--model", MODEL, "--disagg", "--decode-workers", "2",
                                      "--max-num-seqs", "32", "--prefill-max-num-batched-tokens", "2048",
                                      "--decode-max-num-seqs", "128"])
    specs = worker_specs(MODEL, engine_kwargs(args), 1, 2, role_engine_kwargs=role_engine_kwargs(args))
    assert sorted(specs) == ["decode-0", "decode-1", "prefill-0"]
    pre, dec = specs["prefill-0"].engine_kwargs, specs["decode-1"].engine_kwargs
    assert (pre["max_num_batched_tokens"], pre["max_num_seqs"]) == (2048, 32)
    assert (dec["max_num_batched_tokens"], dec["max_num_seqs"]) == (512, 128)
    with pytest.raises(ConfigError, match="'prefill' and 'decode'"):
        worker_specs(MODEL, {}, role_engine_kwargs={"router": {"max_num_seqs": 4}})


def test_prefill_workers_hold_the_draft_unless_told_not_to():
    """With --draft-model the prefill workers load the draft, its policy off, to send its prompt
    KV (the decode workers speculate with it); --prefill-draft-kv off leaves it out there."""
    from specserve.cli import build_parser, engine_kwargs, role_engine_kwargs
    from specserve.disagg.launch import worker_specs
    from specserve.disagg.worker import prefill_engine_kwargs

    base = ["serve", "--model", MODEL, "--disagg", "--draft-model", MODEL, "--draft-num-layers", "4"]
    for flags, drafts in (([], True), (["--prefill-draft-kv", "off"], False)):
        args = build_parser().parse_args(base + flags)
        specs = worker_specs(MODEL, engine_kwargs(args), 1, 1, role_engine_kwargs=role_engine_kwargs(args))
        pre = prefill_engine_kwargs(specs["prefill-0"].engine_kwargs)
        dec = specs["decode-0"].engine_kwargs
        assert dec.get("spec_method") in (None, "draft") and dec["draft_model"] == MODEL
        assert (pre["spec_method"], pre.get("spec_policy")) == (("draft", "off") if drafts else ("none", pre.get("spec_policy")))
        assert ("draft_model" in pre) is drafts
    # A prefill worker without the drafter drops --spec-copy too (a copier needs a drafter behind it).
    args = build_parser().parse_args(base + ["--spec-copy", "ngram", "--prefill-draft-kv", "off"])
    specs = worker_specs(MODEL, engine_kwargs(args), 1, 1, role_engine_kwargs=role_engine_kwargs(args))
    pre = prefill_engine_kwargs(specs["prefill-0"].engine_kwargs)
    assert pre["spec_method"] == "none" and "spec_copy" not in pre
    assert specs["decode-0"].engine_kwargs["spec_copy"] == "ngram"
    # --spec-join: the decode workers join lookahead's candidates; a prefill worker never drafts, so
    # it joins nothing, with the drafter (its policy off) or without it (no drafter to join).
    from specserve.config import SpecConfig

    for flags in ([], ["--prefill-draft-kv", "off"]):
        args = build_parser().parse_args(base + ["--spec-method", "layerskip", "--spec-join", "lookahead", *flags])
        specs = worker_specs(MODEL, engine_kwargs(args), 1, 1, role_engine_kwargs=role_engine_kwargs(args))
        pre = prefill_engine_kwargs(specs["prefill-0"].engine_kwargs)
        assert pre["spec_method"] == "none" and pre.get("spec_join", "none") == "none"
        SpecConfig(method=pre["spec_method"], join=pre.get("spec_join", "none"))  # a prefill worker can start
        assert specs["decode-0"].engine_kwargs["spec_join"] == "lookahead"
    args = build_parser().parse_args(base + ["--spec-method", "draft", "--spec-join", "lookahead"])
    specs = worker_specs(MODEL, engine_kwargs(args), 1, 1, role_engine_kwargs=role_engine_kwargs(args))
    pre = prefill_engine_kwargs(specs["prefill-0"].engine_kwargs)
    assert (pre["spec_method"], pre["spec_policy"], pre["spec_join"]) == ("draft", "off", "none")


def test_a_prompt_whose_blocks_are_all_in_the_shared_store_skips_the_prefill_worker(tmp_path):
    """Workers sharing a disk tier form one KV store: the router sends a prompt whose every full
    block is stored straight to a decode worker, which loads them (verified) instead of waiting
    for a prefill worker to recompute them."""
    import asyncio

    import torch

    from specserve.kv_cache.block_pool import hash_block_tokens
    from specserve.kv_cache.tiers import TieredKVStore

    r = _router(num_prefill=1, num_decode=1)
    r.local_prefill_tokens = 4
    pre_actor, dec_actor = _FakePrefillActor(), _RecordingDecodeActor()
    r.prefill[0].actor, r.decode[0].actor = pre_actor, dec_actor
    tokens = list(range(1, 10)) * 3 + [5]  # 28 tokens: 6 full blocks of 4 in its first 27
    store = TieredKVStore("fp", 8, disk_dir=tmp_path, disk_bytes=1 << 20)
    parent = None
    for i in range(6):
        parent = hash_block_tokens(parent, tokens[4 * i:4 * i + 4])
        store.save(parent, torch.zeros(8, dtype=torch.uint8))
    assert store.flush()
    r.kv_store = str(store.disk.dir)
    hashes = r._hashes(tokens[:27])
    assert asyncio.run(r._stored(hashes)) and not asyncio.run(r._stored(r._hashes([7] * 27)))
    prepared = r.engine.prepare_request(tokens, SamplingParams(max_tokens=4))

    async def scenario() -> None:
        r._loop = asyncio.get_running_loop()
        r.submit([prepared])
        deadline = time.monotonic() + 5
        while not dec_actor.added:
            assert time.monotonic() < deadline, "never routed"
            await asyncio.sleep(0.01)
        r.abort([prepared.request.request_id])

    asyncio.run(scenario())
    assert pre_actor.priorities == []  # no prefill worker was asked
    store.close()


def test_init_ray_starts_a_private_cluster_unless_told_to_join(monkeypatch):
    """A cluster `ray start` left on this machine is joined by a bare ray.init() (which then refuses
    num_cpus): without --ray-address or $RAY_ADDRESS, the deployment starts its own."""
    ray = pytest.importorskip("ray")

    from specserve.disagg.launch import init_ray

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    init_ray(num_cpus=2)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    init_ray()
    init_ray("auto")
    assert [c["address"] for c in calls] == ["local", "10.0.0.1:6379", "auto"] and calls[0]["num_cpus"] == 2
