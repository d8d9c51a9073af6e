"""Draft trees: the step data a proposer hands the target to verify in one pass.

A draft is a tree of candidate continuations of a request's last token (the root, which is not
a node). Node i has a token and a parent (-1 for the root); nodes are in topological order
(parent index < own index), so any prefix of the node list is itself a tree and a chain of K
tokens is the special case parents = [-1, 0, 1, ..., K-2]. One target pass computes every
node under a tree attention mask (a node sees the verified prefix, its ancestors and itself;
its position is the root's position + its depth), and the rejection sampler walks from the
root accepting at most one child per level (see specserve.sampling.tree_rejection).

How the children of a node were drawn decides the exact acceptance rule, so it travels with
the tree (`SiblingDraw`): deterministic candidates (n-gram matches, lookahead, top-k of a
draft), independent draws from the draft's distribution, or draws without replacement.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specserve.sampling_params import SamplingParams


@functools.lru_cache(maxsize=4096)
def _check_parents(parents: tuple[int, ...]) -> None:
    """Parents come before their children (trees of one shape are checked once)."""
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"node {i} has parent {p}: parents must come before their children")


class SiblingDraw(enum.Enum):
    """How a node's children were chosen from the draft distribution p at that node."""

    # A function of the context (prompt lookup, lookahead, top-k of p): each child's proposal
    # is one-hot, so a rejected child's mass is removed from the target distribution.
    DETERMINISTIC = "deterministic"
    # Each child drawn independently from p (SpecInfer's multi-candidate sampling).
    IID = "iid"
    # Child j drawn from p with children 1..j-1 removed and renormalised (Gumbel top-k).
    WITHOUT_REPLACEMENT = "without_replacement"


def drafts_ranked(params: SamplingParams, children: int = 1) -> bool:
    """Whether a model drafter (draft model, EAGLE, Medusa, MTP, layer skip) offers a request the
    likeliest tokens of its distribution (deterministic candidates) rather than draws from it:
    greedy requests, seeded sampled ones, and every request where a node may get several
    children (trees). Unseeded sampled chains (one child a node) keep drawn tokens.

    Deterministic candidates are verified by coupling to the draw plain sampling makes at each
    position (specserve.sampling.tree_rejection), which is exact whichever candidates a tree
    keeps, so a seeded request emits the text plain sampling gives for its seed, whatever was
    drafted, by which drafter, and whether the adaptive policy (whose choices depend on timing)
    drafted at all. Drawn siblings are exact only if whether a sibling is verified does not
    depend on the sibling itself, yet the tree's node budget and the policy's pruning keep the
    nodes with the best path probabilities, the drawn token's own among them: a tree of drawn
    siblings so cut emitted a biased distribution (Medusa on the tiny test model, 100,000
    requests: the second token's chi-square p = 9e-14). A chain is cut only by its ancestors'
    probabilities and by depth, which is exact.

    Ranked against drawn, same texts, tokens per target forward with every step drafting (2-vCPU
    Xeon, top-p 0.9): SmolLM2's EAGLE trees at T 0.7 1.70 against 1.53 (prose) and 2.22 against
    2.13 (coding), at T 1.0 1.39 against 1.46 and 1.92 against 1.82 (the drawn figures from
    biased trees); the 0.5B draft's chains for the 1.5B, coding T 0.7 4.20 against 4.25, prose
    T 1.0 1.79 against 1.95: where unseeded chains keep their draws."""
    return params.is_greedy or params.seed is not None or children > 1


@dataclass(frozen=True, eq=False)
class DraftTree:
    """Candidate continuations of one request, verified together in one target pass.

    `dists` holds the draft distributions children were drawn from (rows already processed by
    temperature / top-k / top-p), and `dist_row[i]` names the row node i (and its siblings) was
    drawn from. Deterministic trees carry none.
    """

    token_ids: tuple[int, ...]
    parents: tuple[int, ...]
    draw: SiblingDraw = SiblingDraw.DETERMINISTIC
    dists: torch.Tensor | None = None  # [R, V]
    dist_row: tuple[int, ...] = ()
    # What the proposer scored each node (e.g. its path probability); policy and metrics only.
    scores: tuple[float, ...] = field(default=())

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.parents) != n:
            raise ValueError(f"a draft tree needs one parent per node: {n} tokens, {len(self.parents)} parents")
        _check_parents(self.parents)
        if self.draw is not SiblingDraw.DETERMINISTIC:
            if self.dists is None or len(self.dist_row) != n:
                raise ValueError(f"{self.draw.value} drafts need the distribution each node was drawn from")
            if self.dist_row and not 0 <= min(self.dist_row) <= max(self.dist_row) < self.dists.shape[0]:
                raise ValueError("dist_row points outside dists")

    # ------------------------------------------------------------------ constructors
    @classmethod
    def chain(cls, token_ids: Sequence[int], probs: torch.Tensor | None = None) -> DraftTree:
        """K tokens in a row; probs [K, V] the distributions they were drawn from (None: one-hot)."""
        k = len(token_ids)
        if probs is None:
            return cls(tuple(token_ids), tuple(range(-1, k - 1)))
        return cls(tuple(token_ids), tuple(range(-1, k - 1)), SiblingDraw.IID, probs, tuple(range(k)))

    # ------------------------------------------------------------------ shape
    def __len__(self) -> int:
        return len(self.token_ids)

    @cached_property
    def is_chain(self) -> bool:
        """True when every node's parent is the node before it (one path, no branching)."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """Depth of each node (children of the root have depth 1)."""
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return tuple(d)

    @property
    def max_depth(self) -> int:
        """Length of the longest path."""
        return max(self.depths, default=0)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """children[0] lists the root's children, children[i + 1] node i's, in node order."""
        kids: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.parents):
            kids[p + 1].append(i)
        return tuple(tuple(k) for k in kids)

    def path(self, node: int) -> list[int]:
        """Nodes from depth 1 down to `node`."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def ancestor_mask(self) -> torch.Tensor:  # [N, N] bool
        """mask[i, j]: node i attends to node j (j is i or one of its ancestors)."""
        return torch.tensor(self.ancestor_rows(), dtype=torch.bool).view(len(self), len(self))

    def ancestor_rows(self, before: int = 0) -> list[list[bool]]:
        """ancestor_mask's rows as lists, each after `before` True entries (keys every node sees).
        (Built in Python and made a tensor once: a tensor write per node cost a verify step
        several microseconds a node on caches a forward has just swept.)"""
        n = len(self)
        rows: list[list[bool]] = []
        for i, p in enumerate(self.parents):
            row = rows[p].copy() if p >= 0 else [True] * before + [False] * n
            row[before + i] = True
            rows.append(row)
        return rows

    def truncate(self, n: int) -> DraftTree:
        """The first n nodes (a tree again: parents come first)."""
        if n >= len(self):
            return self
        rows = self.dist_row[:n]
        return DraftTree(self.token_ids[:n], self.parents[:n], self.draw, self.dists, rows, self.scores[:n])

    def main_path_tokens(self) -> tuple[int, ...]:
        """Tokens along first children from the root (the chain itself for a chain)."""
        out, node = [], -1
        while self.children[node + 1]:
            node = self.children[node + 1][0]
            out.append(self.token_ids[node])
        return tuple(out)

    def select(self, nodes: Sequence[int]) -> DraftTree:
        """The tree of the given nodes (in order; each node's parent must be among them or the root)."""
        index = {-1: -1}
        for new, old in enumerate(nodes):
            if self.parents[old] not in index:
                raise ValueError(f"node {old} is kept without its parent {self.parents[old]}")
            index[old] = new
        parents = tuple(index[self.parents[old]] for old in nodes)
        tokens = tuple(self.token_ids[old] for old in nodes)
        rows = tuple(self.dist_row[old] for old in nodes) if self.dist_row else ()
        scores = tuple(self.scores[old] for old in nodes) if self.scores else ()
        return DraftTree(tokens, parents, self.draw, self.dists, rows, scores)

    def match(self, tokens: Sequence[int]) -> list[int]:
        """The deepest path of nodes whose tokens equal tokens[0], tokens[1], ... (the nodes
        the target accepted, found again from the accepted tokens)."""
        best: list[int] = []

        def walk(parent: int, depth: int, path: list[int]) -> None:
            nonlocal best
            if len(path) > len(best):
                best = list(path)
            if depth >= len(tokens):
                return
            for c in self.children[parent + 1]:
                if self.token_ids[c] == tokens[depth]:
                    path.append(c)
                    walk(c, depth + 1, path)
                    path.pop()

        walk(-1, 0, [])
        return best
