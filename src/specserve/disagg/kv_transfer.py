"""Moving a request's KV from a prefill worker to a decode worker, layer by layer.

The prefill worker computes the KV of a request's first ``m = n - 1`` tokens; the decode worker
treats those tokens as computed (like a prefix-cache hit), computes the last prompt token
itself and samples from there. So the decode worker's first step is an ordinary decode step.

Two halves, split by role:

- **Prefill side** (`PrefillConnector`, installed on the prefill engine's runner): the
  scheduler side decides what to send (a request's tokens scheduled this step, plus tokens it
  found in the prefill worker's own prefix cache); the worker side runs after every layer and
  writes that layer's keys and values for those tokens into the request's channel at once,
  while the next layer computes.
- **Decode side** (`DecodeConnector`, on the decode engine): between steps the scheduler
  allocates the blocks of an incoming request (`Scheduler.reserve_incoming`: it is the only
  allocator of blocks) and the connector copies whatever layers have arrived into them (so
  loading overlaps the prefill's compute); the scheduler admits the request once every layer
  has arrived; in that first step each layer loads what is still missing just before it runs.

Channels (one per transfer) hold ``[layers, 2, m, kv_heads, head_dim]`` plus, per layer, how
many tokens are ready. Same host: a file in /dev/shm mapped by both workers, so the router
never touches KV bytes and the only copies are paged cache -> channel -> paged cache. Across
hosts: Ray actor calls carry each (layer, token range) through Ray's object store into a
channel in the decode worker's memory. Token ranges may land out of order; a layer counts as
ready up to its first gap.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from specserve.config import KVCacheDtype
from specserve.engine.scheduler import SchedulerOutput
from specserve.errors import SpecServeError
from specserve.kv_cache.manager import slot_indices
from specserve.kv_cache.pages import LayerKV
from specserve.request import Request
from specserve.spec.proposer import PromptFeed

SHM_DIR = "/dev/shm"
_HEADER_SLOTS = 4  # after the per-layer counters: status, (unused), written_at (ns), (unused)
STATUS_OPEN, STATUS_DONE, STATUS_FAILED = 0, 1, 2
LAYER_STARTS = ("all", "first")
STATUS_CANCELLED = 3  # set by the receiver: it no longer wants the rest (a draft's KV whose request ended)


class KVTransferError(SpecServeError):
    """A KV transfer failed or timed out; the router re-prefills the request elsewhere."""


@dataclass(frozen=True)
class KVLayout:
    """Shape of one model's KV per token: must match on both sides of a transfer.

    A layer's KV travels as the parts its paged cache holds (ModelRunner.kv_caches): K and V in
    the model's dtype or in float16, or with an int8 cache K and V in int8 plus their per-(token, head) float32
    scales, so an int8 cache moves ~1/4 of a float32 cache's bytes and lands bit for bit."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name of the model's activations, e.g. "float32"
    kv_cache_dtype: str = "auto"  # a KVCacheDtype value: "auto" (the model dtype), "fp16" or "int8"

    @property
    def torch_dtype(self) -> torch.dtype:
        """The element type as a torch dtype."""
        return getattr(torch, self.dtype)

    def parts(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(per-token shape, dtype) of each tensor of one layer, in the cache's order."""
        kv = (self.num_kv_heads, self.head_dim)
        kv_dtype = KVCacheDtype(self.kv_cache_dtype)
        pages = [(kv, kv_dtype.storage(self.torch_dtype))] * 2
        return pages + [((self.num_kv_heads,), torch.float32)] * 2 if kv_dtype.quantized else pages

    def bytes_per_token(self) -> int:
        """KV bytes of one token over all layers."""
        per_layer = sum(math.prod(shape) * torch.empty((), dtype=dt).element_size() for shape, dt in self.parts())
        return self.num_layers * per_layer


@dataclass(frozen=True)
class TransferDescriptor:
    """What the router hands both workers so they can find each other's channel (picklable)."""

    transfer_id: str
    transport: str  # "shm" (same host) or "ray" (object store, any host)
    num_tokens: int  # m: tokens whose KV travels
    layout: KVLayout
    receiver: Any = None  # "ray": the decode worker's actor handle
    # The drafter's prompt KV for the same tokens, computed and sent by a prefill worker that
    # holds the decode worker's drafter (its own channel: another layout); None: none is sent.
    draft: TransferDescriptor | None = None
    # The prompt's token after the m that travel (a feature drafter's KV slot m-1 pairs the
    # target's feature there with it: EAGLE, MTP); set on a draft channel's descriptor.
    next_token: int | None = None
    # Prompt tokens queued on the prefill worker ahead of this one when the router sent it: its
    # first KV may be that much later (`prefill_budget_s`).
    queued_tokens: int = 0

    @property
    def shm_path(self) -> str:
        """The shared-memory file of an "shm" transfer."""
        return os.path.join(SHM_DIR, f"specserve-kv-{self.transfer_id}")


PREFILL_S_PER_TOKEN = 0.05  # what a prompt token may take to prefill before a prefill counts as stalled


def prefill_budget_s(timeout_s: float, desc: TransferDescriptor) -> float:
    """How long a transfer's prefill may take before its first KV, its queue included:
    --transfer-timeout plus an allowance per token of its prompt and of the prompts queued ahead of
    it on its prefill worker (busy is not stalled). Once KV flows, --transfer-timeout without
    progress is a stall."""
    return timeout_s + PREFILL_S_PER_TOKEN * (desc.num_tokens + desc.queued_tokens)


def gather_layer(kv: LayerKV, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One layer's cache tensors (pages [blocks, block_size, ...]) at these flat slots, each [n, ...]."""
    return tuple(t.view(-1, *t.shape[2:]).index_select(0, slots) for t in kv)


def scatter_layer(kv: LayerKV, slots: torch.Tensor, parts: Sequence[torch.Tensor]) -> None:
    """Write gathered parts (gather_layer's order) into one layer's pages at these flat slots."""
    for t, part in zip(kv, parts):
        t.view(-1, *t.shape[2:]).index_copy_(0, slots, part.to(t.device, t.dtype))


def copy_arrived(channel: KVChannel, caches: Sequence[LayerKV], slots: torch.Tensor,
                 loaded: list[int], num_tokens: int, layers: Sequence[int], stats: TransferStats) -> int:
    """Copy what has arrived of these layers (tokens past loaded[i], up to num_tokens) from a
    channel into paged caches at the transfer's slots; advance `loaded`, add to the stats' bytes
    and load time; return the bytes copied."""
    t0 = time.perf_counter()
    nbytes = 0
    for i in layers:
        lo, hi = loaded[i], min(channel.ready(i), num_tokens)
        if hi <= lo:
            continue
        parts = channel.read(i, lo, hi)
        scatter_layer(caches[i], slots[lo:hi], parts)
        nbytes += sum(p.numel() * p.element_size() for p in parts)
        loaded[i] = hi
    if nbytes:
        stats.bytes += nbytes
        stats.load_s += time.perf_counter() - t0
    return nbytes


def new_transfer_id() -> str:
    """A unique id for one transfer (also names its shared-memory file)."""
    return f"{os.getpid()}-{uuid.uuid4().hex[:16]}"


# ---------------------------------------------------------------------- channels
class KVChannel:
    """One transfer's buffer: per-layer KV parts of m tokens and per-layer ready counters."""

    def __init__(self, layout: KVLayout, num_tokens: int, header: torch.Tensor, data: list[torch.Tensor]) -> None:
        self.layout = layout
        self.num_tokens = num_tokens
        self.header = header  # int64 [num_layers + _HEADER_SLOTS]
        self.data = data  # per part of layout.parts(): [num_layers, m, *shape]

    @staticmethod
    def nbytes(layout: KVLayout, num_tokens: int) -> tuple[int, int]:
        """(header bytes, total bytes) of a channel."""
        header = 8 * (layout.num_layers + _HEADER_SLOTS)
        return header, header + num_tokens * layout.bytes_per_token()

    def ready(self, layer: int) -> int:
        """Tokens of this layer that have arrived (a prefix [0, ready))."""
        return int(self.header[layer])

    @property
    def status(self) -> int:
        """STATUS_OPEN, STATUS_DONE, STATUS_FAILED or STATUS_CANCELLED."""
        return int(self.header[self.layout.num_layers])

    @property
    def all_written(self) -> bool:
        """Every layer holds all m tokens."""
        n = self.layout.num_layers
        return bool((self.header[:n] >= self.num_tokens).all())

    def read(self, layer: int, start: int, end: int) -> list[torch.Tensor]:
        """Tokens [start, end) of one layer, one tensor per part."""
        return [d[layer, start:end] for d in self.data]

    def write(self, layer: int, start: int, parts: Sequence[torch.Tensor]) -> None:
        """Sender: store tokens [start, start + n) of one layer (gather_layer's parts), then publish them."""
        end = start + parts[0].shape[0]
        for d, part in zip(self.data, parts):
            d[layer, start:end].copy_(part)
        # Data first, counter second: a reader that sees the counter sees the data (x86 keeps
        # store order; the counter is one aligned 8-byte store).
        if end > self.ready(layer):
            self.header[layer] = end

    def set_status(self, status: int) -> None:
        """Sender: mark the transfer done or failed."""
        if status == STATUS_DONE:
            self.header[self.layout.num_layers + 2] = time.time_ns()
        self.header[self.layout.num_layers] = status

    @property
    def written_at(self) -> float:
        """Wall-clock time the sender finished (0 while open)."""
        return int(self.header[self.layout.num_layers + 2]) / 1e9

    def close(self) -> None:
        """Release the buffer."""


class ShmKVChannel(KVChannel):
    """A channel in a /dev/shm file: the decode worker creates it, the prefill worker maps it."""

    def __init__(self, desc: TransferDescriptor, create: bool) -> None:
        layout, m = desc.layout, desc.num_tokens
        head_bytes, total = self.nbytes(layout, m)
        self.path = desc.shm_path
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(self.path, flags, 0o600)
        except OSError as exc:
            raise KVTransferError(f"cannot open KV channel {self.path}: {exc}") from exc
        try:
            if create:
                os.ftruncate(fd, total)  # a sparse file of zeros: status OPEN, nothing ready
            self._mm = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        header = torch.frombuffer(self._mm, dtype=torch.int64, count=layout.num_layers + _HEADER_SLOTS)
        data, offset = [], head_bytes
        for shape, dt in layout.parts():  # each part one region: [num_layers, m, *shape]
            count = layout.num_layers * m * math.prod(shape)
            part = torch.frombuffer(self._mm, dtype=dt, offset=offset, count=count) if count else torch.empty(0, dtype=dt)
            data.append(part.view(layout.num_layers, m, *shape))
            offset += count * part.element_size()
        super().__init__(layout, m, header, data)
        self.owner = create

    def close(self) -> None:
        """Unmap (tensors viewing the map must be gone) and, for the creator, delete the file."""
        self.header = self.data = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):  # a view still alive somewhere: the map goes with it
            self._mm.close()
        if self.owner:
            unlink_quietly(self.path)


def unlink_quietly(path: str) -> None:
    """Delete a channel file that may already be gone."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class LocalKVChannel(KVChannel):
    """A channel in the decode worker's own memory, filled by Ray calls from another host."""

    def __init__(self, desc: TransferDescriptor) -> None:
        layout, m = desc.layout, desc.num_tokens
        header = torch.zeros(layout.num_layers + _HEADER_SLOTS, dtype=torch.int64)
        data = [torch.empty(layout.num_layers, m, *shape, dtype=dt) for shape, dt in layout.parts()]
        super().__init__(layout, m, header, data)
        self._ranges: list[list[tuple[int, int]]] = [[] for _ in range(layout.num_layers)]
        self._lock = threading.Lock()

    def receive(self, layer: int, start: int, parts: Sequence[torch.Tensor]) -> None:
        """Store one (layer, token range) that may arrive out of order; advance to the first gap.

        Runs on one of Ray's threads, which live on: it copies with numpy, single-threaded. A
        torch copy this large starts a parallel region, which gives that thread an OpenMP team
        of its own for good, and a second team makes every parallel region of the engine thread
        wake a sleeping worker (specserve.server.async_engine; here a 256x256 matmul on another
        thread took 272 us after a torch copy on a live thread, 200 us after a numpy one)."""
        end = start + parts[0].shape[0]
        for d, part in zip(self.data, parts):
            np.copyto(d[layer, start:end].view(torch.uint8).numpy(), part.contiguous().view(torch.uint8).numpy())
        with self._lock:
            ranges = self._ranges[layer]
            ranges.append((start, end))
            ranges.sort()
            upto = self.ready(layer)
            keep = []
            for s, e in ranges:
                if s <= upto:
                    upto = max(upto, e)
                else:
                    keep.append((s, e))
            self._ranges[layer] = keep
            self.header[layer] = upto


# ---------------------------------------------------------------------- sinks (prefill side)
class ShmSink:
    """Sender into a shared-memory channel."""

    def __init__(self, desc: TransferDescriptor) -> None:
        self.channel = ShmKVChannel(desc, create=False)

    def write(self, layer: int, start: int, parts: Sequence[torch.Tensor]) -> None:
        """Publish one layer's tokens."""
        self.channel.write(layer, start, parts)

    @property
    def cancelled(self) -> bool:
        """The receiver no longer wants the rest."""
        return self.channel.status == STATUS_CANCELLED

    def finish(self, ok: bool = True) -> None:
        """Mark the transfer done (or failed) and unmap."""
        self.channel.set_status(STATUS_DONE if ok else STATUS_FAILED)
        self.channel.close()


class RaySink:
    """Sender through Ray: one actor call per (layer, token range) to the decode worker."""

    def __init__(self, desc: TransferDescriptor, timeout_s: float = 60.0) -> None:
        self.desc = desc
        self.timeout_s = timeout_s
        self._refs: list[Any] = []

    @property
    def cancelled(self) -> bool:
        """The receiver no longer wants the rest (asked by an actor call: its channel is in
        another process; a receiver that cannot answer wants nothing more either)."""
        import ray

        try:
            return not ray.get(self.desc.receiver.wants_kv.remote(self.desc.transfer_id), timeout=self.timeout_s)
        except Exception:  # noqa: BLE001 - dead or hung receiver
            return True

    def write(self, layer: int, start: int, parts: Sequence[torch.Tensor]) -> None:
        """Send one layer's tokens without waiting (the object store moves the bytes)."""
        self._refs.append(self.desc.receiver.receive_kv.remote(self.desc.transfer_id, layer, start, list(parts)))

    def finish(self, ok: bool = True) -> None:
        """Wait until every piece has landed, then mark the transfer done (or failed)."""
        import ray

        try:
            if ok and self._refs:
                ray.get(self._refs, timeout=self.timeout_s)
        finally:
            self._refs = []
            ray.get(self.desc.receiver.finish_kv.remote(self.desc.transfer_id, ok), timeout=self.timeout_s)


def open_sink(desc: TransferDescriptor) -> ShmSink | RaySink:
    """The prefill side of a transfer."""
    return ShmSink(desc) if desc.transport == "shm" else RaySink(desc)


def open_receiver(desc: TransferDescriptor) -> KVChannel:
    """The decode side of a transfer (created before the prefill starts)."""
    return ShmKVChannel(desc, create=True) if desc.transport == "shm" else LocalKVChannel(desc)


def _with_draft(desc: TransferDescriptor) -> list[TransferDescriptor]:
    return [desc] if desc.draft is None else [desc, desc.draft]


class ChannelFiles:
    """The router's record of the shared-memory channel files it named, so that none outlives it.

    A decode worker creates each file and normally deletes it after its first step, but a worker
    killed first never does. Once a transfer's prefill has ended both workers have the file
    mapped (or never will), so its name is no longer needed: the router deletes it then, when a
    worker of the transfer dies, and at shutdown. Deleting a mapped file leaves the mapping intact.
    """

    def __init__(self) -> None:
        self._open: dict[str, tuple[str, str]] = {}  # path -> (prefill worker, decode worker)

    def __len__(self) -> int:
        return len(self._open)

    def track(self, desc: TransferDescriptor, prefill_worker: str, decode_worker: str) -> None:
        """Note a transfer (and its draft's) before either worker opens its channel (no-op for
        the Ray transport)."""
        for d in _with_draft(desc):
            if d.transport == "shm":
                self._open[d.shm_path] = (prefill_worker, decode_worker)

    def release(self, desc: TransferDescriptor) -> None:
        """The transfer's prefill has ended: delete its file (and its draft's)."""
        for d in _with_draft(desc):
            if self._open.pop(d.shm_path, None) is not None:
                unlink_quietly(d.shm_path)

    def release_worker(self, name: str) -> None:
        """A worker died: delete the files of every transfer it took part in."""
        for path, workers in list(self._open.items()):
            if name in workers:
                del self._open[path]
                unlink_quietly(path)

    def release_all(self) -> None:
        """Shutdown: delete every file still named."""
        for path in self._open:
            unlink_quietly(path)
        self._open.clear()


@dataclass
class TransferStats:
    """What one transfer cost, for metrics and the benchmark."""

    transfer_id: str
    num_tokens: int = 0
    bytes: int = 0
    send_s: float = 0.0  # prefill side: gathering pages and writing them to the channel
    load_s: float = 0.0  # decode side: copying from the channel into the paged cache
    loaded_before_done: int = 0  # bytes loaded on the decode side before the sender finished
    exposed_s: float = 0.0  # sender finished -> KV complete in the decode cache
    ok: bool = True
    # The draft's prompt KV (TransferDescriptor.draft). Prefill side: its bytes, and the draft's
    # forward plus sending. Decode side (a record of its own: bytes, load_s, ok): the seconds
    # from the request's first step to the draft's KV complete (it decodes without drafts meanwhile).
    draft_bytes: int = 0
    draft_compute_s: float = 0.0
    draft_after_s: float | None = None
    outcome: str = ""  # a draft transfer's end on the decode side (DecodeConnector._retire_draft)
    waited_in_step_s: float = 0.0  # layer_start "first": the first step's waits for later layers
    admitted_at: float = 0.0  # wall clock the request was admitted (its first step began)
    sender_done_at: float = 0.0  # wall clock the sender finished (0: not seen)

    @property
    def overlap(self) -> float:
        """Fraction of the decode-side load that ran while the prefill was still computing."""
        return self.loaded_before_done / self.bytes if self.bytes else 1.0


# ---------------------------------------------------------------------- prefill connector
@dataclass
class _Outgoing:
    request: Request
    desc: TransferDescriptor
    sink: ShmSink | RaySink
    sent: int = 0  # tokens [0, sent) written for every layer
    stats: TransferStats = field(default_factory=lambda: TransferStats(""))
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    target_done: bool = False
    draft_sink: ShmSink | RaySink | None = None  # open while the draft's prompt KV is being sent
    draft_sent: int = 0

    @property
    def num_tokens(self) -> int:
        """m: the tokens whose KV travels."""
        return self.desc.num_tokens


class PrefillConnector:
    """Streams each layer's new KV of the requests being prefilled into their channels.

    With a drafter on this worker (`drafter`: a draft model, an EAGLE or MTP head) and a draft
    channel in the descriptor, the drafter's prompt KV follows: once the target's is all sent (its
    channel marked done) and the step's outputs are in (a feature drafter has the target's
    features of the last chunk then), the drafter runs over the prompt (batched passes of the
    step's token budget, no logits) and all its layers are sent, so the decode worker's first step
    never waits for the drafter."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.block_size = engine.runner.block_size
        self.outgoing: dict[str, _Outgoing] = {}
        self._step: list[tuple[_Outgoing, int, torch.Tensor]] = []  # (transfer, start, slots)
        self._drafting: list[_Outgoing] = []  # transfers whose drafter KV this step's end sends

    @property
    def drafter(self) -> Any:
        """This worker's drafter, if it can compute prompt KV for decode workers' drafters."""
        return travelling_drafter(self.engine)

    def add(self, request: Request, desc: TransferDescriptor) -> _Outgoing:
        """Register a request whose prompt KV must go to a decode worker."""
        out = _Outgoing(request, desc, open_sink(desc), stats=TransferStats(desc.transfer_id, desc.num_tokens))
        if desc.draft is not None:
            try:
                sink = open_sink(desc.draft)
            except KVTransferError:  # the decode worker dropped its draft channel: nothing to send
                sink = None
            if sink is not None and self.drafter is None:
                sink.finish(ok=False)  # no draft here: the decode worker's draft catches up itself
            elif sink is not None:
                out.draft_sink = sink
        self.outgoing[request.request_id] = out
        return out

    def _send(self, t: _Outgoing, layer: int, kv: LayerKV, start: int, slots: torch.Tensor) -> None:
        t0 = time.perf_counter()
        parts = gather_layer(kv, slots)
        t.sink.write(layer, start, parts)
        t.stats.send_s += time.perf_counter() - t0
        t.stats.bytes += sum(p.numel() * p.element_size() for p in parts)

    def begin_step(self, out: SchedulerOutput) -> bool:
        """Pick this step's requests with a transfer; send prefix-cache hits up front. True when
        this step's layers must be streamed out."""
        self._step = []
        for sr in out.scheduled:
            t = self.outgoing.get(sr.request_id)
            if t is None:
                continue
            if t.sent < sr.start_pos:  # found in this worker's prefix cache: already in pages
                slots = slot_indices(sr.block_ids, t.sent, sr.start_pos, self.block_size)
                for layer, kv in enumerate(self.engine.runner.kv_caches):
                    self._send(t, layer, kv, t.sent, slots)
                t.sent = sr.start_pos
            end = min(sr.start_pos + len(sr.token_ids), t.desc.num_tokens)
            if end > sr.start_pos:
                self._step.append((t, sr.start_pos, slot_indices(sr.block_ids, sr.start_pos, end, self.block_size)))
        return bool(self._step)

    def before_layer(self, index: int, kv_cache: LayerKV) -> None:
        """Nothing to load on the prefill side."""

    def after_layer(self, index: int, kv_cache: LayerKV) -> None:
        """This layer's KV of the step's tokens is written: send it now."""
        for t, start, slots in self._step:
            self._send(t, index, kv_cache, start, slots)

    def end_step(self, out: SchedulerOutput) -> None:
        """Advance each transfer; close those that have sent all m tokens (their drafter's KV
        follows in `after_update`)."""
        for t, start, slots in self._step:
            t.sent = start + len(slots)
            if t.sent >= t.num_tokens:
                self._finish_target(t, ok=True)
        self._drafting = [t for t, _, _ in self._step if t.draft_sink is not None and t.target_done]
        self._step = []

    def after_update(self) -> None:
        """The step's outputs are in (the target's features observed): send the drafter's KV of
        the transfers whose target KV this step completed.

        The drafter's prompt runs once the target's KV is all sent, not beside each chunk: the
        request's first token waits for nothing of the drafter (measured with SmolLM2 and its
        first 8 layers as the draft, 2.1k-token prompts: the draft after every chunk added its
        1.4 s to the time to first token). The decode worker decodes without drafts until it lands."""
        drafting, self._drafting = self._drafting, []
        chunk = max(1, self.engine.config.scheduler.max_num_batched_tokens)  # the step's token budget
        while drafting := [t for t in drafting if self._still_drafting(t)]:
            self._send_draft([(t, min(t.num_tokens, t.draft_sent + chunk)) for t in drafting])

    def _still_drafting(self, t: _Outgoing) -> bool:
        """The transfer's draft KV is still being sent and wanted (a receiver that cancelled, its
        request having ended, closes it here)."""
        if t.draft_sink is not None and t.draft_sink.cancelled:
            self._finish_draft(t, ok=False)
        return t.draft_sink is not None

    def _send_draft(self, todo: list[tuple[_Outgoing, int]]) -> None:
        """Run the draft over each transfer's prompt up to a token and send every layer of it."""
        drafter = self.drafter
        t0 = time.perf_counter()
        feeds = [PromptFeed(t.request, upto, t.desc.draft.next_token if t.desc.draft is not None else None)
                 for t, upto in todo]
        have = drafter.feed_prompts(feeds) if drafter is not None else {}
        caches = drafter.prompt_kv_caches() if drafter is not None else []
        transfers = [t for t, _ in todo]
        for t in transfers:
            n = have.get(t.request.request_id)
            if n is None:  # no draft, or no room in its pool: the decode worker's draft catches up
                self._finish_draft(t, ok=False)
                continue
            progressed = n > t.draft_sent
            if progressed:
                slots = drafter.prompt_kv_slots(t.request.request_id, t.draft_sent, n)
                for layer, kv in enumerate(caches):
                    parts = gather_layer(kv, slots)
                    t.draft_sink.write(layer, t.draft_sent, parts)  # type: ignore[union-attr]
                    t.stats.draft_bytes += sum(p.numel() * p.element_size() for p in parts)
                t.draft_sent = n
            if t.draft_sent >= t.num_tokens:
                self._finish_draft(t, ok=True)
            elif not progressed:  # no progress (cannot happen with room): do not spin
                self._finish_draft(t, ok=False)
        if transfers:
            share = (time.perf_counter() - t0) / len(transfers)
            for t in transfers:
                t.stats.draft_compute_s += share

    def _finish_target(self, t: _Outgoing, ok: bool, error: str | None = None) -> None:
        if not t.target_done:
            t.target_done = True
            try:
                t.sink.finish(ok)
            except Exception as exc:  # noqa: BLE001 - report it to the router through the event
                ok, error = False, f"{type(exc).__name__}: {exc}"
            t.stats.ok = ok
            t.error = error
        self._settle(t)

    def _finish_draft(self, t: _Outgoing, ok: bool) -> None:
        sink, t.draft_sink = t.draft_sink, None
        if sink is not None:
            with contextlib.suppress(Exception):  # the draft's KV is an optimisation: never fail the request
                sink.finish(ok)
        self._settle(t)

    def _settle(self, t: _Outgoing) -> None:
        """Report the transfer done once the target's KV and the draft's (if any) are sent."""
        if t.target_done and t.draft_sink is None:
            t.done.set()

    def _close(self, t: _Outgoing, ok: bool, error: str | None = None) -> None:
        if t.done.is_set():
            return
        self._finish_target(t, ok, error)
        self._finish_draft(t, ok=False)

    def pump(self) -> None:
        """Nothing to do between steps on the prefill side."""

    def request_finished(self, request: Request) -> None:
        """A prefill request ended; if it ended before sending everything, fail its transfer."""
        t = self.outgoing.pop(request.request_id, None)
        if t is not None and not t.done.is_set():
            self._close(t, ok=False, error=request.error or f"prefill ended early ({request.status.name})")


# ---------------------------------------------------------------------- decode connector
@dataclass
class _Incoming:
    request: Request
    desc: TransferDescriptor
    channel: KVChannel
    num_tokens: int  # m
    block_size: int  # the decode engine's
    last_progress: float = field(default_factory=time.monotonic)
    flowing: bool = False  # KV has arrived (before: the prefill may still be queued)
    loaded: list[int] = field(default_factory=list)  # per layer: tokens already in our pages
    slots: torch.Tensor | None = None  # cache slots of tokens [0, m), fixed once placed
    failed: str | None = None
    stats: TransferStats = field(default_factory=lambda: TransferStats(""))
    layer_start: str = "all"  # DecodeConnector.layer_start

    @property
    def reserved(self) -> bool:
        """The scheduler has placed the blocks for [0, m)."""
        return self.slots is not None

    def place(self, num_cached: int, block_ids: list[int]) -> None:
        """The scheduler's blocks for [0, m): the first num_cached tokens are prefix-cache hits."""
        self.loaded = [num_cached] * len(self.loaded)  # those tokens are in our pages already
        self.slots = slot_indices(block_ids, 0, self.num_tokens, self.block_size)

    def admissible(self) -> bool:
        """The first step can run: every layer has arrived (it copies, never waits), or with
        layer_start "first" layer 0 has (later layers are waited for inside the step)."""
        if not self.reserved or self.failed is not None:
            return False
        if self.layer_start == "first":
            return self.channel.ready(0) >= self.num_tokens
        return self.channel.all_written


@dataclass
class _DraftIncoming:
    """The draft's prompt KV of one request on its way from the prefill worker."""

    request: Request
    desc: TransferDescriptor
    channel: KVChannel
    stats: TransferStats
    last_progress: float = field(default_factory=time.monotonic)
    flowing: bool = False  # draft KV has arrived (before: the prefill may still be queued)
    loaded: list[int] = field(default_factory=list)  # per draft layer: tokens in the draft's pages
    slots: torch.Tensor | None = None  # the draft cache's slots of tokens [0, m), once placed
    target_ready_at: float | None = None  # when the target's KV was complete (monotonic)

    @property
    def num_tokens(self) -> int:
        """m: the tokens whose draft KV travels."""
        return self.desc.num_tokens


class DecodeConnector:
    """Receives prompt KV for requests that a prefill worker computed (and their draft's).

    The draft's KV is not waited for: the request is admitted once the target's layers are in and
    decodes without drafts until the draft's have arrived too (`pump` copies them into the blocks
    the draft holds for them); a draft transfer that fails or stalls is dropped and the draft
    catches the request up itself."""

    def __init__(self, engine: Any, timeout_s: float = 60.0, layer_start: str = "all") -> None:
        if layer_start not in LAYER_STARTS:
            raise ValueError(f"unknown KV layer start {layer_start!r}; use {' or '.join(LAYER_STARTS)}")
        self.engine = engine
        self.block_size = engine.runner.block_size
        self.timeout_s = timeout_s
        # "all": a request's first step runs once every layer of its prompt KV is here. "first": once
        # layer 0 is, each later layer waited for just before it runs, so the step overlaps the
        # last layers' arrival; but the whole batch's step then waits on the prefill worker's pace
        # (see docs/disaggregation.md, "Layer-0 start").
        self.layer_start = layer_start
        self.incoming: dict[str, _Incoming] = {}
        self._step: list[_Incoming] = []
        self.finished_stats: list[TransferStats] = []  # drained by the worker for metrics
        self.finished_draft_stats: list[TransferStats] = []  # the drafts' transfers, likewise
        # Receiving channels by transfer id, registered as soon as a transfer is announced (before
        # the engine thread queues its request) so Ray pieces can land at once; removed on retire.
        self.channels: dict[str, KVChannel] = {}
        self._lock = threading.Lock()  # receive_kv (Ray threads) vs the engine thread
        self.drafts: dict[str, _DraftIncoming] = {}

    @property
    def drafter(self) -> Any:
        """The engine's draft model, if it takes prompt KV from a prefill worker."""
        return travelling_drafter(self.engine)

    # -- set-up (engine thread)
    def add(self, request: Request, desc: TransferDescriptor, channel: KVChannel,
            draft_channel: KVChannel | None = None) -> None:
        """Attach an incoming transfer (and its draft's, if a channel was opened) to a request
        about to be queued."""
        inc = _Incoming(request, desc, channel, desc.num_tokens, self.block_size,
                        stats=TransferStats(desc.transfer_id, desc.num_tokens), layer_start=self.layer_start)
        inc.loaded = [0] * desc.layout.num_layers
        request.kv_source = inc
        self.incoming[request.request_id] = inc
        if draft_channel is not None and desc.draft is not None:
            d = _DraftIncoming(request, desc.draft, draft_channel, TransferStats(desc.draft.transfer_id, desc.num_tokens))
            d.loaded = [0] * desc.draft.layout.num_layers
            self.drafts[request.request_id] = d

    # -- between steps
    def pump(self) -> None:
        """Copy in whatever layers have arrived, for transfers whose blocks the scheduler has
        placed (`Scheduler.reserve_incoming`, run just before); fail transfers that stalled."""
        now = time.monotonic()
        for rid, inc in list(self.incoming.items()):
            if inc.failed is not None:
                continue
            if inc.channel.status == STATUS_FAILED:
                self._fail(rid, inc, "the prefill worker reported a failed transfer")
                continue
            if not inc.reserved:  # no room yet; the KV waits in the channel (no stall of the sender's)
                inc.last_progress = now
                continue
            if self._load(inc, None) or inc.channel.all_written:
                inc.last_progress, inc.flowing = now, True
            elif now - inc.last_progress > (patience := self._patience(inc.flowing, inc.desc)):
                self._fail(rid, inc, f"no KV arrived for {patience:.0f} s")
        for rid, d in list(self.drafts.items()):
            self._pump_draft(rid, d, now)

    def _patience(self, flowing: bool, desc: TransferDescriptor) -> float:
        """Seconds without progress before a transfer is given up: --transfer-timeout once its KV
        flows, before that its prefill's budget (it may still be queued)."""
        return self.timeout_s if flowing else prefill_budget_s(self.timeout_s, desc)

    def _pump_draft(self, rid: str, d: _DraftIncoming, now: float) -> None:
        """Place, copy in and hand over one request's draft KV; drop it when it cannot come."""
        drafter = self.drafter
        if drafter is None or d.channel.status == STATUS_FAILED:
            return self._retire_draft(rid, "failed" if drafter is not None else "no draft")
        if d.slots is None:
            if rid in self.incoming and not self.incoming[rid].reserved:
                return None  # the target's blocks first: the request may still be refused room
            num_cached = drafter.expect_prompt_kv(d.request, d.num_tokens)
            if num_cached is None:
                return self._retire_draft(rid, "no room")
            d.loaded = [num_cached] * len(d.loaded)
            d.slots = drafter.prompt_kv_slots(rid, 0, d.num_tokens)
            d.last_progress = now
        elif not drafter.prompt_kv_pending(rid):  # preempted or finished meanwhile
            return self._retire_draft(rid, "request ended")
        if d.target_ready_at is None and rid not in self.incoming:
            d.target_ready_at = now  # the target's KV is in and its first step has run
        caches = drafter.prompt_kv_caches()
        moved = copy_arrived(d.channel, caches, d.slots, d.loaded, d.num_tokens, range(len(caches)), d.stats) > 0
        if all(n >= d.num_tokens for n in d.loaded):
            d.stats.draft_after_s = max(0.0, now - d.target_ready_at) if d.target_ready_at is not None else 0.0
            drafter.prompt_kv_arrived(rid)
            return self._retire_draft(rid, "arrived")
        if moved:
            d.last_progress, d.flowing = now, True
        elif now - d.last_progress > self._patience(d.flowing, d.desc):
            self._retire_draft(rid, "stalled")
        return None

    def _retire_draft(self, rid: str, outcome: str) -> None:
        """End a draft transfer: "arrived", or dropped ("request ended", "failed", "stalled",
        "no room", "no draft"). A dropped one frees the blocks held for it and tells the sender
        to stop (STATUS_CANCELLED: a shared-memory sender checks it between draft passes)."""
        d = self.drafts.pop(rid, None)
        if d is None:
            return
        if outcome != "arrived":
            if self.drafter is not None:
                self.drafter.drop_prompt_kv(rid)
            if d.channel.header is not None and d.channel.status == STATUS_OPEN:
                d.channel.header[d.desc.layout.num_layers] = STATUS_CANCELLED
        d.stats.ok = outcome == "arrived"
        d.stats.outcome = outcome
        self.channels.pop(d.desc.transfer_id, None)
        d.channel.close()
        with self._lock:
            self.finished_draft_stats.append(d.stats)

    def _load(self, inc: _Incoming, layer: int | None) -> bool:
        """Copy arrived tokens of one layer (or all layers) into the request's pages."""
        ch = inc.channel
        caches = self.engine.runner.kv_caches
        before_done = ch.status != STATUS_DONE
        nbytes = copy_arrived(ch, caches, inc.slots, inc.loaded, inc.num_tokens,  # type: ignore[arg-type]
                              range(len(caches)) if layer is None else (layer,), inc.stats)
        if before_done:
            inc.stats.loaded_before_done += nbytes
        if all(n >= inc.num_tokens for n in inc.loaded) and ch.status == STATUS_DONE and not inc.stats.exposed_s:
            inc.stats.exposed_s = max(0.0, time.time() - ch.written_at)
        return nbytes > 0

    def _fail(self, rid: str, inc: _Incoming, why: str) -> None:
        # The router sees the error and re-prefills the request on a healthy pair of workers.
        inc.failed = why
        inc.stats.ok = False
        self.engine.fail_requests([rid], f"{KVTransferError.__name__}: {why}")

    # -- the first step
    def begin_step(self, out: SchedulerOutput) -> bool:
        """Note this step's new arrivals; True if any still has KV to copy in (this step's layers
        then load it just before they run; usually `pump` has copied everything already)."""
        self._step = []
        for sr in out.scheduled:
            inc = self.incoming.get(sr.request_id)
            if inc is not None and inc.request.kv_source is inc:
                inc.stats.admitted_at = time.time()
                self._step.append(inc)
        return any(n < inc.num_tokens for inc in self._step for n in inc.loaded)

    def before_layer(self, index: int, kv_cache: LayerKV) -> None:
        """Copy this layer's remaining KV of the step's new arrivals just before it is read
        (with layer_start "first", waiting for it to arrive; a transfer that fails or stalls
        meanwhile fails the step)."""
        for inc in self._step:
            self._load(inc, index)
            if inc.loaded[index] >= inc.num_tokens:
                continue
            t0 = time.perf_counter()
            while inc.loaded[index] < inc.num_tokens:
                if inc.channel.status == STATUS_FAILED:
                    raise KVTransferError("the prefill worker reported a failed transfer")
                if time.perf_counter() - t0 > self.timeout_s:
                    raise KVTransferError(f"layer {index} of the prompt KV did not arrive in {self.timeout_s:.0f} s")
                time.sleep(0.0002)
                self._load(inc, index)
            inc.stats.waited_in_step_s += time.perf_counter() - t0

    def after_layer(self, index: int, kv_cache: LayerKV) -> None:
        """Nothing to send on the decode side."""

    def after_update(self) -> None:
        """Nothing to send on the decode side."""

    def end_step(self, out: SchedulerOutput) -> None:
        """The arrivals' KV is complete in our pages: close their channels."""
        for inc in self._step:
            self._retire(inc.request.request_id)
        self._step = []

    def _retire(self, rid: str) -> None:
        inc = self.incoming.pop(rid, None)
        if inc is None:
            return
        inc.request.kv_source = None
        if inc.channel.header is not None and inc.channel.status == STATUS_DONE:
            inc.stats.sender_done_at = inc.channel.written_at
        self.channels.pop(inc.desc.transfer_id, None)
        inc.channel.close()
        with self._lock:
            self.finished_stats.append(inc.stats)

    def request_finished(self, request: Request) -> None:
        """Aborted or failed before its first step: drop the channel (its blocks go with the
        request); a draft transfer still open goes too."""
        self._retire(request.request_id)
        self._retire_draft(request.request_id, "request ended")

    def take_stats(self) -> list[TransferStats]:
        """Transfers completed since the last call."""
        with self._lock:
            out, self.finished_stats = self.finished_stats, []
        return out

    def take_draft_stats(self) -> list[TransferStats]:
        """Draft transfers completed (ok) or dropped since the last call."""
        with self._lock:
            out, self.finished_draft_stats = self.finished_draft_stats, []
        return out


def runner_kv_layout(runner: Any) -> KVLayout:
    """The KV layout of a model runner's paged cache."""
    arch = runner.arch
    return KVLayout(arch.num_layers, arch.num_kv_heads, arch.head_dim, str(runner.dtype).replace("torch.", ""),
                    runner.kv_cache_dtype)


def kv_layout_of(engine: Any) -> KVLayout:
    """The KV layout of an engine's target model."""
    return runner_kv_layout(engine.runner)


def travelling_drafter(engine: Any) -> Any:
    """The engine's proposer if its prompt KV can travel between workers (a `PromptKVTraveller`:
    a draft model, an EAGLE or MTP head), else None."""
    proposer = engine.proposer
    return proposer.prompt_kv_traveller() if proposer is not None else None


def draft_kv_layout_of(engine: Any) -> KVLayout | None:
    """The KV layout of an engine's draft model, if its prompt KV can travel between workers."""
    drafter = travelling_drafter(engine)
    return KVLayout(**drafter.prompt_kv_shape()) if drafter is not None else None

