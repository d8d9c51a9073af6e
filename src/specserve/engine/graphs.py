"""CUDA graphs of the runner's short steps: decode, verify and small chunks replayed in one launch.

On a GPU a step of a small model is a long train of small kernels, each launched from Python:
a SmolLM2 batch-1 step launched ~1,500 of them and kept an H200 busy 6% of its time
(bench/results/device_check_cuda_h200.json). A CUDA graph records a step's kernels once and
replays them with one launch. A graph replays fixed shapes at fixed addresses, so a step is
padded into a bucket before it runs:

- its B requests up to the next of BATCH_BUCKETS, each request's query rows up to the next of
  QUERY_BUCKETS (Q = 1 for decode, 1 + K for a chain's verify, 1 + nodes for a tree's), its
  longest context up to a power of two (at least MIN_KV keys);
- a padded query row writes its K/V into a scratch slot outside the block pool (the runner
  allocates one block for it) and attends to key 0 only; a padded key is masked out, and a
  padded request's block table points at block 0, which it only reads. The real rows compute
  what the eager step computes over the same keys.

Each step copies its inputs into the bucket's static buffers (a few small copies), replays, and
takes the real rows out of the static outputs before the next replay overwrites them. The LM
head runs after the graph, on the rows that need logits only. Steps with longer query runs
(prompt chunks past 64 tokens), steps whose padding would outweigh their tokens (a chunk beside
many decodes), layer hooks (a disaggregation connector) and layer-wise loads run eagerly.

`capture=False` runs the same padded step without a graph: how the CPU tests check the padding.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from specserve.attention import AttentionMetadata

logger = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# A decode, a verify of 1 + K chain tokens or 1 + nodes of a tree (16 by default), a lookahead
# window with its candidates, short prompt chunks.
QUERY_BUCKETS = (1, 2, 4, 8, 12, 16, 20, 24, 32, 48, 64)
MIN_KV = 256


class GraphKey(NamedTuple):
    """One captured step shape."""

    batch: int  # requests, padded
    query: int  # query rows per request, padded
    kv_len: int  # keys each request attends over, padded
    features: tuple[int, ...]  # residual streams the forward keeps (EAGLE-3 fusion)


@dataclass
class _Graph:
    """A bucket's static inputs, its graph (None when not captured) and its static outputs."""

    input_ids: torch.Tensor  # [B * Q]
    positions: torch.Tensor  # [B * Q]
    meta: AttentionMetadata  # static slot mapping, block tables and mask
    graph: torch.cuda.CUDAGraph | None = None
    hidden: torch.Tensor | None = None  # [B * Q, hidden]
    captured: list[torch.Tensor] = field(default_factory=list)  # [B * Q, hidden] each


def _bucket(buckets: tuple[int, ...], n: int) -> int | None:
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


class StepGraphs:
    """The runner's step graphs by bucket, captured on first use (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, block_size: int, scratch_slot: int,
                 device: torch.device, capture: bool = True) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch_slot = scratch_slot
        self.device = device
        self.capture = capture
        self.pool = torch.cuda.graph_pool_handle() if capture else None  # one memory pool for every graph
        self._graphs: dict[GraphKey, _Graph] = {}
        self._failed: set[GraphKey] = set()
        self.num_replays = 0
        # The last step built its bucket (warm-up runs and the capture: tens to hundreds of ms on
        # a GPU). Its time says nothing about what the shape costs from then on.
        self.built_in_step = False
        self.replayed_in_step = False  # the last step ran through a bucket (else eagerly)

    @property
    def num_graphs(self) -> int:
        """Buckets captured so far."""
        return len(self._graphs)

    def key(self, meta: AttentionMetadata) -> GraphKey | None:
        """The bucket of a step, or None when it runs eagerly."""
        inner = self.model.model
        if inner.layer_hooks is not None or inner.layer_wait is not None:
            return None
        batch = _bucket(BATCH_BUCKETS, meta.num_seqs)
        query = _bucket(QUERY_BUCKETS, meta.max_query_len)
        # Every request pads to the longest run: a prompt chunk beside many decodes would make the
        # graph compute mostly padding, where the eager step computes only the real rows.
        if batch is None or query is None or batch * query > 4 * meta.num_tokens + 64:
            return None
        kv_len = max(MIN_KV, 1 << (meta.max_kv_len - 1).bit_length())
        kv_len = -(-kv_len // self.block_size) * self.block_size
        key = GraphKey(batch, query, kv_len, tuple(inner.capture_layers))
        return None if key in self._failed else key

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor | None:  # [num_tokens, hidden] or None
        """The model's hidden states of the step's tokens (and its kept streams in
        `model.model.captured`) through the step's graph; None when the step runs eagerly."""
        self.built_in_step = False
        self.replayed_in_step = False
        key = self.key(meta)
        if key is None:
            return None
        g = self._graphs.get(key)
        if g is None:
            self.built_in_step = True
            g = self._build(key)
            if g is None:
                return None
        rows = self._fill(g, key, input_ids, positions, meta)
        if g.graph is not None:
            g.graph.replay()
        else:
            g.hidden, g.captured = self._body(g)
        self.num_replays += 1
        self.replayed_in_step = True
        assert g.hidden is not None
        self.model.model.captured = [c.index_select(0, rows) for c in g.captured]
        return g.hidden.index_select(0, rows)

    # ------------------------------------------------------------------ internals
    def _static(self, key: GraphKey) -> _Graph:
        """A bucket's buffers, every row padding: no step's real KV is touched by a warm-up or capture."""
        n = key.batch * key.query
        dev = self.device
        mask = torch.zeros(key.batch, 1, key.query, key.kv_len, dtype=torch.bool, device=dev)
        mask[..., 0] = True
        meta = AttentionMetadata(
            slot_mapping=torch.full((n,), self.scratch_slot, dtype=torch.long, device=dev),
            query_index=torch.arange(n, dtype=torch.long, device=dev),
            block_tables=torch.zeros(key.batch, key.kv_len // self.block_size, dtype=torch.long, device=dev),
            attn_mask=mask,
            num_seqs=key.batch,
            max_query_len=key.query,
            max_kv_len=key.kv_len,
        )
        return _Graph(torch.zeros(n, dtype=torch.long, device=dev), torch.zeros(n, dtype=torch.long, device=dev), meta)

    def _body(self, g: _Graph) -> tuple[torch.Tensor, list[torch.Tensor]]:
        hidden = self.model(g.input_ids, g.positions, self.kv_caches, g.meta)
        return hidden, list(self.model.model.captured)

    def _build(self, key: GraphKey) -> _Graph | None:
        g = self._static(key)
        if self.capture:
            try:
                stream = torch.cuda.Stream(self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):  # warm-up off the capture: lazy initialisation, autotuning
                    for _ in range(2):
                        self._body(g)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    g.hidden, g.captured = self._body(g)
                g.graph = graph
            except Exception as exc:  # noqa: BLE001 - a step that cannot be captured still runs eagerly
                logger.warning("step shape %s runs without a CUDA graph: %s: %s", key, type(exc).__name__, exc)
                self._failed.add(key)
                self.model.model.captured = []
                return None
        self._graphs[key] = g
        return g

    def _fill(self, g: _Graph, key: GraphKey, input_ids: torch.Tensor, positions: torch.Tensor,
              meta: AttentionMetadata) -> torch.Tensor:  # [num_tokens] the real tokens' rows
        """Copy a step into the bucket's buffers; return where its tokens sit in them."""
        q = meta.max_query_len
        rows = meta.query_index  # b * q + j; the bucket's rows are b * key.query + j
        if q != key.query:
            rows = torch.div(rows, q, rounding_mode="floor") * key.query + rows % q
        sm = g.meta
        g.input_ids.zero_().index_copy_(0, rows, input_ids)
        g.positions.zero_().index_copy_(0, rows, positions)
        sm.slot_mapping.fill_(self.scratch_slot).index_copy_(0, rows, meta.slot_mapping)
        sm.block_tables.zero_()
        sm.block_tables[: meta.num_seqs, : meta.block_tables.shape[1]] = meta.block_tables
        sm.attn_mask.zero_()
        sm.attn_mask[..., 0] = True  # padding rows see key 0 only, so softmax never sees an empty row
        sm.attn_mask[: meta.num_seqs, :, :q, : meta.max_kv_len] = meta.attn_mask
        return rows
