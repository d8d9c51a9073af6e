"""Attention over a paged KV cache: one implementation for prefill, chunks, decode and verify.

Each scheduled request brings n_i >= 1 new query tokens at positions
[c_i, c_i + n_i), where c_i tokens already have KV in the request's blocks. The new tokens'
K/V are written into their slots first; then every query attends to the request's KV at
positions <= its own. That single rule covers a whole prompt (c_i = 0), a prompt chunk, one
decode token (n_i = 1) and a K+1-token speculative verify.

Requests are padded into a [B, Q, ...] batch (Q = longest query run) and their KV gathered
through the block table into [B, L, ...] (L = longest context), so one fused SDPA call per
layer serves the whole batch whatever its mix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Per-step tensors shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] flat slot (block_id * block_size + offset) to write
    query_index: torch.Tensor  # [num_tokens] row of each token in the padded [B * Q] query batch
    block_tables: torch.Tensor  # [B, max_blocks] block ids, padded with 0
    attn_mask: torch.Tensor  # [B, 1, Q, L] True where a query may attend
    num_seqs: int
    max_query_len: int
    max_kv_len: int

    @property
    def num_tokens(self) -> int:
        """Tokens in the step."""
        return int(self.slot_mapping.shape[0])


def build_attention_metadata(
    query_lens: list[int],
    start_positions: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    tail_masks: Sequence[torch.Tensor | None] | None = None,
) -> AttentionMetadata:
    """Build the step's metadata from per-request query lengths, starts and block tables.

    start_positions are slot indices in each request's block table (the new tokens occupy the
    consecutive slots from there); attention is causal over slots. tail_masks, when given, holds
    per request None or a [q, m] bool mask that replaces the causal rule for the last m keys
    (m >= q, the new tokens included): a draft tree's nodes see only their ancestors there, also
    ancestors written by an earlier pass of a draft model.
    """
    num_seqs = len(query_lens)
    max_q = max(query_lens)
    kv_lens = [s + q for s, q in zip(start_positions, query_lens)]
    max_kv = max(kv_lens)
    max_blocks = -(-max_kv // block_size)

    slots: list[int] = []
    qidx: list[int] = []
    for b, (q, s, table) in enumerate(zip(query_lens, start_positions, block_tables)):
        for j in range(q):
            pos = s + j
            slots.append(table[pos // block_size] * block_size + pos % block_size)
            qidx.append(b * max_q + j)
    padded_tables = [t[:max_blocks] + [0] * (max_blocks - len(t[:max_blocks])) for t in block_tables]

    # (Every step builds this, so it takes as few tensor operations as each case needs: after a
    # forward each one costs several microseconds. SmolLM2's decode steps spent 3% in here.)
    tail = tail_masks[0] if tail_masks else None
    if num_seqs == 1 and (tail is None or tail.shape[0] == max_q):
        mask = _lone_mask(max_q, max_kv, tail)
    else:
        mask = _batch_mask(query_lens, start_positions, kv_lens, max_q, max_kv, tail_masks)
    cpu = device.type == "cpu"  # (the tensors are made there: no move)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        query_index=torch.tensor(qidx, dtype=torch.long, device=device),
        block_tables=torch.tensor(padded_tables, dtype=torch.long, device=device),
        attn_mask=mask if cpu else mask.to(device),
        num_seqs=num_seqs,
        max_query_len=max_q,
        max_kv_len=max_kv,
    )


def _lone_mask(q: int, kv: int, tail: torch.Tensor | None) -> torch.Tensor:  # [1, 1, q, kv] bool
    """One request's mask: its q tokens are the last q of its kv keys, so every key before the
    last m (the tail's, or the q tokens' own) is seen by every query."""
    mask = torch.ones(1, 1, q, kv, dtype=torch.bool)
    if tail is not None:
        mask[0, 0, :, kv - tail.shape[1] :] = tail.cpu()
    elif q > 1:
        mask.tril_(kv - q)  # query i, at slot kv - q + i, sees keys up to its own
    return mask


def _batch_mask(query_lens: list[int], start_positions: list[int], kv_lens: list[int], max_q: int, max_kv: int,
                tail_masks: Sequence[torch.Tensor | None] | None) -> torch.Tensor:  # [B, 1, Q, L] bool
    """The padded batch's mask: causal over slots, the tails' rules over their keys, and padding
    query rows seeing key 0 only."""
    num_seqs = len(query_lens)
    start_t = torch.tensor(start_positions, dtype=torch.long)
    k_pos = torch.arange(max_kv, dtype=torch.long)  # [L]
    if max_q == 1:  # one token a request: it sees every key up to its own slot
        mask = (k_pos[None, :] <= start_t[:, None]).view(num_seqs, 1, max_kv)
    else:
        j = torch.arange(max_q, dtype=torch.long)
        q_pos = start_t[:, None] + j[None, :]  # [B, Q] absolute slot of each padded query row
        mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [B, Q, L] causal over slots
    for b, tail in enumerate(tail_masks or ()):
        if tail is not None:
            q, m = tail.shape
            mask[b, :q, kv_lens[b] - m : kv_lens[b]] = tail.cpu()
    if min(query_lens) < max_q:
        # Padding query rows attend to key 0 only, so softmax never sees an all-masked row.
        valid_q = torch.arange(max_q, dtype=torch.long)[None, :] < torch.tensor(query_lens, dtype=torch.long)[:, None]
        mask[~valid_q] = False
        mask[..., 0] |= ~valid_q
    return mask.unsqueeze(1)


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per (token, head): x ~= q * scale[..., None]."""
    x = x.float()
    scale = x.abs().amax(dim=-1).clamp(min=1e-8) / 127.0
    q = torch.round(x / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def write_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens]
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # int8 cache: [num_blocks, block_size, n_kv] each
) -> None:
    """Store the new tokens' keys and values into their cache slots (quantizing for an int8 cache)."""
    n_kv, d = k_cache.shape[-2:]
    if scales is None:
        k_cache.view(-1, n_kv, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, n_kv, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
        return
    for x, cache, sc in ((k, k_cache, scales[0]), (v, v_cache, scales[1])):
        q, s = quantize_kv(x)
        cache.view(-1, n_kv, d).index_copy_(0, slot_mapping, q)
        sc.view(-1, n_kv).index_copy_(0, slot_mapping, s)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # int8 cache: per-(slot, head) scales
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Attend each new token to its request's cached KV (new tokens already written)."""
    num_tokens, num_heads, head_dim = q.shape
    n_kv = k_cache.shape[2]
    B, Q, L = meta.num_seqs, meta.max_query_len, meta.max_kv_len
    if Q == 1 and num_tokens == B:
        qp = q.view(B, 1, num_heads, head_dim)
    else:
        qp = q.new_zeros(B * Q, num_heads, head_dim)
        qp.index_copy_(0, meta.query_index, q)
        qp = qp.view(B, Q, num_heads, head_dim)
    # Gather each request's pages into a contiguous [B, L, n_kv, d] context.
    k = k_cache[meta.block_tables].flatten(1, 2)[:, :L]
    v = v_cache[meta.block_tables].flatten(1, 2)[:, :L]
    if kv_scales is not None:  # dequantize the gathered pages only
        ks = kv_scales[0][meta.block_tables].flatten(1, 2)[:, :L]
        vs = kv_scales[1][meta.block_tables].flatten(1, 2)[:, :L]
        k = k.to(q.dtype) * ks.to(q.dtype)[..., None]
        v = v.to(q.dtype) * vs.to(q.dtype)[..., None]
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    # Grouped-query attention: each KV head serves num_heads // n_kv consecutive query heads.
    # SDPA does the grouping itself (enable_gqa), so the KV heads are never copied out
    # (repeating them cost ~5x the attention time of a long-context decode step).
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=meta.attn_mask, scale=scale, enable_gqa=num_heads != n_kv,
    )  # [B, H, Q, d]
    out = out.transpose(1, 2).reshape(B * Q, num_heads, head_dim)
    if Q == 1 and num_tokens == B:
        return out
    return out.index_select(0, meta.query_index)
