"""The prompt-lookup search (specserve.spec.suffix.suffix_matches) against a brute-force one,
and the token array it reads."""

from __future__ import annotations

import random

import numpy as np

from specserve.spec.suffix import TokenArray, suffix_matches


def _brute_force(hay: list[int], context: list[int], n_min: int, n_max: int, exclude_tail: bool) -> tuple[int, list[int]]:
    """Every window of every length, longest first: the definition suffix_matches implements."""
    limit = len(hay) - 1 if exclude_tail else len(hay)
    for n in range(min(n_max, len(context)), max(n_min, 1) - 1, -1):
        starts = [s + n for s in range(0, limit - n + 1) if hay[s : s + n] == context[-n:] and s + n < len(hay)]
        if starts:
            return n, starts
    return 0, []


def test_suffix_matches_equals_the_brute_force_search():
    rng = random.Random(0)
    for case in range(6000):
        vocab = rng.choice([2, 3, 5, 20])
        hay = [rng.randrange(vocab) for _ in range(rng.randrange(0, 50))]
        searched_in_itself = rng.random() < 0.5
        context = hay if searched_in_itself else [rng.randrange(vocab) for _ in range(rng.randrange(0, 9))]
        n_min = rng.randrange(1, 4)
        n_max = rng.randrange(n_min, n_min + 5)
        exclude = searched_in_itself and rng.random() < 0.8
        want = _brute_force(hay, context, n_min, n_max, exclude)
        for h, c in ((hay, context), (np.asarray(hay, dtype=np.int64), np.asarray(context, dtype=np.int64))):
            n, starts = suffix_matches(h, c, n_min, n_max, exclude)
            assert (n, starts.tolist()) == want, (case, hay, context, n_min, n_max, exclude)


def test_token_array_follows_an_appended_list_and_starts_over_for_another():
    toks: list[int] = []
    arr = TokenArray()
    rng = random.Random(1)
    for _ in range(300):  # grows past its first buffer several times
        toks.extend(rng.randrange(1000) for _ in range(rng.randrange(0, 9)))
        view = arr.sync(toks)
        assert view.dtype == np.int64 and view.tolist() == toks
    other = toks[:50] + [toks[49] + 1]  # not an extension of what it saw: copied whole
    assert arr.sync(other).tolist() == other
    assert arr.sync([7, 8]).tolist() == [7, 8]
    assert arr.sync([]).tolist() == []


def _full_trie_tree(continuations, budget):
    """weighted_tree's definition: the whole trie, then a best-first pick (ties: creation order)."""
    import heapq

    total = sum(w for _, w in continuations)
    if budget <= 0 or total <= 0:
        return None
    tokens, parents, weight, kids = [], [], [], {}
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
    children = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    heap = [(-weight[c], c) for c in children.get(-1, [])]
    heapq.heapify(heap)
    order, picked = {}, []
    while heap and len(picked) < budget:
        _, node = heapq.heappop(heap)
        order[node] = len(picked)
        picked.append(node)
        for c in children.get(node, []):
            heapq.heappush(heap, (-weight[c], c))
    if not picked:
        return None
    return (tuple(tokens[n] for n in picked), tuple(order[parents[n]] if parents[n] >= 0 else -1 for n in picked),
            tuple(weight[n] / total for n in picked))


def test_weighted_tree_equals_the_full_trie_pick():
    """Grown lazily, the tree is the one the whole trie's best-first pick gives, ties included."""
    from specserve.spec.suffix import weighted_tree

    rng = random.Random(2)
    for case in range(3000):
        vocab = rng.choice([2, 3, 6])
        conts = [([rng.randrange(vocab) for _ in range(rng.randrange(0, 7))], rng.choice([1.0, 1.0, 0.5, 2.0, 0.25]))
                 for _ in range(rng.randrange(0, 12))]
        budget = rng.randrange(0, 12)
        want = _full_trie_tree(conts, budget)
        got = weighted_tree(conts, budget)
        if want is None:
            assert got is None, case
        else:
            assert (got.token_ids, got.parents, got.scores) == want, (case, conts, budget)
