"""Drive one LLMEngine from its own thread and hand outputs to asyncio streams.

The engine is not thread-safe, so exactly one thread owns it: it drains a command queue
(add, abort, switch speculation), runs `engine.step()` while anything is in flight, and posts
each RequestOutput to the asyncio queue of the HTTP request that owns it. Model compute runs
in that thread (torch releases the GIL), so the event loop keeps serving HTTP meanwhile.

That thread is best the one that loaded the model (`claim` + `drive`, as `specserve serve`
runs it): torch's CPU kernels run on OpenMP (libgomp), which gives every thread that starts a
parallel region a team of its own, and while the process holds more team threads than it has
CPUs, idle workers sleep after a hundred spins instead of spinning. A second team (the loader's,
idle for good) then makes every parallel region of the engine's wake its workers from sleep:
measured on a 2-vCPU Zen 4, a SmolLM2 decode step at 730 tokens of context took 9.5 ms on a
fresh thread against 7.6 ms on the loading thread, a 256x256 matmul 270 us against 175 us.
Without a claim, `start` runs the loop on a new thread (tests, embedding in other apps).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from specserve.engine.engine import LLMEngine, PreparedRequest
from specserve.errors import SpecServeError
from specserve.outputs import RequestOutput

logger = logging.getLogger(__name__)

# After the drain deadline: how long aborted requests may take to deliver their final outputs
# (the engine thread applies the abort after the step it is running).
ABORT_GRACE_S = 10.0


def take_commands(commands: queue.Queue, timeout: float | None) -> list:
    """Everything queued; with a timeout, first wait up to that long for something to arrive."""
    out = []
    try:
        out.append(commands.get(timeout=timeout) if timeout is not None else commands.get_nowait())
        while True:
            out.append(commands.get_nowait())
    except queue.Empty:
        return out


class EngineOverloadedError(SpecServeError):
    """The waiting queue is full; the client should retry later (HTTP 429)."""


class EngineStoppedError(SpecServeError):
    """The server is draining or the engine thread died (HTTP 503)."""


class RequestStream:
    """Outputs of the engine requests behind one HTTP request (n choices, several prompts)."""

    def __init__(self, owner: AsyncEngine, request_ids: list[str]) -> None:
        self.owner = owner
        self.request_ids = request_ids
        self.choice_index = {rid: i for i, rid in enumerate(request_ids)}
        self.queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException] = asyncio.Queue()
        self.finished: set[str] = set()

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while len(self.finished) < len(self.request_ids):
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            idx, out = item
            if out.finished:
                self.finished.add(out.request_id)
            yield idx, out

    def abort(self) -> None:
        """Abort every unfinished request of this stream (client gone, server draining)."""
        pending = [r for r in self.request_ids if r not in self.finished]
        if pending:
            self.owner.abort(pending)


class AsyncEngine:
    """Thread-owning wrapper that the HTTP layer talks to."""

    def __init__(
        self,
        engine: LLMEngine,
        max_waiting: int = 256,
        on_step: Callable[[LLMEngine], None] | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.on_step = on_step
        self.on_output = on_output
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()  # guards _streams and _num_in_flight
        self._num_in_flight = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._started = threading.Event()  # start() has handed over the event loop
        self._done = threading.Event()  # the engine loop has returned
        self._keep_going: Callable[[], bool] = lambda: True  # drive()'s watch on the HTTP thread
        self.accepting = True
        self.error: str | None = None
        self.last_step_time = time.time()

    # ------------------------------------------------------------------ lifecycle
    def claim(self) -> None:
        """Make the calling thread the engine thread: `start` will not start one, and the caller
        runs the engine loop with `drive` (call before the event loop starts the app)."""
        self._thread = threading.current_thread()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Post results into `loop`; start the engine thread unless a thread claimed the engine."""
        self._loop = loop
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
            self._thread.start()
        self._started.set()

    def drive(self, keep_waiting: Callable[[], bool] = lambda: True) -> bool:
        """Run the engine loop in the claiming thread until shutdown, or until `keep_waiting()`
        turns false (the HTTP server failed to start, or its thread ended without shutting the
        engine down; checked between steps and at least twice a second when idle). True when
        the loop ended by `shutdown`."""
        if self._thread is not threading.current_thread():
            raise RuntimeError("drive() runs in the thread that called claim().")
        while not self._started.wait(0.1):
            if not keep_waiting():
                return False
        self._keep_going = keep_waiting
        self._run()
        return self._stop.is_set()

    @property
    def is_alive(self) -> bool:
        """True while the engine loop runs (or is about to) and has not failed."""
        return self._thread is not None and self._thread.is_alive() and not self._done.is_set() and self.error is None

    @property
    def num_in_flight(self) -> int:
        """Engine requests submitted and not finished."""
        return self._num_in_flight

    @property
    def capacity(self) -> int:
        """Engine requests that may be in flight at once (running plus waiting); a single HTTP
        request with more can never be admitted."""
        return self.engine.config.scheduler.max_num_seqs + self.max_waiting

    async def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        """Stop admitting, let in-flight requests finish (up to the timeout), abort the rest; every
        stream gets its final output (or an error) before the engine thread stops. Idempotent."""
        if self._stop.is_set():
            return
        self.accepting = False
        deadline = time.monotonic() + drain_timeout_s
        while self._num_in_flight and time.monotonic() < deadline and self.is_alive:
            await asyncio.sleep(0.05)
        with self._lock:
            leftover = list(self._streams)
        if leftover:
            logger.warning("aborting %d requests still running at shutdown", len(leftover))
            self.abort(leftover)
            deadline = time.monotonic() + ABORT_GRACE_S
            while self._num_in_flight and time.monotonic() < deadline and self.is_alive:
                await asyncio.sleep(0.02)
        self._stop.set()
        self._commands.put(("noop", None))
        stopped = self._thread is None or await asyncio.to_thread(self._done.wait, 10.0)
        with self._lock:
            stuck = list(self._streams)
        self._fail(stuck, EngineStoppedError("The server shut down before this request finished; retry it."))
        close = getattr(self.engine, "close", None)
        if close is not None and stopped:
            await asyncio.to_thread(close)  # the disk tier's queued writes
        if self.error is None and stopped:
            try:
                self.engine.check_integrity()
                logger.info("shutdown: KV cache integrity holds, no blocks leaked")
            except AssertionError as exc:
                logger.error("shutdown: KV cache integrity violated: %s", exc)

    # ------------------------------------------------------------------ requests
    def submit(self, prepared: list[PreparedRequest]) -> RequestStream:
        """Queue engine requests; raises when draining or when the waiting queue is full."""
        if not self.accepting or not self.is_alive:
            raise EngineStoppedError(
                "The server is shutting down or its engine stopped; retry on another replica."
            )
        capacity = self.capacity
        stream = RequestStream(self, [p.request.request_id for p in prepared])
        with self._lock:
            if self._num_in_flight + len(prepared) > capacity:
                raise EngineOverloadedError(
                    f"{self._num_in_flight} requests are in flight and the queue holds at most {capacity}; "
                    "retry after a short wait."
                )
            self._num_in_flight += len(prepared)
            for p in prepared:
                self._streams[p.request.request_id] = stream
        self._commands.put(("add", prepared))
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Abort engine requests (thread-safe; takes effect before the next step)."""
        self._commands.put(("abort", list(request_ids)))

    def set_speculation(self, enabled: bool) -> None:
        """Switch speculation at run time."""
        self._commands.put(("spec", bool(enabled)))

    # ------------------------------------------------------------------ engine thread
    def _post(self, stream: RequestStream, item: tuple[int, RequestOutput] | BaseException) -> None:
        assert self._loop is not None
        # A closed event loop raises RuntimeError: nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            with self._lock:
                stream = self._streams.get(out.request_id)
                if out.finished and stream is not None:
                    del self._streams[out.request_id]
                    self._num_in_flight -= 1
            if out.finished and self.on_output is not None:
                try:
                    self.on_output(out)
                except Exception:  # noqa: BLE001 - metrics must never break serving
                    logger.exception("metrics callback failed")
            if stream is not None:
                self._post(stream, (stream.choice_index[out.request_id], out))

    def _handle(self, cmd: str, arg: Any) -> None:
        eng = self.engine
        if cmd == "add":
            for i, p in enumerate(arg):
                try:
                    eng.add_prepared(p)
                except Exception as exc:  # noqa: BLE001 - report to the one client, keep serving
                    self._fail([q.request.request_id for q in arg[i:]], exc)
                    eng.abort_request([q.request.request_id for q in arg[:i]])
                    return
        elif cmd == "abort":
            self._deliver(eng.abort_request(arg))
            # A stream entry the engine does not know (its add failed) is closed here.
            with self._lock:
                unknown = [r for r in arg if r in self._streams and not eng.has_request(r)]
            self._fail(unknown, EngineStoppedError("request aborted before it started"))
        elif cmd == "spec":
            eng.set_speculation(arg)

    def _fail(self, request_ids: list[str], exc: BaseException) -> None:
        for rid in request_ids:
            with self._lock:
                stream = self._streams.pop(rid, None)
                if stream is not None:
                    self._num_in_flight -= 1
            if stream is not None:
                self._post(stream, exc)

    def _run(self) -> None:
        try:
            self._steps()
        finally:
            self._done.set()

    def _steps(self) -> None:
        eng = self.engine
        idle_work = False
        while not self._stop.is_set() and self._keep_going():
            try:
                # Idle: sleep until a command arrives (only look while idle work remains). Busy:
                # only pick up what is queued.
                busy = eng.has_unfinished_requests()
                for cmd in take_commands(self._commands, None if busy else 0.0 if idle_work else 0.5):
                    self._handle(*cmd)
                if eng.has_unfinished_requests():
                    self._deliver(eng.step())
                    self.last_step_time = time.time()
                    idle_work = False
                else:
                    idle_work = eng.idle_work()
                if self.on_step is not None:
                    self.on_step(eng)
            except Exception as exc:  # noqa: BLE001 - the engine is broken: fail everyone loudly
                logger.exception("engine loop crashed")
                self.error = f"{type(exc).__name__}: {exc}"
                with self._lock:
                    ids = list(self._streams)
                self._fail(ids, EngineStoppedError(f"engine failed: {self.error}"))
                return
