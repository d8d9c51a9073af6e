"""`specserve profile`: time this machine running one model, for the planner's measured cost model.

Records, into one JSON file (`PROFILE_FORMAT`, read back by `ops/costmodel.MeasuredCostModel`):

- `decode`: the target's step time by batch (one new token per request) and context;
- `verify`: the step time by tokens per request n (one plus n - 1 drafts) at a few batches;
- `prefill` / `prefill_context`: one prompt chunk's step time by chunk size (prefill tokens/s),
  and the chunk of the scheduler's token budget after longer contexts (attention's share);
- `engine_overhead`: what a step of the full engine costs beyond its forward pass (scheduling,
  sampling, outputs) at a few batches;
- `served`: the engine's step time behind the OpenAI server, with that many requests streaming
  over loopback HTTP from clients on this machine (what a served deployment pays per step:
  the HTTP layer and its clients take CPU time from the engine), and short requests' times to
  first token on the idle server, each and the median (the front end's time per request);
- `in_process`: short requests' times to first token on an idle engine driven in-process
  (`AsyncEngine` and `prepare_request`, as an application embedding the engine drives it):
  the median and each one, as `served` records them for lone requests over HTTP;
- `drafter`: one drafting pass by batch (a draft model); for a model-free proposer, what having
  speculation on adds to each step outside the forward (policy, proposals, verification);
- `kv_transfer`: bytes per second through the shared-memory channel of disaggregated serving
  (paged cache -> channel -> paged cache, as `disagg/kv_transfer.py` moves a prompt's KV);
- `co_run`: when the machine has cores for a second worker of this many threads, how much
  longer a served decode step takes while a prefill computes on the other cores (the processes
  relaying its outputs then take their CPU time from its core), and a prefill chunk while a
  decode streams its weights there (memory bandwidth, caches and, on a VM, perhaps the physical
  cores behind its vCPUs);
- `relay` (`specserve profile --disagg`): the same model as a disaggregated deployment (one
  prefill and one decode worker of this many threads, Ray actors pinned to their own cores, as
  `serve --disagg` and bench/disagg.py start them): a decode worker's step time at a few batches
  with every output relayed through the router, and a lone request's time to first token
  through the prefill worker, the KV stream and the decode worker (what the planner charges a
  disaggregated deployment beyond its workers' forwards);
- the model's KV bytes per token and capacity, the scheduler's settings, the machine.

Forward times come from the runner's own timing (`ModelRunner.time_decode_step`, each request
of a batch over its own KV blocks, and the forward it times steps with); each point is the
median of `repeats` runs in each of three rounds, each round in a different order, so a burst
of other work on a shared machine does not bend the tables (`_Timings`).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from specserve.config import usable_cpus
from specserve.engine.engine import LLMEngine
from specserve.engine.runner import kv_bytes_per_token
from specserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from specserve.errors import ConfigError
from specserve.files import write_atomic
from specserve.ops.costmodel import PROFILE_FORMAT
from specserve.progress import bar, spinner
from specserve.sampling_params import SamplingParams

DECODE_BATCHES = (1, 2, 4, 8, 16, 32)
DECODE_CONTEXTS = (128, 1024, 2560)  # long prompts' decodes read ~2k-token contexts: measured, not extrapolated
VERIFY_BATCHES = (1, 4, 16)
VERIFY_TOKENS = (1, 2, 3, 5, 9)
PREFILL_CHUNKS = (2, 4, 8, 12, 16, 32, 48, 64, 96, 128, 192, 256, 384)  # plus the token budget (the kernels tile rows: not linear)
PREFILL_OFFSETS = (0, 1024, 2048)  # contexts before a budget-sized chunk
OVERHEAD_BATCHES = (1, 8)
SERVED_BATCHES = (1, 4, 8)
SERVED_TOKENS = 48  # tokens each streamed request generates
LONE_REQUESTS = 15  # short requests on an idle server: their times to first token (spread and median)
# Idle time before each, in turn: a request to a lightly loaded server finds it at rest (threads
# asleep, caches cold), which sometimes costs more the longer the rest. On a 2-vCPU Zen 5 the
# in-process requests of one profile took a median 10 ms after 0.25 s and 1 s, 20 ms after 4 s,
# while bench/disagg.py's requests minutes later took 7-11 ms after 3.4-5.2 s (14-24 ms in another
# recording): too erratic to charge by idle time, so the cost model charges the median of the
# mix, and the spread stays on record per request (`idle_s`).
LONE_GAPS_S = (0.25, 1.0, 4.0)
CO_RUN_BATCH = 4  # decode batch timed beside a neighbour worker
CO_RUN_REPEATS = 9
KV_TRANSFER_TOKENS = 2048
ROUNDS = 3
RELAY_PROMPT_TOKENS = 64  # a relayed request's prompt: past the router's local-prefill threshold
RELAY_LOCAL_TOKENS = 8  # a prompt the router has its decode worker prefill
RELAY_LONG_TOKENS = 2048  # the prompt the prefill worker computes while decodes are timed beside it
BESIDE_BATCHES = (1, 4)  # decode batches timed beside that prefill


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: CPU (model, family/model/stepping, ISA), threads, GPU,
    versions, date. (VMs often name the CPU only "AMD EPYC": the ids tell the generation.)"""
    cpu = platform.processor() or "unknown"
    flags = ""
    ids: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key == "model name":
                    cpu = line.split(":", 1)[1].strip()
                elif key in ("cpu family", "model", "stepping") and key not in ids:
                    ids[key] = line.split(":", 1)[1].strip()
                elif key == "flags" and not flags:
                    flags = line
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_family_model_stepping": "/".join(ids.get(k, "?") for k in ("cpu family", "model", "stepping")),
        "cpu_isa": [x for x in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8") if f" {x}" in flags],
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **_kernel_tuning(),
    }


def _kernel_tuning() -> dict[str, Any]:
    """What this process's native kernels measured and chose at start-up (prefetch distance, the
    width from which passes run 512 bits wide) and from how many rows Q4_K passes take the AMX
    tiles, where a model has loaded them."""
    from specserve.kernels import kernels, prefetch_tuning, wide_tuning

    tuning = {name: info for name, info in (("prefetch", prefetch_tuning()), ("wide_passes", wide_tuning())) if info}
    if tuning and (amx_rows := getattr(kernels(), "amx_min_rows", lambda: 0)()) > 0:
        tuning["amx_passes"] = {"min_rows": amx_rows}
    return {"kernel_tuning": tuning} if tuning else {}


class _Timings:
    """Typical timings of named points: the median of every run, over rounds in shuffled orders.

    The median, not the fastest: the planner predicts latency percentiles of a running server,
    whose steps take their typical time. On the 2-vCPU VMs here the fastest of six runs of a
    decode step was 5-20% below their median, and a profile of best-of times predicted the steps
    of a replayed trace 20-30% too fast. A burst of other work still moves a median little."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds
        self.points: list[tuple[tuple[Any, ...], Callable[[], float]]] = []
        self.samples: dict[tuple[Any, ...], list[float]] = {}

    def add(self, key: tuple[Any, ...], measure: Callable[[], float]) -> None:
        """A point to time: `measure` returns seconds."""
        self.points.append((key, measure))

    def run(self, desc: str, repeats: int = 1) -> None:
        """Time every point `repeats` times per round. Each round visits the points in its own
        order, so a slow spell of the machine does not hit the same points every round."""
        rng = random.Random(0)
        order = []
        for _ in range(self.rounds):
            order += rng.sample(self.points, len(self.points))
        for key, measure in bar(order, desc=desc, unit="point"):
            self.samples.setdefault(key, []).extend(measure() for _ in range(repeats))

    @property
    def typical(self) -> dict[tuple[Any, ...], float]:
        """Each point's median run."""
        return {key: statistics.median(ts) for key, ts in self.samples.items()}


def _time_prefill(engine: LLMEngine, tokens: int, before: int) -> float:
    """Seconds of one forward over a prompt chunk of `tokens` after `before` tokens of context
    (logits of its last row only, as a prefill step); blocks no request owns, as at start-up."""
    runner = engine.runner
    table = list(range(-(-(before + tokens) // runner.block_size)))
    sr = ScheduledRequest("profile-prefill", [1] * tokens, before, table, None, True, SamplingParams(), 0)
    runner.forward_logits(runner.prepare_inputs(SchedulerOutput([sr], tokens, [])))
    return runner.last_forward_time_s


class _Neighbour:
    """Another worker's work on the remaining cores, as a torch loop on a second thread: a prefill
    (matmuls of the model's shape over a prompt chunk: compute-bound) or a decode (one row
    through a weight matrix larger than the last-level cache: bandwidth-bound). torch releases
    the GIL inside each op, and both threads run torch's intra-op pool of the same size."""

    def __init__(self, kind: str, hidden: int, intermediate: int, chunk: int) -> None:
        if kind == "prefill":
            self.a, self.b = torch.randn(chunk, hidden), torch.randn(hidden, intermediate)
        else:
            cols = max(intermediate, (96 << 20) // (4 * hidden))  # ~96 MiB of float32 weights
            self.a, self.b = torch.randn(1, hidden), torch.randn(hidden, cols)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            torch.mm(self.a, self.b)

    def __enter__(self) -> _Neighbour:
        self._thread.start()
        time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _co_run(engine: LLMEngine, batch: int, chunk: int, repeats: int) -> dict[str, Any] | None:
    """Slowdown of a served decode step beside a prefill, and of a prefill chunk beside a decode;
    None when the machine has no cores for a neighbour of this many threads.

    The decode side is timed as `served` times it (requests streaming to a client process through
    the HTTP server), alone and with a prefill computing on the other cores: a disaggregated decode
    worker's outputs are relayed by other processes (Ray, the router, its clients) whose CPU time
    comes from whichever core is free, and beside a busy prefill worker only the decode worker's
    core is. The prefill side is the median of `repeats` chunk forwards, alone and beside a decode's
    weight streaming."""
    threads = torch.get_num_threads()
    cores = usable_cpus()
    if 2 * threads > cores:
        return None
    arch = engine.arch

    def neighbour(kind: str) -> _Neighbour:
        return _Neighbour(kind, arch.hidden_size, arch.intermediate_size, chunk)

    out: dict[str, Any] = {"threads": threads, "cores": cores, "decode_batch": batch, "prefill_chunk": chunk}
    out["decode_alone_s"] = _served_steps(engine, [batch], SERVED_TOKENS, rounds=1, lone_ttft=False)["step_s"][0]
    with neighbour("prefill"):
        out["decode_beside_s"] = _served_steps(engine, [batch], SERVED_TOKENS, rounds=1, lone_ttft=False)["step_s"][0]
    prefill = partial(_time_prefill, engine, chunk, 0)
    out["prefill_alone_s"] = statistics.median(prefill() for _ in range(repeats))
    with neighbour("decode"):
        out["prefill_beside_s"] = statistics.median(prefill() for _ in range(repeats))
    out["slowdown"] = {role: max(1.0, out[f"{role}_beside_s"] / out[f"{role}_alone_s"]) for role in ("decode", "prefill")}
    return out


def _timed_steps(engine: LLMEngine, batch: int, speculate: bool, steps: int, max_tokens: int,
                 policy: str | None = None) -> list[tuple[float, bool]]:
    """(seconds outside the forward pass, whether it verified drafts) of `steps` engine steps with
    `batch` requests decoding, speculation on (as configured, or with the policy mode `policy`) or
    off. The prompts repeat themselves, so a prompt-lookup proposer finds something to draft."""
    spec = engine.policy
    was_on, config = engine.speculation_enabled, spec.config
    engine.set_speculation(speculate)
    if policy is not None:
        spec.config = dataclasses.replace(config, policy=policy)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request([100 + i] + [7, 8, 9, 10] * 4, params,
                              request_id=f"profile-{policy or speculate}-{batch}-{i}") for i in range(batch)]
    out: list[tuple[float, bool]] = []
    try:
        while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.num_waiting:
            engine.step()
        for _ in range(steps):
            drafts = engine.spec_counters.get("num_drafts", 0)
            t0 = time.perf_counter()
            engine.step()
            out.append((time.perf_counter() - t0 - engine.runner.last_forward_time_s,
                        engine.spec_counters.get("num_drafts", 0) > drafts))
    finally:
        engine.abort_request(ids)
        spec.config = config
        engine.set_speculation(was_on)
    return out


def _engine_overhead(engine: LLMEngine, batch: int, speculate: bool, steps: int = 8) -> float:
    """Median seconds per step outside the forward pass with `batch` requests decoding, speculation
    on (as configured: the policy, proposals, verification) or off."""
    return max(0.0, statistics.median(t for t, _ in _timed_steps(engine, batch, speculate, steps, steps + 8)))


def _verify_overhead(engine: LLMEngine, batch: int, steps: int = 16) -> float | None:
    """Median seconds outside the forward of a step that verifies drafts, with `batch` requests
    decoding and the policy drafting every step (`always`): the proposals, the draft tree and the
    verification's bookkeeping. None when no step drafted. (The adaptive policy drafts on few of
    _engine_overhead's steps, so its median is a step that did not.)"""
    times = [t for t, drafted in _timed_steps(engine, batch, True, steps, 8 * steps + 16, policy="always") if drafted]
    return statistics.median(times) if times else None


# A streaming client in its own process, as real clients are: it takes CPU time beside the server.
_CLIENT = """
import asyncio, json, sys, time
import httpx
url, batch, tokens, salt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
repeat, gaps = (int(sys.argv[5]), [float(g) for g in sys.argv[6].split(",")]) if len(sys.argv) > 6 else (1, [])
async def one(client, i):
    body = {"messages": [{"role": "user", "content": f"[{salt}.{i}] Tell me a long story about the sea."}],
            "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0, ttft, prompt, cached = time.perf_counter(), None, None, 0
    async with client.stream("POST", url, json=body) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if ttft is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    ttft = time.perf_counter() - t0
                if chunk.get("usage"):
                    prompt = chunk["usage"]["prompt_tokens"]
                    cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"ttft_s": ttft, "prompt_tokens": prompt, "cached_tokens": cached}
async def main():
    async with httpx.AsyncClient(timeout=300) as client:
        # A client's first request pays its own start-up (connection, lazy imports in httpx and
        # anyio): not the server's per-request cost, so it is spent before anything is timed.
        await client.get(url.split("/v1/")[0] + "/health")
        out = []
        for r in range(repeat):  # `repeat` rounds of `batch` requests, each after gaps[r % len] s of idle server
            idle = gaps[r % len(gaps)] if gaps else None
            if idle:
                await asyncio.sleep(idle)
            out += [x | {"idle_s": idle} for x in await asyncio.gather(*(one(client, f"{r}.{i}") for i in range(batch)))]
        print(json.dumps(out))
asyncio.run(main())
"""


def _served_steps(engine: LLMEngine, batches: Sequence[int], tokens: int, rounds: int = 2,
                  lone_ttft: bool = True) -> dict[str, Any]:
    """Step times of the engine behind the OpenAI server (uvicorn on loopback, in this process)
    while `batch` chat completions streamed to a client process all decode; speculation off.

    Arranged as `specserve serve` runs: the engine steps in this thread (the one that loaded the
    model), the event loop in another; the measurements run from a third thread, which starts the
    clients and then waits on them. The window's marks are taken by the engine thread itself, after
    each of its steps (`AsyncEngine.on_step`): a thread polling the engine's state every few
    milliseconds took CPU time from the forward's threads on a 2-vCPU machine (a served step at
    batch 1 / 4 measured 4.6 / 7.3 ms with a 2 ms poll against 4.4 / 6.4 with a 20 ms one on the
    Xeon of session 49)."""
    import uvicorn

    from specserve.server.app import OpenAIServer, build_app
    from specserve.server.lifecycle import DrainingServer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = OpenAIServer(engine, "profile")
    uv = DrainingServer(uvicorn.Config(build_app(server), host="127.0.0.1", port=port, log_level="warning"), server)
    http = threading.Thread(target=uv.run, daemon=True)
    was_on = engine.speculation_enabled
    engine.set_speculation(False)
    server.async_engine.claim()

    def mark() -> tuple[float, int, float]:
        return time.perf_counter(), engine.num_steps, engine.runner.forward_time_s

    # The measured window: from the end of the first step after which all `batch` requests decode to
    # the end of the first after which they no longer all do (one finished). The engine loop's own
    # after-step hook marks it, beside the server's metrics.
    window: dict[str, Any] = {}
    metrics_on_step = server.async_engine.on_step

    def on_step(eng: LLMEngine) -> None:
        if metrics_on_step is not None:
            metrics_on_step(eng)
        batch = window.get("batch")
        if batch is not None and "end" not in window:
            running = eng.scheduler.running
            decoding = len(running) == batch and all(r.num_output_tokens > 0 for r in running)
            if "start" not in window and decoding:
                window["start"] = mark()
            elif "start" in window and not decoding:
                window["end"] = mark()

    server.async_engine.on_step = on_step

    lone: list[dict[str, Any]] = []  # the client's view of batch-1 requests: TTFT, prompt tokens

    def measure(batch: int) -> tuple[float, float]:
        """(seconds per step, forward seconds per step) while every request decodes."""
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        salt = f"{os.getpid()}.{time.monotonic_ns()}"  # no measurement finds another's prompt in the cache
        window.clear()
        window["batch"] = batch
        client = subprocess.Popen([sys.executable, "-c", _CLIENT, url, str(batch), str(tokens), salt],
                                  stdout=subprocess.PIPE, text=True)
        try:
            report, _ = client.communicate(timeout=300)
        finally:
            if client.poll() is None:
                client.kill()
            window.pop("batch", None)
        start, end = window.get("start"), window.get("end")
        if start is None or end is None or client.returncode:
            raise RuntimeError(f"the profiling client at batch {batch} failed (exit status {client.returncode}).")
        if batch == 1:
            lone.extend(r for r in json.loads(report) if r["ttft_s"] is not None)
        steps = max(end[1] - start[1], 1)
        return (end[0] - start[0]) / steps, (end[2] - start[2]) / steps

    def lone_requests() -> None:
        """Short requests one at a time, each on a server idle for the next of LONE_GAPS_S, for their
        times to first token."""
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        salt = f"{os.getpid()}.{time.monotonic_ns()}"
        report = subprocess.run([sys.executable, "-c", _CLIENT, url, "1", "4", salt, str(LONE_REQUESTS),
                                 ",".join(map(str, LONE_GAPS_S))], capture_output=True, text=True, timeout=300, check=True).stdout
        lone.extend(r for r in json.loads(report) if r["ttft_s"] is not None)

    best: dict[int, tuple[float, float]] = {}
    failure: list[BaseException] = []

    def measure_all() -> None:
        try:
            deadline = time.monotonic() + 60
            while not uv.started:
                if time.monotonic() > deadline or not http.is_alive():
                    raise RuntimeError("the profiling server did not start")
                time.sleep(0.02)
            for b in bar(list(batches) * rounds, desc="profiling steps behind the server", unit="batch"):
                best[b] = min(best.get(b, (float("inf"), 0.0)), measure(b))
            if lone_ttft:
                lone_requests()
        except BaseException as exc:  # noqa: BLE001 - raised again in the profiling thread
            failure.append(exc)
        finally:
            uv.should_exit = True  # drains the server, which stops the engine loop

    measurer = threading.Thread(target=measure_all, daemon=True)
    try:
        http.start()
        measurer.start()
        server.async_engine.drive(keep_waiting=http.is_alive)
    finally:
        uv.should_exit = True
        measurer.join(timeout=600)
        http.join(timeout=60)
        engine.set_speculation(was_on)
    if failure:
        raise failure[0]
    out = {"batches": list(batches), "context": 48 + tokens // 2,  # the chat prompt is ~48 tokens
           "step_s": [best[b][0] for b in batches], "forward_s": [best[b][1] for b in batches]}
    if lone_ttft and lone:  # lone requests' times to first token as their client saw them (HTTP, tokenizing)
        out |= _lone_summary(lone)
    return out


def _lone_summary(lone: list[dict[str, Any]]) -> dict[str, Any]:
    """The median lone request (`ttft_s`, `prompt_tokens`, `cached_tokens`: the chat template's
    start, found in the prefix cache), which the cost model charges, and every one of them
    (`lone`), so the spread between requests (thread wake-ups, the garbage collector, the client's
    own turn on a core) stays on record, each with the seconds the engine had been idle before it
    (`idle_s`; None where it was not arranged)."""
    first = sorted(lone, key=lambda r: r["ttft_s"])[len(lone) // 2]
    keep = ("ttft_s", "prompt_tokens", "cached_tokens")
    return {k: first[k] for k in keep} | {"lone": [{k: r.get(k) for k in (*keep, "idle_s")} for r in lone]}


def _in_process_requests(engine: LLMEngine, n: int, gaps_s: Sequence[float]) -> list[dict[str, Any]]:
    """Times to first token of `n` short requests, one at a time, the i-th on an engine idle for
    gaps_s[i % len(gaps_s)] seconds,
    driven in-process as an embedding application (and bench/disagg.py) drives it: tokenized by
    `prepare_request` on an event loop in another thread, stepped by `AsyncEngine` in this one (the
    thread that loaded the model), outputs streamed back into the loop."""
    import asyncio

    from specserve.server.async_engine import AsyncEngine

    ae = AsyncEngine(engine)
    ae.claim()
    was_on = engine.speculation_enabled
    engine.set_speculation(False)
    loop = asyncio.new_event_loop()
    out: list[dict[str, Any]] = []
    failure: list[BaseException] = []
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    salt = f"{os.getpid()}.{time.monotonic_ns()}"

    async def one(i: int, idle_s: float) -> None:
        t0 = time.perf_counter()
        p = engine.prepare_request(f"[{salt}.{i}] Write a long, detailed essay about the sea.", params,
                                   arrival_time=t0)
        ttft, cached = None, 0
        async for _, o in ae.submit([p]):  # to the end: the next request finds the engine idle
            if ttft is None and o.outputs[0].delta_token_ids:
                ttft = time.perf_counter() - t0
            if o.finished and o.metrics is not None:
                cached = o.metrics.num_cached_prompt_tokens
        if ttft is not None:
            out.append({"ttft_s": ttft, "prompt_tokens": p.request.num_prompt_tokens, "cached_tokens": cached,
                        "idle_s": idle_s})

    async def main() -> None:
        try:
            ae.start(asyncio.get_running_loop())
            for i in range(n):
                idle_s = gaps_s[i % len(gaps_s)]
                await asyncio.sleep(idle_s)
                await one(i, idle_s)
        except BaseException as exc:  # noqa: BLE001 - raised again in the profiling thread
            failure.append(exc)
        finally:
            await ae.shutdown(5)

    client = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    try:
        client.start()
        ae.drive(keep_waiting=client.is_alive)
    finally:
        client.join(timeout=60)
        loop.close()
        engine.set_speculation(was_on)
    if failure:
        raise failure[0]
    if not out:
        raise RuntimeError("no in-process request produced a token while profiling.")
    return out


def _relay(model: str, engine_kwargs: dict[str, Any], batches: Sequence[int], tokens: int,
           vocab_size: int, prefill_s: Callable[[int], float], long_tokens: int) -> dict[str, Any]:
    """A 1 prefill : 1 decode deployment of the model (Ray actors of this process's thread count,
    pinned): the decode worker's seconds per step while `batch` requests decode with their outputs
    relayed through the router (each request's time per output token after its first, the median
    request; speculation off), and lone requests' times to first token (LONE_REQUESTS of them,
    each after the next of LONE_GAPS_S of idle workers (`lone_idle_s`), and the median) with a
    prompt of RELAY_PROMPT_TOKENS (through the prefill worker and the KV stream) and of
    RELAY_LOCAL_TOKENS (prefilled on the decode worker).

    Then `beside_prefill`: at each of BESIDE_BATCHES, that many requests decoding while the prefill
    worker computes a `long_tokens` prompt (prefill_s(n): this process's seconds for an n-token
    chunk, to size the decodes), the decode worker's seconds per step over that window against the
    same requests' steps before it. The real neighbour, where `co_run` has a synthetic one; by
    batch, since how much a step suffers beside it depends on how much of the step is compute
    (x1.48 at batch 1, x1.64 at batch 4 on a 2-vCPU Zen 5)."""
    import ray

    from specserve.disagg.launch import DisaggClient, launch
    from specserve.disagg.worker import without_speculation

    kwargs = {**without_speculation(engine_kwargs), "num_threads": torch.get_num_threads()}
    rng = random.Random(0)

    def prompts(n: int, length: int = RELAY_PROMPT_TOKENS) -> list[list[int]]:  # distinct: no prefix-cache hits
        return [[rng.randrange(100, vocab_size) for _ in range(length)] for _ in range(n)]

    router = launch(model, kwargs, 1, 1, threads_per_worker=torch.get_num_threads(), pin_cpus=True)
    client = DisaggClient(router)
    try:
        def run(batch: int, max_tokens: int, length: int = RELAY_PROMPT_TOKENS) -> tuple[list[float], list[float]]:
            """(times to first token, seconds per later token) of `batch` requests sent together, as
            the client sees their tokens stream in."""
            stamps: dict[str, list[float]] = {}

            def seen(out: Any) -> None:
                stamps.setdefault(out.request_id, []).extend([time.perf_counter()] * len(out.outputs[0].delta_token_ids))

            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            t0 = time.perf_counter()
            client.generate(prompts(batch, length), params, timeout=600, on_output=seen)
            ttft = [s[0] - t0 for s in stamps.values()]
            tpot = [(s[-1] - s[0]) / (len(s) - 1) for s in stamps.values() if len(s) > 1]
            if len(ttft) != batch or len(tpot) != batch:
                raise RuntimeError(f"the disaggregated profile run at batch {batch} lost outputs.")
            return ttft, tpot

        run(2, 8)  # warm-up: first transfers, first steps
        step_s = []
        for b in bar(list(batches), desc="profiling disaggregated decode steps", unit="batch"):
            step_s.append(statistics.median(run(b, tokens)[1]))
        def lone(length: int, idle_s: float) -> float:
            time.sleep(idle_s)  # onto idle workers, as requests arrive
            return run(1, 2, length)[0][0]

        idle = [LONE_GAPS_S[i % len(LONE_GAPS_S)] for i in range(LONE_REQUESTS)]
        ttfts = [lone(RELAY_PROMPT_TOKENS, g) for g in idle]
        local_ttfts = [lone(RELAY_LOCAL_TOKENS, g) for g in idle]
        beside_runs = []
        for batch in sorted({min(b, max(batches)) for b in BESIDE_BATCHES}):
            per_token = step_s[batches.index(batch)] if batch in batches else step_s[-1]
            beside_runs.append(_beside_prefill(client, prompts(batch), prompts(1, long_tokens)[0], per_token,
                                               prefill_s(long_tokens)))
        beside = {key: [run[key] for run in beside_runs] for key in beside_runs[0]} | {"prompt_tokens": long_tokens}
    finally:
        client.close()
        ray.shutdown()
    return {"threads": torch.get_num_threads(), "batches": list(batches), "context": RELAY_PROMPT_TOKENS + tokens // 2,
            "step_s": step_s, "ttft_s": statistics.median(ttfts), "prompt_tokens": RELAY_PROMPT_TOKENS,
            "local_ttft_s": statistics.median(local_ttfts), "local_prompt_tokens": RELAY_LOCAL_TOKENS,
            "lone_ttft_s": ttfts, "local_lone_ttft_s": local_ttfts, "lone_idle_s": idle,
            "beside_prefill": beside}


def _beside_prefill(client: Any, decodes: list[list[int]], long_prompt: list[int], per_token_s: float,
                    prefill_s: float) -> dict[str, Any]:
    """Seconds per step of `decodes` on a disaggregated decode worker, alone and while the prefill
    worker computes `long_prompt` (from its submission to its first token), each the median
    request's seconds per token in that window; `slowdown` is their ratio."""
    import asyncio

    stamps: dict[str, list[float]] = {}

    def seen(out: Any) -> None:
        stamps.setdefault(out.request_id, []).extend([time.perf_counter()] * len(out.outputs[0].delta_token_ids))

    # Enough tokens to decode through the warm-up, the window before and the prefill three times over.
    max_tokens = int(3 * (prefill_s + 0.5) / max(per_token_s, 1e-4)) + 64
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)

    async def run() -> tuple[float, float, float]:
        tasks = [asyncio.ensure_future(client.request(p, params, seen)) for p in decodes]
        while len(stamps) < len(decodes) or min(len(s) for s in stamps.values()) < 8:
            await asyncio.sleep(0.005)
        t0 = time.perf_counter()
        await asyncio.sleep(max(0.3, prefill_s))
        t1 = time.perf_counter()
        await client.request(long_prompt, SamplingParams(max_tokens=1, temperature=0))
        t2 = time.perf_counter()
        await asyncio.gather(*tasks)
        return t0, t1, t2

    t0, t1, t2 = client.call(run(), timeout=600)

    def gap(lo: float, hi: float) -> float:
        """The median request's seconds per token over [lo, hi]."""
        per = [(inside[-1] - inside[0]) / (len(inside) - 1) for s in stamps.values()
               if len(inside := [x for x in s if lo <= x <= hi]) > 2]
        if not per:
            raise RuntimeError("no decode step fell in the window timed beside the prefill worker.")
        return statistics.median(per)

    alone, beside = gap(t0, t1), gap(t1, t2)
    return {"batches": len(decodes), "window_s": t2 - t1, "alone_s": alone, "beside_s": beside,
            "slowdown": max(1.0, beside / alone)}


def _kv_transfer(engine: LLMEngine, tokens: int, repeats: int) -> dict[str, Any]:
    """Seconds to write `tokens` of KV from the paged cache into a shared-memory channel and to
    read them back into other pages, layer by layer; the bandwidth of the two copies in turn."""
    from specserve.disagg.kv_transfer import (
        TransferDescriptor,
        gather_layer,
        kv_layout_of,
        new_transfer_id,
        open_receiver,
        open_sink,
        scatter_layer,
        slot_indices,
    )

    runner = engine.runner
    bs = runner.block_size
    m = min(tokens, (runner.num_blocks // 2) * bs)
    layout = kv_layout_of(engine)
    src = slot_indices(list(range(runner.num_blocks // 2)), 0, m, bs).to(runner.device)
    dst = slot_indices(list(range(runner.num_blocks // 2, runner.num_blocks)), 0, m, bs).to(runner.device)
    desc = TransferDescriptor(new_transfer_id(), "shm", m, layout)
    receiver = open_receiver(desc)
    sink = open_sink(desc)
    write_s = read_s = float("inf")
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            for i, layer in enumerate(runner.kv_caches):
                sink.write(i, 0, [p.cpu() for p in gather_layer(layer, src)])
            write_s = min(write_s, time.perf_counter() - t0)
            t0 = time.perf_counter()
            for i, layer in enumerate(runner.kv_caches):
                scatter_layer(layer, dst, receiver.read(i, 0, m))
            if runner.device.type == "cuda":
                torch.cuda.synchronize()  # the copies into the cache run asynchronously
            read_s = min(read_s, time.perf_counter() - t0)
    finally:
        sink.finish()
        receiver.close()
    nbytes = m * layout.bytes_per_token()
    return {"transport": "shm", "tokens": m, "bytes": nbytes, "write_s": write_s, "read_s": read_s,
            "bandwidth_gb_s": nbytes / (write_s + read_s) / 1e9}


def record_profile(
    engine: LLMEngine,
    *,
    batches: Sequence[int] = DECODE_BATCHES,
    contexts: Sequence[int] = DECODE_CONTEXTS,
    repeats: int = 2,
    disagg_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Time the engine's model (and drafter) and return the profile dict. disagg_kwargs: the
    LLM(...) arguments the engine was built with; given, the model is also timed disaggregated
    (`relay`)."""
    if repeats < 1 or min(batches, default=0) < 1 or min(contexts, default=0) < 1:
        raise ConfigError(f"repeats, batches and contexts must be >= 1, got {repeats}, {list(batches)} and "
                          f"{list(contexts)}.")
    t_start = time.perf_counter()
    runner, cfg = engine.runner, engine.config
    budget = cfg.scheduler.max_num_batched_tokens
    max_len = engine.max_model_len
    contexts = sorted({c for c in contexts if c + max(VERIFY_TOKENS) < max_len})
    batches = sorted({b for b in batches if b <= cfg.scheduler.max_num_seqs})
    if not contexts or not batches:
        raise ConfigError(f"no context below max_model_len {max_len} or no batch within max_num_seqs "
                         f"{cfg.scheduler.max_num_seqs}: give smaller --contexts / --batches.")
    chunks = sorted({c for c in (*PREFILL_CHUNKS, budget) if c <= budget})
    offsets = [o for o in PREFILL_OFFSETS if o + budget <= max_len]
    verify_batches = [b for b in VERIFY_BATCHES if b <= cfg.scheduler.max_num_seqs]
    runner.time_decode_step(1)  # warm-up

    timings = _Timings(rounds=ROUNDS)
    for c in contexts:
        for b in batches:
            timings.add(("decode", c, b), partial(runner.time_decode_step, b, repeats=1, context=c))
    for b in verify_batches:
        for n in VERIFY_TOKENS:
            timings.add(("verify", b, n), partial(runner.time_decode_step, b, tokens_per_req=n, repeats=1,
                                                  context=contexts[0]))
    for p in chunks:
        timings.add(("prefill", p), partial(_time_prefill, engine, p, 0))
    for o in offsets[1:]:
        timings.add(("prefill_context", o), partial(_time_prefill, engine, budget, o))
    timings.run("profiling target steps", repeats)
    t = timings.typical

    proposer = engine.proposer
    drafter: dict[str, Any] | None = None
    overhead_batches = [b for b in OVERHEAD_BATCHES if b <= cfg.scheduler.max_num_seqs]
    overhead = [_engine_overhead(engine, b, speculate=False) for b in bar(
        overhead_batches, desc="profiling engine overhead", unit="batch")]
    if proposer is not None and proposer.traits.cost == "per_pass":
        proposer.time_pass(1)  # warm-up
        draft_batches = [b for b in batches if b <= cfg.spec.off_batch]
        drafter = {"cost": "per_pass", "batches": draft_batches,
                   "pass_s": [min(proposer.time_pass(b) for _ in range(repeats)) for b in draft_batches]}
    elif proposer is not None:
        # A model-free proposer costs no forward; what speculation adds is the policy, the proposals
        # and the verification outside the forward, on every step while it is switched on.
        on = [_engine_overhead(engine, b, speculate=True) for b in overhead_batches]
        drafter = {"cost": "flat", "batches": overhead_batches,
                   "step_s": [max(a - b, 1e-6) for a, b in zip(on, overhead)]}
        # ... and on a step that verifies drafts, what the proposals and the verification add on top.
        verify = [_verify_overhead(engine, b) for b in overhead_batches]
        if all(v is not None for v in verify):
            drafter["verify_step_s"] = [max(v - a, 1e-6) for v, a in zip(verify, on)]
    served = _served_steps(engine, [b for b in SERVED_BATCHES if b <= cfg.scheduler.max_num_seqs], SERVED_TOKENS)
    with spinner("profiling requests driven in-process"):
        in_process = _lone_summary(_in_process_requests(engine, LONE_REQUESTS, LONE_GAPS_S))
    with spinner("profiling a step beside another worker"):
        co_run = _co_run(engine, min(CO_RUN_BATCH, cfg.scheduler.max_num_seqs), budget, CO_RUN_REPEATS)
    relay = None
    if disagg_kwargs is not None:
        try:
            long_tokens = min(RELAY_LONG_TOKENS, max_len - 8)
            relay = _relay(cfg.model.model, disagg_kwargs,
                           [b for b in SERVED_BATCHES if b <= cfg.scheduler.max_num_seqs], SERVED_TOKENS,
                           engine.arch.vocab_size, lambda n: t[("prefill", budget)] * n / budget, long_tokens)
        except Exception as exc:  # noqa: BLE001 - the tables timed so far are worth keeping
            print(f"warning: the disaggregated part of the profile failed ({type(exc).__name__}: {exc}); the "
                  "profile is written without `relay`, and plans charge disaggregated deployments no relay cost.",
                  file=sys.stderr)
    with spinner("profiling the KV transfer channel"):  # last: it writes into pages no request owns
        transfer = _kv_transfer(engine, KV_TRANSFER_TOKENS, repeats + 1)

    spec = cfg.spec
    return {
        "format": PROFILE_FORMAT,
        "machine": machine_info(),
        "model": {
            "name": cfg.model.model, "architecture": engine.arch.architecture, "num_layers": engine.arch.num_layers,
            "dtype": str(runner.dtype).removeprefix("torch."), "quantization": cfg.model.quantization,
            "weight_bytes": runner.weight_bytes_per_step(),
            "kv_cache_dtype": str(cfg.cache.kv_cache_dtype),
            "kv_bytes_per_token": kv_bytes_per_token(engine.arch, cfg.cache, runner.dtype),
            "kv_capacity_tokens": engine.kv_manager.capacity_tokens,
        },
        "engine": {"device": cfg.model.device, "threads": torch.get_num_threads(),
                   # the native kernels attend each token to its own keys; torch's SDPA pads the batch
                   "attention": "per_token" if runner.native_ops else "padded",
                   "max_num_batched_tokens": budget, "max_num_seqs": cfg.scheduler.max_num_seqs,
                   "block_size": cfg.cache.block_size, "max_model_len": max_len},
        "speculation": {"method": spec.method, "draft_model": spec.draft_model, "num_spec_tokens": spec.num_spec_tokens,
                        "policy": spec.policy},
        "decode": {"contexts": contexts, "batches": batches,
                   "step_s": [[t[("decode", c, b)] for b in batches] for c in contexts]},
        "verify": {"context": contexts[0], "batches": verify_batches, "tokens": list(VERIFY_TOKENS),
                   "step_s": [[t[("verify", b, n)] for n in VERIFY_TOKENS] for b in verify_batches]},
        "prefill": {"chunks": chunks, "step_s": [t[("prefill", p)] for p in chunks],
                    "tokens_per_s": [p / t[("prefill", p)] for p in chunks]},
        "prefill_context": {"chunk": budget, "offsets": offsets,
                            "step_s": [t[("prefill", budget)] if o == 0 else t[("prefill_context", o)]
                                       for o in offsets]},
        "engine_overhead": {"batches": overhead_batches, "step_s": overhead},
        "served": served,
        "in_process": in_process,
        "drafter": drafter,
        "kv_transfer": transfer,
        "co_run": co_run,
        "relay": relay,
        "duration_s": time.perf_counter() - t_start,
    }


def write_profile(profile: dict[str, Any], path: str | Path) -> Path:
    """Write the profile as JSON (creating the folder)."""
    out = Path(path)
    write_atomic(out, lambda f: f.write(json.dumps(profile, indent=2).encode()))
    return out


def describe(profile: dict[str, Any]) -> str:
    """A few lines on what the profile holds, for the command line."""
    d, p, kv = profile["decode"], profile["prefill"], profile["kv_transfer"]
    step1 = d["step_s"][0][0]
    lines = [
        f"{profile['model']['name']} on {profile['machine']['cpu']} ({profile['engine']['threads']} threads), "
        f"recorded in {profile['duration_s']:.0f} s",
        f"  decode step at batch 1: {step1 * 1e3:.1f} ms; at batch {d['batches'][-1]}: "
        f"{d['step_s'][0][-1] * 1e3:.1f} ms (context {d['contexts'][0]})",
        f"  prefill: {p['tokens_per_s'][-1]:.0f} tokens/s in chunks of {p['chunks'][-1]}",
        f"  engine overhead per step: {profile['engine_overhead']['step_s'][0] * 1e3:.2f} ms; behind the "
        f"server at batch {profile['served']['batches'][-1]}: {profile['served']['step_s'][-1] * 1e3:.1f} ms a step",
        f"  KV transfer (shared memory): {kv['bandwidth_gb_s']:.2f} GB/s",
    ]
    dr = profile["drafter"]
    if dr is not None and dr["cost"] == "per_pass":
        lines.append(f"  draft pass: {dr['pass_s'][0] * 1e3:.2f} ms at batch {dr['batches'][0]}")
    elif dr is not None:
        lines.append(f"  speculation on adds {dr['step_s'][0] * 1e3:.2f} ms a step at batch {dr['batches'][0]}")
    co = profile.get("co_run")
    if co:
        lines.append(f"  beside another worker: decode steps x{co['slowdown']['decode']:.2f}, "
                     f"prefill chunks x{co['slowdown']['prefill']:.2f}")
    relay = profile.get("relay")
    if relay:
        lines.append(f"  disaggregated (1P:1D): decode step at batch {relay['batches'][-1]} "
                     f"{relay['step_s'][-1] * 1e3:.1f} ms behind the router; a lone request's first token in "
                     f"{relay['ttft_s'] * 1e3:.0f} ms")
    return "\n".join(lines)
