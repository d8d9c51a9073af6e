"""The step's attention metadata (specserve.attention.build_attention_metadata) against its
definition, written out token by token: decode steps, uniform and ragged verify batches, prompt
chunks and draft-tree tail masks."""

from __future__ import annotations

import random

import torch

from specserve.attention import build_attention_metadata


def _reference(query_lens, starts, tables, block_size, tails):
    """Slots, padded query rows, padded tables and the [B, 1, Q, L] mask, one token at a time."""
    B, Q = len(query_lens), max(query_lens)
    kv_lens = [s + q for s, q in zip(starts, query_lens)]
    L = max(kv_lens)
    width = -(-L // block_size)
    slots, rows = [], []
    mask = torch.zeros(B, 1, Q, L, dtype=torch.bool)
    for b, (q, s) in enumerate(zip(query_lens, starts)):
        tail = tails[b] if tails else None
        for i in range(Q):
            if i >= q:  # a padding row: key 0 only
                mask[b, 0, i, 0] = True
                continue
            pos = s + i
            slots.append(tables[b][pos // block_size] * block_size + pos % block_size)
            rows.append(b * Q + i)
            for key in range(L):
                allowed = key <= pos
                if tail is not None and kv_lens[b] - tail.shape[1] <= key < kv_lens[b]:
                    allowed = bool(tail[i, key - (kv_lens[b] - tail.shape[1])])
                mask[b, 0, i, key] = allowed
    padded = [t[:width] + [0] * (width - len(t[:width])) for t in tables]
    return torch.tensor(slots), torch.tensor(rows), torch.tensor(padded), mask


def test_metadata_matches_its_definition_for_every_kind_of_step():
    rng = random.Random(0)
    kinds = {"decode": 0, "uniform": 0, "ragged": 0, "tails": 0}
    for _ in range(400):
        B, bs = rng.randint(1, 5), rng.choice([1, 4, 16])
        kind = rng.choice(list(kinds))
        if kind == "decode":
            query_lens = [1] * B
        elif kind == "uniform":
            query_lens = [rng.randint(2, 9)] * B
        else:
            query_lens = [rng.randint(1, 9) for _ in range(B)]
        starts = [rng.randint(0, 40) for _ in range(B)]
        tables = [[rng.randint(0, 99) for _ in range(-(-(s + q) // bs) + rng.randint(0, 2))]
                  for s, q in zip(starts, query_lens)]
        tails = None
        if kind == "tails":
            tails = [torch.rand(q, rng.randint(q, q + s)) < 0.5 if rng.random() < 0.7 else None
                     for s, q in zip(starts, query_lens)]
        kinds[kind] += 1
        meta = build_attention_metadata(query_lens, starts, tables, bs, torch.device("cpu"), tails)
        slots, rows, padded, mask = _reference(query_lens, starts, tables, bs, tails)
        assert torch.equal(meta.slot_mapping, slots) and torch.equal(meta.query_index, rows)
        assert torch.equal(meta.block_tables, padded)
        assert meta.attn_mask.shape == mask.shape and torch.equal(meta.attn_mask, mask), (kind, query_lens, starts)
        assert meta.max_query_len == max(query_lens) and meta.max_kv_len == max(s + q for s, q in zip(starts, query_lens))
        assert meta.num_seqs == B and meta.num_tokens == sum(query_lens)
    assert min(kinds.values()) > 50
