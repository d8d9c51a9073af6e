"""Exactness of tree verification: what a step emits is distributed as the target alone.

The "model" is a Markov chain over a small vocabulary: the target's next-token logits depend
only on the depth and the last token, so the joint law of the first two emitted tokens is known
exactly: q_0(x1) * q_1(x2 | x1) after temperature / top-k / top-p. Each trial drafts its own
tree from a draft chain p (a different Markov chain) in the way under test: deterministic
candidates (the top-w of p: one-hot proposals), i.i.d. draws from p, or draws without
replacement; then one call verifies every trial at once and the emitted pairs are compared to
the exact law with a chi-square test (cells of probability 0 must stay empty).
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
from scipy.stats import chisquare

from specserve.sampling.sampler import SamplingMetadata, logits_to_probs, sample_from_probs
from specserve.sampling.tree_rejection import verify_trees
from specserve.sampling_params import SamplingParams
from specserve.spec.tree import DraftTree, SiblingDraw

V = 8
DRAWS = int(os.environ.get("SPECSERVE_TREE_DRAWS", 1_000_000))
CHUNK = 100_000


def tree_shape(width: int, depth: int) -> list[int]:
    """Parents of a tree whose root and first two children of every node (up to `depth`) get
    `width` children each: branching at every level, and paths below non-first children."""
    parents: list[int] = []
    frontier = [(-1, 0)]  # (node, depth)
    while frontier:
        nxt = []
        for node, d in frontier:
            if d >= depth:
                continue
            for j in range(width):
                parents.append(node)
                if j < 2:
                    nxt.append((len(parents) - 1, d + 1))
        frontier = nxt
    return parents


def processed(table: torch.Tensor, params: SamplingParams) -> torch.Tensor:  # [..., V] logits -> probs
    flat = table.reshape(-1, V)
    n = flat.shape[0]
    meta = SamplingMetadata.build([params] * n, [0] * n, torch.device("cpu"))
    return logits_to_probs(flat, meta.temperature, meta.top_k, meta.top_p).reshape(table.shape)


def draft_trials(kind: SiblingDraw, parents: list[int], p: torch.Tensor, root: int, n: int,
                 g: torch.Generator) -> tuple[list[DraftTree], torch.Tensor]:
    """n trees of the given shape, children drawn from p[depth, last token] as `kind` says, and
    their node tokens [n, N]."""
    depths: list[int] = []
    for par in parents:
        depths.append(1 if par < 0 else depths[par] + 1)
    groups: dict[int, list[int]] = {}
    for i, par in enumerate(parents):
        groups.setdefault(par, []).append(i)
    tokens = torch.zeros(n, len(parents), dtype=torch.long)
    rows: list[torch.Tensor] = []  # per parent with children, [n, V]
    dist_row = [0] * len(parents)
    for par, kids in groups.items():  # parents come first, so par's token is already drawn
        last = torch.full((n,), root, dtype=torch.long) if par < 0 else tokens[:, par]
        d = 0 if par < 0 else depths[par]
        dist = p[d, last]  # [n, V]
        if kind is SiblingDraw.DETERMINISTIC:
            picked = dist.topk(len(kids), dim=1).indices  # a function of the context
        else:
            picked = torch.multinomial(dist, len(kids), replacement=kind is SiblingDraw.IID, generator=g)
        tokens[:, kids] = picked
        for c in kids:
            dist_row[c] = len(rows)
        rows.append(dist)
    dists = torch.stack(rows, dim=1)  # [n, R, V]
    shape = tuple(parents)
    if kind is SiblingDraw.DETERMINISTIC:  # the same context gives the same candidates: one tree
        assert (tokens == tokens[0]).all()
        return [DraftTree(tuple(tokens[0].tolist()), shape)] * n, tokens
    rows_of = tuple(dist_row)
    return [DraftTree(tuple(t), shape, kind, dists[i], rows_of) for i, t in enumerate(tokens.tolist())], tokens


def target_rows(trees: list[DraftTree], tok: torch.Tensor, q_logits: torch.Tensor, root: int) -> torch.Tensor:
    """Target logits of every trial (node tokens tok [n, N]): root row, then one row per node
    (by depth and token)."""
    parents = trees[0].parents
    depths = trees[0].depths
    n = len(trees)
    rows = [q_logits[0, root].expand(n, V)]
    for i in range(len(parents)):
        rows.append(q_logits[depths[i], tok[:, i]])
    return torch.stack(rows, dim=1).reshape(-1, V)  # [n * (N + 1), V]


CASES = [  # (kind, width, depth, temperature, top_k, top_p)
    (kind, w, d, *params)
    for kind in SiblingDraw
    for (w, d), params in zip(
        [(1, 1), (2, 2), (3, 3), (4, 4), (4, 1), (1, 4), (2, 4), (3, 2)],
        [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 4, 0.9), (0.8, 0, 1.0), (1.2, 6, 1.0), (1.0, 0, 0.7), (0.5, 3, 1.0)],
    )
]
# The slow tier runs the widest and deepest shape of each kind at 10^6 draws (about a minute
# each), the quick tier the same shapes at 2 * 10^5; SPECSERVE_TREE_FULL=1 runs all 24 at 10^6
# (3 kinds x 8 shapes: widths 1-4, depths 1-4).
FULL = os.environ.get("SPECSERVE_TREE_FULL") == "1"
SELECTED = [
    pytest.param(*c, draws, id=f"{c[0].value}-w{c[1]}-d{c[2]}-T{c[3]}-k{c[4]}-p{c[5]}-n{draws}",
                 marks=[pytest.mark.slow] if draws == DRAWS else [])
    for c in CASES if FULL or (c[1], c[2]) == (4, 4)
    for draws in ((DRAWS,) if FULL else (DRAWS, DRAWS // 5))
]


@pytest.mark.parametrize("kind,width,depth,temperature,top_k,top_p,draws", SELECTED)
def test_tree_verification_emits_the_target_distribution(kind, width, depth, temperature, top_k, top_p, draws):
    g = torch.Generator().manual_seed(1000 * width + depth)
    q_logits = torch.randn(depth + 1, V, V, generator=g) * 1.5  # [depth, last token, next]
    p_logits = q_logits + torch.randn(depth + 1, V, V, generator=g)  # a draft close to, not equal to, the target
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    q = processed(q_logits, params)
    p = processed(p_logits, params)
    root = 3
    parents = tree_shape(width, depth)
    counts = torch.zeros(V, V, dtype=torch.float64)
    depth_hist = torch.zeros(depth + 1)
    gen = torch.Generator().manual_seed(7)
    # Each chunk makes a million small objects and no reference cycles: with the collector on,
    # its passes over them took 40% of the test's time.
    gc.disable()
    try:
        for _ in range(max(1, draws // CHUNK)):
            trees, tokens = draft_trials(kind, parents, p, root, CHUNK, g)
            meta = SamplingMetadata.build([params] * CHUNK, [0] * CHUNK, torch.device("cpu"))
            results = verify_trees(target_rows(trees, tokens, q_logits, root), trees, meta, gen)
            first = torch.tensor([r.token_ids[0] for r in results])
            # A step that emitted one token leaves the second to the next step, which samples the
            # target at (root, x1): draw it here from q_1(. | x1).
            second = torch.multinomial(q[1, first], 1, generator=g).squeeze(1)
            walked = torch.tensor([len(r.token_ids) > 1 for r in results])
            second[walked] = torch.tensor([r.token_ids[1] for r in results if len(r.token_ids) > 1], dtype=torch.long)
            pairs = torch.stack([first, second], dim=1)
            counts += torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).reshape(V, V).double()
            depth_hist += torch.bincount(torch.tensor([len(r.accepted_nodes) for r in results]), minlength=depth + 1)[: depth + 1]
            for r, t in zip(results[:50], trees[:50]):  # the accepted nodes form a path whose tokens were emitted
                assert r.accepted_nodes == t.path(r.accepted_nodes[-1]) if r.accepted_nodes else True
                assert [t.token_ids[i] for i in r.accepted_nodes] == r.token_ids[: len(r.accepted_nodes)]
    finally:
        gc.enable()
    expected = (q[0, root][:, None] * q[1]).double() * counts.sum()  # [x1, x2]
    zero = expected == 0
    assert counts[zero].sum() == 0, "a token of probability 0 was emitted"
    exp = expected[~zero]
    stat = chisquare(counts[~zero].numpy(), (exp * counts.sum() / exp.sum()).numpy())  # float32 q: renormalise
    assert stat.pvalue > 1e-3, f"chi-square p = {stat.pvalue:.2e} over {int(counts.sum())} draws"
    assert depth_hist[1:].sum() > 0  # drafts were accepted at all (the test is not vacuous)


def test_greedy_follows_the_argmax_child_and_emits_the_bonus():
    tree = DraftTree((5, 6, 7, 1), (-1, -1, 0, 1))  # root -> {5, 6}; 5 -> 7; 6 -> 1
    logits = torch.full((5, V), -5.0)
    for row, best in enumerate([6, 0, 1, 4, 2]):  # root argmax 6 -> node 1 (token 6) -> its child 1 (node 3)
        logits[row, best] = 5.0
    meta = SamplingMetadata.build([SamplingParams(temperature=0)], [0], torch.device("cpu"))
    (res,) = verify_trees(logits, [tree], meta, None)
    assert res.accepted_nodes == [1, 3] and res.token_ids == [6, 1, 2]


def test_seeded_tree_verification_does_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(3)
    trees = [DraftTree((1, 2, 3), (-1, -1, 0)), DraftTree((4, 5), (-1, 0))]
    logits = torch.randn(3 + 1 + 2 + 1, V, generator=g)
    params = [SamplingParams(temperature=1.0, seed=11), SamplingParams(temperature=0.9, seed=12)]
    meta = SamplingMetadata.build(params, [3, 9], torch.device("cpu"))
    both = verify_trees(logits, trees, meta, torch.Generator().manual_seed(1))
    alone = verify_trees(logits[4:], trees[1:], SamplingMetadata.build(params[1:], [9], torch.device("cpu")),
                         torch.Generator().manual_seed(99))
    assert both[1] == alone[0]


def test_a_seeded_leaf_draws_the_token_a_step_without_a_draft_would():
    # The bonus token after an accepted leaf comes from the plain stream, so whether a step
    # carried a draft (which depends on the batch: trees are verified for every sampled request
    # of a step that has one) never changes a seeded request's tokens. Both draws use the
    # engine generator's device (on a GPU a CPU generator would give other numbers).
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(1, V, generator=g)
    for seed, step in ((11, 0), (12, 5), (0, 40)):
        params = [SamplingParams(temperature=0.8, top_k=20, seed=seed)]
        meta = SamplingMetadata.build(params, [step], torch.device("cpu"))
        (res,) = verify_trees(logits, [DraftTree((), ())], meta, torch.Generator().manual_seed(1))
        probs = logits_to_probs(logits, meta.temperature, meta.top_k, meta.top_p)
        plain = sample_from_probs(probs, [seed], [step], torch.Generator().manual_seed(2))
        assert res.token_ids == plain.tolist()


def test_tree_helpers():
    t = DraftTree((9, 8, 7, 6), (-1, -1, 0, 2))
    assert t.depths == (1, 1, 2, 3) and not t.is_chain and t.max_depth == 3
    assert t.children == ((0, 1), (2,), (), (3,), ())
    assert t.path(3) == [0, 2, 3] and t.match([9, 7, 6, 5]) == [0, 2, 3] and t.match([8, 1]) == [1]
    assert t.ancestor_mask().tolist() == [[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]
    assert t.truncate(2).token_ids == (9, 8) and DraftTree.chain([4, 5, 6]).is_chain
    with pytest.raises(ValueError, match="parents must come before"):
        DraftTree((1, 2), (1, -1))
    with pytest.raises(ValueError, match="need the distribution"):
        DraftTree((1,), (-1,), SiblingDraw.IID)


def test_one_hot_trees_emit_what_plain_sampling_emits_for_the_same_seed():
    """Deterministic children are coupled to the plain draw: a seeded request emits, position by
    position, the token the plain sampler draws from that position's q, whichever one-hot tree
    was drafted (none, a wrong guess, the right one, several branches). Only how far one pass
    gets changes. Logits depend on the last token alone here, so each row's q is known."""
    g = torch.Generator().manual_seed(8)
    table = torch.randn(V, V, generator=g) * 1.5  # next-token logits given the last token
    for seed in range(40):
        params = [SamplingParams(temperature=0.9, top_p=0.95, seed=seed)]
        meta = SamplingMetadata.build(params, [7], torch.device("cpu"))
        probs = logits_to_probs(table, meta.temperature.expand(V), meta.top_k.expand(V), meta.top_p.expand(V),
                                meta.any_top_k, meta.any_top_p)
        want, last = [], 0
        for step in range(7, 11):  # what decoding without a draft emits from last token 0
            last = int(sample_from_probs(probs[last : last + 1], [seed], [step], None)[0])
            want.append(last)
        rng = torch.Generator().manual_seed(100 + seed)
        wrong = [(w + 1 + int(r)) % V for w, r in zip(want, torch.randint(0, V - 1, (3,), generator=rng))]  # != want
        trees = [DraftTree.chain(want[:3]), DraftTree.chain(wrong), DraftTree((), ()),
                 DraftTree((wrong[0], want[0], want[1], wrong[1], want[2]), (-1, -1, 1, 1, 2)),
                 DraftTree.chain(want[:1] + wrong[:2])]
        for tree in trees:
            prev = [0] + [tree.token_ids[n] for n in range(len(tree))]  # each row's last token
            logits = table[[0] + [tree.token_ids[n] for n in range(len(tree))]]
            (res,) = verify_trees(logits, [tree], meta, torch.Generator().manual_seed(seed))
            assert res.token_ids == want[: len(res.token_ids)], (seed, tree, prev)
            assert len(res.token_ids) == len(tree.match(want)) + 1


def test_one_hot_chains_emit_what_plain_sampling_emits_for_the_same_seed():
    """The chain sampler couples one-hot drafts the same way (mass below x against the plain
    uniform, without a cdf of the row): a seeded request's tokens do not depend on the drafts."""
    from specserve.sampling.rejection import SpecBatch, rejection_sample

    g = torch.Generator().manual_seed(9)
    table = torch.randn(V, V, generator=g) * 1.5
    for seed in range(40):
        params = SamplingParams(temperature=0.8, top_k=6, seed=seed)
        meta = SamplingMetadata.build([params], [3], torch.device("cpu"))
        probs = logits_to_probs(table, meta.temperature.expand(V), meta.top_k.expand(V), meta.top_p.expand(V),
                                meta.any_top_k, meta.any_top_p)
        want, last = [], 0
        for step in range(3, 7):
            last = int(sample_from_probs(probs[last : last + 1], [seed], [step], None)[0])
            want.append(last)
        rng = torch.Generator().manual_seed(200 + seed)
        for drafts in (want[:3], [int(t) for t in torch.randint(0, V, (3,), generator=rng)], want[:1] + [want[0]], []):
            logits = table[[0] + drafts]
            batch = SpecBatch([len(drafts)], [drafts], [None], meta)
            res = rejection_sample(logits, batch, torch.Generator().manual_seed(seed))
            assert res.token_ids[0] == want[: len(res.token_ids[0])], (seed, drafts)


def test_mass_around_takes_the_same_sums_for_few_rows_and_many():
    from specserve.sampling.sampler import inverse_cdf, mass_around

    g = torch.Generator().manual_seed(10)
    probs = torch.softmax(torch.randn(200, 300, generator=g) * 3, dim=-1)
    x = torch.randint(0, 300, (200,), generator=g)
    lo_many, total_many = mass_around(probs, x)
    lo_few, total_few = (torch.cat(t) for t in zip(*(mass_around(probs[i : i + 50], x[i : i + 50])
                                                      for i in range(0, 200, 50))))
    assert torch.allclose(lo_many, lo_few, rtol=0, atol=1e-12) and torch.allclose(total_many, total_few, atol=1e-12)
    u = torch.rand(200, dtype=torch.float64, generator=g)
    t = u * total_many
    is_x = (t > lo_many) & (t <= lo_many + probs[torch.arange(200), x].double())
    assert torch.equal(is_x, inverse_cdf(probs, u) == x)



def test_the_deterministic_walk_is_the_tables_walk():
    """Every tree deterministic (ranked candidates: what sampled requests draft): the native
    one-call-a-level walk emits the tokens and nodes the generic tables walk emits, from the same
    generator state, seeded and unseeded requests in one batch, with temperature, top-k, top-p and
    min-p, and leaves the generator where the tables walk leaves it."""
    from specserve.sampling.tree_rejection import _walk_deterministic, _walk_tables

    g = torch.Generator().manual_seed(41)
    vocab = 64
    accepted = 0
    for trial in range(40):
        trees, starts, at = [], [], 0
        for _ in range(int(torch.randint(1, 5, (1,), generator=g))):
            n = int(torch.randint(0, 9, (1,), generator=g))
            parents = tuple(int(torch.randint(-1, i, (1,), generator=g)) if i else -1 for i in range(n))
            tokens = tuple(int(t) for t in torch.randint(0, 6, (n,), generator=g))  # few ids: children often match
            trees.append(DraftTree(tokens, parents))
            starts.append(at)
            at += n + 1
        logits = torch.randn(at, vocab, generator=g) * 2
        logits[:, :6] += 6
        params = [SamplingParams(temperature=[0.5, 1.0, 1.4][i % 3], top_k=[0, 3, 20][trial % 3],
                                 top_p=[1.0, 0.9, 0.6][(trial + i) % 3], min_p=0.05 * (i % 2),
                                 seed=(100 + trial + i) if (trial + i) % 2 else None) for i in range(len(trees))]
        meta = SamplingMetadata.build(params, [trial] * len(trees), torch.device("cpu"))
        rows_of = list(range(len(trees)))
        g1, g2 = torch.Generator().manual_seed(trial), torch.Generator().manual_seed(trial)
        fast = _walk_deterministic(logits, trees, starts, rows_of, meta, g1)
        slow = _walk_tables(logits, trees, starts, rows_of, meta, g2)
        assert fast == slow, trial
        assert torch.equal(torch.rand(3, generator=g1), torch.rand(3, generator=g2))
        accepted += sum(len(nodes) for _, nodes in fast)
    assert accepted >= 20  # walks went past their roots
