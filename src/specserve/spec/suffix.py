"""Draft trees from earlier occurrences: every match of the context's tail, weighted by count.

Prompt lookup and inference with reference guess the next tokens by finding the last few
tokens of the output somewhere else (the prompt, the output itself, a reference document) and
copying what followed. One match gives a chain; text usually holds several, and they disagree
(a variable used in three places, a line repeated with different endings). SuffixDecoding's
answer is to keep all of them: the continuations form a trie, each node weighted by the share
of matches that pass through it (an estimate of its chance to be right), and the draft is the
set of highest-weight nodes within the step's node budget, verified in one pass as a tree.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from specserve.spec.tree import DraftTree


def suffix_matches(
    haystack: Sequence[int] | np.ndarray, context: Sequence[int], n_min: int, n_max: int, exclude_tail: bool = False
) -> tuple[int, np.ndarray]:
    """(n, starts): the longest n in [n_min, n_max] whose last-n-tokens pattern of `context`
    occurs in `haystack` with at least one token after it, and where each such continuation
    starts (ascending). With exclude_tail the occurrence may not be the suffix itself (a
    context searched in itself). (0, empty) when nothing matches."""
    hay = np.asarray(haystack, dtype=np.int64)
    limit = len(hay) - 1 if exclude_tail else len(hay)
    for n in range(min(n_max, len(context)), n_min - 1, -1):
        if limit - n < 0 or n == 0:
            continue
        pattern = np.asarray(context[-n:], dtype=np.int64)
        windows = np.lib.stride_tricks.sliding_window_view(hay[:limit], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        hits = hits[hits + n < len(hay)]  # a match must leave at least one token after it
        if hits.size:
            return n, hits + n
    return 0, np.zeros(0, dtype=np.int64)


def weighted_tree(continuations: Sequence[tuple[Sequence[int], float]], budget: int) -> DraftTree | None:
    """The budget highest-weight nodes of the trie of weighted continuations.

    A node's weight is the summed weight of the continuations through it over the total, so
    weights fall along a path and a best-first pick always takes a parent before its children
    (the result is a tree). Ties go to the continuation listed first. None when empty.
    """
    total = sum(w for _, w in continuations)
    if budget <= 0 or total <= 0:
        return None
    tokens: list[int] = []
    parents: list[int] = []
    weight: list[float] = []
    kids: dict[tuple[int, int], int] = {}
    for seq, w in continuations:
        parent = -1
        for t in list(seq)[:budget]:
            node = kids.get((parent, t))
            if node is None:
                node = kids[(parent, t)] = len(tokens)
                tokens.append(int(t))
                parents.append(parent)
                weight.append(0.0)
            weight[node] += w
            parent = node
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    heap = [(-weight[c], c) for c in children.get(-1, [])]
    heapq.heapify(heap)
    order: dict[int, int] = {}  # trie node -> index in the draft
    picked: list[int] = []
    while heap and len(picked) < budget:
        _, node = heapq.heappop(heap)
        order[node] = len(picked)
        picked.append(node)
        for c in children.get(node, []):
            heapq.heappush(heap, (-weight[c], c))
    if not picked:
        return None
    return DraftTree(
        tuple(tokens[n] for n in picked),
        tuple(order[parents[n]] if parents[n] >= 0 else -1 for n in picked),
        scores=tuple(weight[n] / total for n in picked),
    )


def top_path(tree: DraftTree | None) -> DraftTree | None:
    """The chain of the highest-scoring child at every level (what `--spec-tree chain` drafts)."""
    if tree is None:
        return None
    nodes: list[int] = []
    parent = -1
    while True:
        kids = tree.children[parent + 1]
        if not kids:
            break
        parent = max(kids, key=lambda c: (tree.scores[c] if tree.scores else 0.0, -c))
        nodes.append(parent)
    return DraftTree.chain([tree.token_ids[n] for n in nodes])
