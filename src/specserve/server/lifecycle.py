"""Run the app under uvicorn so that SIGTERM / SIGINT drain before the listener closes.

uvicorn alone closes its listening socket on the first signal: during the drain new clients get
a refused connection, and responses still running when its graceful timeout ends are cut
mid-body. Here the first signal drains the OpenAIServer with the listener open (the AccessGate
answers new API requests 503 + Retry-After), every in-flight response ends properly (a stream
with its final event and `data: [DONE]`), and only then does uvicorn shut down. A second signal
shuts down without waiting for the drain; a third exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
from types import FrameType

import uvicorn

from specserve.server.app import OpenAIServer

# After the drain every response has its last bytes queued; this long they may take to flush.
FLUSH_AFTER_DRAIN_S = 5


class DrainingServer(uvicorn.Server):
    """A uvicorn.Server whose exit signals drain the OpenAIServer first."""

    def __init__(self, config: uvicorn.Config, server: OpenAIServer) -> None:
        super().__init__(config)
        self.api = server
        self.num_exit_signals = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        """Serve until drained (or told to stop)."""
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Signal handler, also safe to call from another thread: drain, then stop, then force."""
        self.num_exit_signals += 1
        if self.num_exit_signals == 1 and self._loop is not None and self.started:
            self._loop.call_soon_threadsafe(self._start_drain)
        elif self.num_exit_signals <= 2:
            self.should_exit = True
        else:
            self.force_exit = True

    def _start_drain(self) -> None:
        self._drain = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.api.drain()
        finally:
            self.should_exit = True


def run_server(
    server: OpenAIServer, *, host: str, port: int, log_level: str, access_log: bool
) -> None:
    """Serve `server` over HTTP until a signal has drained it.

    A co-located engine steps in this thread, the one that loaded its model, and uvicorn's event
    loop runs in another (see specserve.server.async_engine on why the loading thread); the
    signals reach this thread and drain as they would in uvicorn's own handlers."""
    from specserve.server.app import build_app
    from specserve.server.async_engine import AsyncEngine

    config = uvicorn.Config(
        build_app(server),
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        timeout_graceful_shutdown=FLUSH_AFTER_DRAIN_S,
    )
    uv = DrainingServer(config, server)
    engine = server.async_engine
    if not isinstance(engine, AsyncEngine) or threading.current_thread() is not threading.main_thread():
        uv.run()  # a router (disaggregated) steps nothing here; off the main thread no signals come
        return
    engine.claim()
    http = threading.Thread(target=uv.run, name="specserve-http", daemon=True)
    previous = {sig: signal.signal(sig, uv.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        http.start()
        shut_down = engine.drive(keep_waiting=http.is_alive)
        while http.is_alive():  # a crashed engine leaves the server answering 503 until a signal
            http.join(0.2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not uv.started:
        raise SystemExit(1)  # uvicorn logged why (the port is taken, say)
    if not shut_down and engine.error is None:
        logging.getLogger(__name__).error("the HTTP server stopped without draining the engine")
        raise SystemExit(1)
