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
    haystack: Sequence[int] | np.ndarray, context: Sequence[int] | np.ndarray, n_min: int, n_max: int,
    exclude_tail: bool = False, banned_next: frozenset[int] = frozenset(),
) -> tuple[int, np.ndarray]:
    """(n, starts): the longest n in [n_min, n_max] whose last-n-tokens pattern of `context`
    occurs in `haystack` with at least one token after it, and where each such continuation
    starts (ascending). With exclude_tail the occurrence may not be the suffix itself (a
    context searched in itself); an occurrence whose next token is in banned_next does not
    count (a continuation that would begin with an ending id). (0, empty) when nothing matches.

    One pass over the haystack finds where the context's last token occurs; each of those
    occurrences is then extended backwards while it keeps matching, up to n_max tokens, so the
    cost is one comparison per haystack token plus a little per occurrence, whatever n_max is.
    Pass an int64 array (TokenArray keeps one up to date) to spare converting a list each call;
    a list of up to SHORT_SEARCH tokens is searched as a list (`_list_matches`).
    """
    bounds = _bounds(len(haystack), context, n_min, n_max, exclude_tail)
    if bounds is None:
        return 0, _NONE
    last_end, tail = bounds
    if isinstance(haystack, list) and len(haystack) <= SHORT_SEARCH:
        return _list_matches(haystack, tail, last_end, n_min, banned_next)
    hay = np.asarray(haystack, dtype=np.int64)
    top = len(tail)
    ends = np.flatnonzero(hay[:last_end] == tail[0])
    length = np.ones(len(ends), dtype=np.int64)  # how far back each occurrence matches (<= top)
    alive = ends
    for i in range(1, top):
        alive = alive[alive >= i]
        alive = alive[hay[alive - i] == tail[i]]
        if not alive.size:
            break
        length[np.searchsorted(ends, alive)] += 1
    if banned_next and ends.size:
        after = hay[ends + 1]
        for t in banned_next:  # one to a few ids
            length[after == t] = 0
    best = int(length.max()) if length.size else 0
    if best < max(n_min, 1):
        return 0, _NONE
    return best, ends[length >= best] + 1


_NONE = np.zeros(0, dtype=np.int64)
_NONE.flags.writeable = False

# Up to this many tokens a list is searched as a list: list.index finds each occurrence of the
# last token at C speed, and the few occurrences extend backwards in Python. In the engine, between
# two forwards, the array search took ~155 us a call on SmolLM2's chats (~10 us timed alone: a
# dozen small numpy calls on cold caches) and keeping the array ~35 us more; the list ~3-8 us
# for 60-400 tokens alone, where the array path wins from ~1,000.
SHORT_SEARCH = 512


def _bounds(hay_len: int, context: Sequence[int] | np.ndarray, n_min: int, n_max: int,
            exclude_tail: bool) -> tuple[int, list[int]] | None:
    """(last_end, tail) of a search: an occurrence's last token lies before last_end (inside the
    haystack, minus its own tail with exclude_tail, and followed by a token); tail[i] is the
    context's token i places before its last, up to n_max of them. None when nothing can match."""
    top = min(n_max, len(context))
    if top < max(n_min, 1):
        return None
    last_end = min(hay_len - 1 if exclude_tail else hay_len, hay_len - 1)
    if last_end <= 0:
        return None
    return last_end, [int(t) for t in context[-top:]][::-1]


def _list_matches(hay: list[int], tail: list[int], last_end: int, n_min: int,
                  banned_next: frozenset[int]) -> tuple[int, np.ndarray]:
    """suffix_matches over a list: the same answer."""
    top = len(tail)
    first = tail[0]
    best, ends, lengths = 0, [], []
    e = -1
    while True:
        try:
            e = hay.index(first, e + 1, last_end)
        except ValueError:
            break
        if hay[e + 1] in banned_next:
            continue
        n = 1
        while n < top and e >= n and hay[e - n] == tail[n]:
            n += 1
        ends.append(e)
        lengths.append(n)
        best = max(best, n)
    if best < max(n_min, 1):
        return 0, _NONE
    return best, np.array([e + 1 for e, n in zip(ends, lengths) if n >= best], dtype=np.int64)


class RepeatWatch:
    """Whether contexts' last n tokens repeat in a haystack, asked step after step as they grow.

    A search finds the longest repeated tail m; where m < n, no tail of n can repeat before the
    context has n - m more tokens (a repeat of n tokens, j tokens later, holds a repeat of n - j
    at the earlier length, in a haystack that only grows), so the searches in between are
    skipped: on prose, where tails repeat one or two tokens, one search in five or six."""

    __slots__ = ("_due", "n")

    def __init__(self, n: int) -> None:
        self.n = n
        self._due: dict[str, int] = {}  # per key: the context length from which a search may find n

    def repeats(self, key: str, haystack: Sequence[int] | np.ndarray, context: Sequence[int] | np.ndarray,
                exclude_tail: bool = False) -> bool:
        """Whether the context's last n tokens occur in the haystack with a token after them
        (suffix_matches); the haystack and the context only grow between calls with one key."""
        size = len(context)
        if size < self._due.get(key, 0):
            return False
        m = suffix_matches(haystack, context, 1, self.n, exclude_tail)[0]
        self._due[key] = size + self.n - m
        return m >= self.n

    def forget(self, key: str) -> None:
        self._due.pop(key, None)


class TokenArray:
    """An int64 array mirroring an append-only token list (a request's prompt and output), grown
    in place as the list grows: a per-step search reads it instead of converting the whole list
    (~100 us for 1,000 tokens, ~1 ms for 16,000) every step."""

    __slots__ = ("_buf", "_n")

    def __init__(self) -> None:
        self._buf = np.zeros(256, dtype=np.int64)
        self._n = 0

    def view(self, tokens: list[int]) -> list[int] | np.ndarray:
        """What suffix_matches should search: a list of up to SHORT_SEARCH tokens as it is, a longer
        one through the array (`sync`)."""
        return tokens if len(tokens) <= SHORT_SEARCH else self.sync(tokens)

    def sync(self, tokens: Sequence[int]) -> np.ndarray:
        """The array of `tokens` (a view of the buffer): only the tokens appended since the last
        call are copied; a list that is not an extension of what was seen is copied whole."""
        n = len(tokens)
        if n < self._n or (self._n and self._buf[self._n - 1] != tokens[self._n - 1]):
            self._n = 0  # not the list seen before (cheap check: lists only grow, by appending)
        if n > len(self._buf):
            grown = np.zeros(max(n, 2 * len(self._buf)), dtype=np.int64)
            grown[: self._n] = self._buf[: self._n]
            self._buf = grown
        if n > self._n:
            self._buf[self._n : n] = tokens[self._n : n]
            self._n = n
        return self._buf[:n]


def weighted_tree(continuations: Sequence[tuple[Sequence[int], float]], budget: int) -> DraftTree | None:
    """The budget highest-weight nodes of the trie of weighted continuations.

    A node's weight is the summed weight of the continuations through it over the total, so
    weights fall along a path and a best-first pick always takes a parent before its children
    (the result is a tree). Ties go to the continuation listed first (then the shallower node).
    None when empty.

    The trie is grown only where the pick goes: a picked node's continuations are grouped by
    their next token into its children, so a step with 64 occurrences of a common token costs the
    nodes it keeps, not all 64 x budget (which cost ~165 us a step on a long prompt).
    """
    total = sum(w for _, w in continuations)
    if budget <= 0 or total <= 0:
        return None
    seqs = [list(seq)[:budget] for seq, _ in continuations]
    weights = [w for _, w in continuations]
    # Heap items (-weight, first continuation through the node, depth, token, members, parent's
    # index in the draft): a node is one continuation's prefix, so (first, depth) names it. The
    # items' member lists are disjoint (a node's children split its members), so no two share a
    # `first` and a comparison never reaches the token.
    heap: list[tuple[float, int, int, int, list[int], int]] = []
    push, pop = heapq.heappush, heapq.heappop

    def push_children(members: list[int], depth: int, parent: int) -> None:
        groups: dict[int, list[int]] = {}
        for i in members:
            s = seqs[i]
            if depth < len(s):
                t = s[depth]
                if (g := groups.get(t)) is None:
                    groups[t] = [i]
                else:
                    g.append(i)
        for token, group in groups.items():
            push(heap, (-sum(weights[i] for i in group), group[0], depth, int(token), group, parent))

    push_children(list(range(len(seqs))), 0, -1)
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    while heap and len(tokens) < budget:
        neg, first, depth, token, group, parent = pop(heap)
        tokens.append(token)
        parents.append(parent)
        scores.append(-neg / total)
        if len(group) > 1:
            push_children(group, depth + 1, len(tokens) - 1)
            continue
        # One continuation: its next nodes keep its weight, and are taken in a row for as long as
        # they come before everything waiting (the pops a heap would make, without it; on prose,
        # where a common word's matches part after a token or two, most of a draft's nodes).
        seq, d = seqs[first], depth + 1
        while d < len(seq) and len(tokens) < budget and (not heap or (neg, first, d) < heap[0][:3]):
            tokens.append(int(seq[d]))
            parents.append(len(tokens) - 2)
            scores.append(-neg / total)
            d += 1
        if d < len(seq) and len(tokens) < budget:
            push(heap, (neg, first, d, int(seq[d]), group, len(tokens) - 1))
    if not tokens:
        return None
    return DraftTree(tuple(tokens), tuple(parents), scores=tuple(scores))


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
