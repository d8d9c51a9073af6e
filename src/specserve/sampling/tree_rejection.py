"""Exact verification of draft trees (SpecInfer, Medusa, EAGLE-2) in one target pass.

The walk starts at the root (the request's last verified token) with the target distribution q
of the root's row. At each node it tests the node's children in order; the first accepted child
is emitted and the walk moves to it (its own row's q); if every child is rejected, one token is
drawn from what is left of q and the walk ends; if the accepted node has no children, a bonus
token is drawn from its q. So a step emits 1 + (accepted depth) tokens, and each emitted token
is distributed exactly as the target alone would sample it. q and p are the *processed*
distributions (temperature, top-k, top-p applied by `logits_to_probs`); greedy requests follow
the child equal to the target argmax.

The test of the children of one node, with r the remaining target distribution (r = q at
first) and x_j the j-th child:

* deterministic children (prompt lookup, lookahead, top-k of a draft; p_j = one-hot(x_j)):
  accept x_j with probability r(x_j); on rejection r <- r with x_j removed, renormalised.
* i.i.d. children (each drawn from the draft's p independently of the others): accept x_j with
  probability min(1, r(x_j) / p(x_j)); on rejection r <- normalize(max(0, r - p)).
* children drawn without replacement (x_j from p_j = p with x_1..x_{j-1} removed and
  renormalised): accept x_j with probability min(1, r(x_j) / p_j(x_j)); on rejection
  r <- normalize(max(0, r - p_j)).

Proof (one argument for all three). Write r_1 = q and r_{j+1} = normalize(max(0, r_j - p_j))
for the proposal p_j of the j-th child (one-hot(x_j), p, or p without x_{<j}); r_{j+1} depends
only on the history h_j = (x_1, ..., x_j) of candidates, never on the acceptance coins. Claim:
given h_{j-1} and that x_1..x_{j-1} were rejected, the emitted token is distributed as r_j.
For j = m + 1 (every child rejected) the token is drawn from r_{m+1} itself. For j <= m, x_j is
drawn from p_j independently of the earlier coins, so this is one step of ordinary speculative
sampling with target r_j and proposal p_j whose "recovery" is the rest of the walk, by
induction distributed as r_{j+1} = normalize(max(0, r_j - p_j)) whatever x_j was; speculative
sampling then emits exactly r_j (Leviathan et al. 2023, Theorem 1). With j = 1 the emitted
token is distributed as q. Which child was accepted decides the next node, and the tree below
it was built from the draft alone, so the next level is the same argument with the accepted
node as root. (With one-hot p_j, max(0, r_j - p_j) only drops x_j: r_j(x_j) <= 1.) If r_j <= p_j
everywhere, r_j = p_j and rejection has probability 0; the code then keeps r_j.

Deterministic children are coupled to plain sampling: at such a node the walk draws the token
the plain sampler would draw at this output position (inverse cdf of q with that position's
plain uniform), follows the child with that token if there is one, else emits the draw and
stops. The child x_j is followed with probability q(x_j), as under the sequential test above
(q(x_1) + (1 - q(x_1)) * q(x_2) / (1 - q(x_1)) + ... = q(x_1) + q(x_2) + ...), and given that
no child matched the draw is distributed as q without the children, which is r_{m+1}: the same
distribution, and the tokens a step without a draft would emit for the same uniforms. So a
seeded request's text does not depend on whether an n-gram, lookahead or reference tree, or a
model drafter's tree of its likeliest tokens (what model drafters offer seeded requests:
`spec.tree.drafts_ranked`), was drafted for it (the adaptive policy's choice depends on timing).

Randomness: a seeded request draws from generators keyed by (seed, output position, stream),
so its output does not depend on how it was batched; the accept coins of one node's children
are consecutive draws of that position's accept stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from specserve.kernels import row_argmax
from specserve.sampling.rejection import STREAM_ACCEPT, STREAM_RECOVER
from specserve.sampling.sampler import (
    SamplingMetadata,
    draw_tokens,
    inverse_cdf,
    logits_to_probs,
    request_generator,
)
from specserve.spec.tree import DraftTree, SiblingDraw


class TreeVerifyResult(NamedTuple):
    """One request's outcome: emitted tokens (accepted nodes' tokens, then one more)."""

    token_ids: list[int]
    accepted_nodes: list[int]  # node indices of the accepted path, depth 1 first
    logprobs: list[float] | None


def verify_trees(
    target_logits: torch.Tensor,  # [sum(N_i + 1), V]: per request its root row, then one row per node
    trees: Sequence[DraftTree],
    meta: SamplingMetadata,  # one row per request
    generator: torch.Generator | None,
    target_argmax: list[int] | None = None,  # the rows' argmax, where the caller has it
) -> list[TreeVerifyResult]:
    """Walk every request's tree and return what each emits (see the module docstring)."""
    sizes = [len(t) + 1 for t in trees]
    starts = [0]
    for n in sizes[:-1]:
        starts.append(starts[-1] + n)
    greedy = list(meta.greedies)
    walks: list[tuple[list[int], list[int]]] = [([], [])] * len(trees)
    if any(greedy):
        argmax = target_argmax if target_argmax is not None else row_argmax(target_logits).tolist()
        for i, tree in enumerate(trees):
            if greedy[i]:
                walks[i] = _walk_greedy(tree, argmax[starts[i] : starts[i] + sizes[i]])
    sampled = [i for i, g in enumerate(greedy) if not g]
    if sampled:
        for i, walk in zip(sampled, _walk_sampled(target_logits, [trees[i] for i in sampled], [starts[i] for i in sampled],
                                                  sampled, meta, generator)):
            walks[i] = walk
    logprobs: list[list[float] | None] = [None] * len(trees)
    if meta.need_logprobs:
        rows = [starts[i] + r for i, (_, nodes) in enumerate(walks) for r in [0] + [n + 1 for n in nodes]]
        toks = torch.tensor([t for tokens, _ in walks for t in tokens], device=target_logits.device)
        lp = torch.log_softmax(target_logits[rows].float(), dim=-1).gather(1, toks[:, None]).squeeze(1).tolist()
        at = 0
        for i, (tokens, _) in enumerate(walks):
            logprobs[i] = lp[at : at + len(tokens)]
            at += len(tokens)
    return [TreeVerifyResult(tokens, nodes, logprobs[i]) for i, (tokens, nodes) in enumerate(walks)]


def _walk_greedy(tree: DraftTree, argmax: list[int]) -> tuple[list[int], list[int]]:
    """Follow, level by level, the first child whose token is the target's argmax."""
    tokens: list[int] = []
    nodes: list[int] = []
    node = -1
    while True:
        best = argmax[node + 1]
        nxt = next((c for c in tree.children[node + 1] if tree.token_ids[c] == best), None)
        tokens.append(best)
        if nxt is None:
            return tokens, nodes
        nodes.append(nxt)
        node = nxt


class _Tables(NamedTuple):
    """A batch's trees as padded tensors; trees of one shape (parents, draw, rows) share their
    children table, so a batch of many small trees costs a few tensor ops, not a loop per node."""

    which: torch.Tensor  # [B] each request's tree
    shape: torch.Tensor  # [U] each tree's shape
    kids: torch.Tensor  # [S, N + 1, W] children of the root (row 0) and of each node, -1 padded
    tokens: torch.Tensor  # [U, N] node tokens
    dist_index: torch.Tensor  # [U, N] row of `dists` each node was drawn from (-1: deterministic)
    dists: torch.Tensor  # [R, V] every tree's draft distributions, zero-padded to the target's vocabulary
    without_replacement: torch.Tensor  # [U] bool
    deterministic: torch.Tensor  # [U] bool: one-hot children, coupled to the plain draw


def _tables(trees: Sequence[DraftTree], vocab: int) -> _Tables:
    ids: dict[int, int] = {}
    uniq: list[DraftTree] = []
    which = []
    for t in trees:
        if id(t) not in ids:
            ids[id(t)] = len(uniq)
            uniq.append(t)
        which.append(ids[id(t)])
    n = max(1, max(len(t) for t in uniq))
    shapes: dict[tuple, list[int]] = {}
    for u, t in enumerate(uniq):
        rows = 0 if t.dists is None or t.draw is SiblingDraw.DETERMINISTIC else t.dists.shape[0]
        shapes.setdefault((t.parents, t.draw, t.dist_row, rows), []).append(u)
    w = max(1, max(max((len(c) for c in uniq[us[0]].children), default=0) for us in shapes.values()))
    kids = torch.full((len(shapes), n + 1, w), -1, dtype=torch.long)
    shape = torch.zeros(len(uniq), dtype=torch.long)
    tokens = torch.zeros(len(uniq), n, dtype=torch.long)
    dist_index = torch.full((len(uniq), n), -1, dtype=torch.long)
    blocks = [torch.zeros(1, vocab, dtype=torch.float64)]
    base = 1
    for s_i, ((parents, _draw, dist_row, rows), us) in enumerate(shapes.items()):
        first = uniq[us[0]]
        for parent, cs in enumerate(first.children):
            if cs:
                kids[s_i, parent, : len(cs)] = torch.tensor(cs, dtype=torch.long)
        ut = torch.tensor(us, dtype=torch.long)
        shape[ut] = s_i
        if parents:
            tokens[ut, : len(parents)] = torch.tensor([uniq[u].token_ids for u in us], dtype=torch.long)
        if rows and parents:
            d = torch.cat([uniq[u].dists for u in us]).double()  # type: ignore[misc]
            pad = torch.zeros(d.shape[0], vocab, dtype=torch.float64)
            pad[:, : min(vocab, d.shape[1])] = d[:, :vocab]  # a restricted draft head covers the low ids
            blocks.append(pad)
            offs = base + rows * torch.arange(len(us), dtype=torch.long)
            dist_index[ut, : len(parents)] = offs[:, None] + torch.tensor(dist_row, dtype=torch.long)[None, :]
            base += pad.shape[0]
    wor = torch.tensor([t.draw is SiblingDraw.WITHOUT_REPLACEMENT for t in uniq])
    det = torch.tensor([t.draw is SiblingDraw.DETERMINISTIC for t in uniq])
    return _Tables(torch.tensor(which, dtype=torch.long), shape, kids, tokens, dist_index, torch.cat(blocks), wor, det)


def _walk_sampled(
    target_logits: torch.Tensor, trees: Sequence[DraftTree], starts: Sequence[int], rows_of: Sequence[int],
    meta: SamplingMetadata, generator: torch.Generator | None,
) -> list[tuple[list[int], list[int]]]:
    """The walk of every sampled request, all requests in lockstep: level by level, and within
    a level child by child (j-th children of every request together)."""
    if target_logits.device.type != "cpu":
        # The walk is a loop of small steps over tables built on the CPU: on an accelerator each
        # would be a launch and a sync, so the logits and settings come here once.
        target_logits = target_logits.float().cpu()
        meta = meta.to(torch.device("cpu"))
    if all(t.draw is SiblingDraw.DETERMINISTIC for t in trees):
        return _walk_deterministic(target_logits, trees, starts, rows_of, meta, generator)
    return _walk_tables(target_logits, trees, starts, rows_of, meta, generator)


def _walk_tables(
    target_logits: torch.Tensor, trees: Sequence[DraftTree], starts: Sequence[int], rows_of: Sequence[int],
    meta: SamplingMetadata, generator: torch.Generator | None,
) -> list[tuple[list[int], list[int]]]:
    """_walk_sampled for any mix of sibling draws, over padded tables (the logits on the CPU)."""
    vocab = target_logits.shape[-1]
    sizes = torch.tensor([len(t) + 1 for t in trees])
    base = torch.tensor(list(starts), dtype=torch.long)  # [B] row of each request's root
    req = torch.tensor(list(rows_of), dtype=torch.long)  # [B] each request's row of meta
    tab = _tables(trees, vocab)
    b = len(trees)
    seeds = [meta.seeds[i] for i in rows_of]
    steps0 = [meta.steps[i] for i in rows_of]
    seeded = any(s is not None for s in seeds)  # else every uniform comes from `generator`: no per-row lists
    node = torch.full((b,), -1, dtype=torch.long)
    done = torch.zeros(b, dtype=torch.bool)
    levels = int(sizes.max())
    emitted = torch.full((b, levels), -1, dtype=torch.long)  # token emitted at each depth
    trail = torch.full((b, levels), -1, dtype=torch.long)  # node accepted at each depth
    ar = torch.arange(b)

    def level_coins(walkers: torch.Tensor, stream: int, count: int) -> torch.Tensor:  # [len(walkers), count]
        """Uniforms of `stream` at this level for the walks `walkers` (indices of requests)."""
        if not seeded:
            return _shared_coins(walkers.numel(), count, generator)
        ws = walkers.tolist()
        return _coins([seeds[i] for i in ws], [steps0[i] + depth for i in ws], stream, count, generator)

    for depth in range(levels):
        act = (~done).nonzero().squeeze(1)
        if act.numel() == 0:
            break
        na = act.numel()
        which = tab.which[act]
        cur = node[act]
        # Only the rows the walk visits are processed (temperature, top-k, top-p).
        m = req[act]
        q = logits_to_probs(target_logits[base[act] + cur + 1], meta.temperature[m], meta.top_k[m], meta.top_p[m],
                            meta.any_top_k, meta.any_top_p, meta.min_p[m], meta.any_min_p).double()  # [na, V]
        kids = tab.kids[tab.shape[which], cur + 1]  # [na, W]
        has_kids = kids[:, 0] >= 0
        # Leaves (bonus token) and nodes with one-hot children take the plain sampler's draw of
        # this position; a one-hot child is followed when its token is that draw.
        plain_rows = ~has_kids | tab.deterministic[which]
        plain = torch.full((na,), -1, dtype=torch.long)
        if bool(plain_rows.any()):
            sel = plain_rows.nonzero().squeeze(1)
            plain[sel] = inverse_cdf(q[sel], level_coins(act[sel], 0, 1)[:, 0])
        kid_tokens = tab.tokens[which[:, None], kids.clamp(min=0)]  # [na, W]
        match = (kids >= 0) & (kid_tokens == plain[:, None]) & plain_rows[:, None]
        accepted = torch.where(match.any(1), kids.gather(1, match.int().argmax(1, keepdim=True)).squeeze(1), -1)
        tested = has_kids & ~plain_rows  # children drawn from a distribution: the sequential test
        if bool(tested.any()):
            r = q.clone()  # what is left of the target distribution
            coins = level_coins(act, STREAM_ACCEPT, kids.shape[1])
            excluded = torch.zeros(na, vocab, dtype=torch.bool)
            rows = ar[:na]
            for j in range(kids.shape[1]):
                c = kids[:, j]
                live = (c >= 0) & (accepted < 0) & tested
                if not bool(live.any()):
                    break
                cc = c.clamp(min=0)
                x = tab.tokens[which, cc]
                p = tab.dists[tab.dist_index[which, cc].clamp(min=0)].clone()  # [na, V] the child's proposal
                wor = tab.without_replacement[which]
                if bool((wor & excluded.any(1)).any()):
                    p[wor] = p[wor].masked_fill(excluded[wor], 0.0)
                    p[wor] = p[wor] / p[wor].sum(1, keepdim=True).clamp(min=1e-300)
                px, rx = p[rows, x], r[rows, x]
                ok = live & (px > 0) & (coins[:, j] * px <= rx)  # accept with min(1, r(x) / p(x))
                accepted[ok] = c[ok]
                rej = live & ~ok
                if bool(rej.any()):
                    left = (r[rej] - p[rej]).clamp_(min=0.0)
                    mass = left.sum(1, keepdim=True)
                    # mass 0 means r == p: a rejection of probability 0 (rounding); keep r then.
                    r[rej] = torch.where(mass > 0, left / mass.clamp(min=1e-300), r[rej])
                    excluded[rows[rej], x[rej]] = True
        stop = accepted < 0
        drawn = plain
        recover = stop & tested  # every sampled child rejected: draw from what is left of q
        if bool(recover.any()):
            sel = recover.nonzero().squeeze(1)
            drawn = plain.clone()
            drawn[sel] = inverse_cdf(r[sel], level_coins(act[sel], STREAM_RECOVER, 1)[:, 0])
        emitted[act, depth] = torch.where(stop, drawn, tab.tokens[which, accepted.clamp(min=0)])
        node[act] = torch.where(stop, node[act], accepted)
        done[act[stop]] = True
        trail[act[~stop], depth] = accepted[~stop]
    lengths = (emitted >= 0).sum(1).tolist()  # tokens are emitted at depths 0, 1, ... without gaps
    return [(toks[:n], nodes[: n - 1]) for toks, nodes, n in zip(emitted.tolist(), trail.tolist(), lengths)]


def _walk_deterministic(
    target_logits: torch.Tensor, trees: Sequence[DraftTree], starts: Sequence[int], rows_of: Sequence[int],
    meta: SamplingMetadata, generator: torch.Generator | None,
) -> list[tuple[list[int], list[int]]]:
    """_walk_sampled where every tree's children are deterministic candidates (every sampled tree
    since drawn siblings went, and ranked chains): level by level each live walk takes the plain
    sampler's draw of its row, with the same uniforms (stream 0 at its depth), and follows the first
    child holding that token. One draw a level (sampler.draw_tokens: one native call where the
    kernels answer) instead of the tables and a float64 copy of every visited row (SmolLM2, EAGLE
    trees at T 0.7: ~1.2 ms of host time a step)."""
    b = len(trees)
    seeds = [meta.seeds[i] for i in rows_of]
    steps0 = [meta.steps[i] for i in rows_of]
    node = [-1] * b
    walks: list[tuple[list[int], list[int]]] = [([], []) for _ in range(b)]
    live = list(range(b))
    depth = 0
    while live:
        if any(seeds[i] is not None for i in live):
            coins = _coins([seeds[i] for i in live], [steps0[i] + depth for i in live], 0, 1, generator)[:, 0]
        else:
            coins = _shared_coins(len(live), 1, generator)[:, 0]
        rows = target_logits[[starts[i] + node[i] + 1 for i in live]]
        drawn = draw_tokens(rows, meta, coins, torch.tensor([rows_of[i] for i in live], dtype=torch.long))
        still = []
        for i, tok in zip(live, drawn.tolist()):
            tree = trees[i]
            nxt = next((c for c in tree.children[node[i] + 1] if tree.token_ids[c] == tok), None)
            walks[i][0].append(tok)
            if nxt is not None:
                walks[i][1].append(nxt)
                node[i] = nxt
                still.append(i)
        live = still
        depth += 1
    return walks


def _shared_coins(n: int, count: int, generator: torch.Generator | None) -> torch.Tensor:  # [n, count] in (0, 1]
    """What _coins gives when no request is seeded: the same draws from the shared generator."""
    return 1.0 - _rand(n, count, generator)


def _device_of(generator: torch.Generator | None) -> torch.device:
    """Where `generator` draws (the engine's may be a GPU's); the CPU without one."""
    return generator.device if generator is not None else torch.device("cpu")


def _rand(n: int, count: int, generator: torch.Generator | None) -> torch.Tensor:  # [n, count] on the CPU
    """Uniforms in [0, 1) from `generator`, drawn on its device."""
    return torch.rand(n, count, dtype=torch.float64, device=_device_of(generator), generator=generator).cpu()


def _coins(seeds: Sequence[int | None], steps: Sequence[int], stream: int, count: int,
           generator: torch.Generator | None) -> torch.Tensor:  # [len(seeds), count] float64 in (0, 1]
    """Uniforms per request: from the request's (seed + stream, position) generator when seeded
    (so its output does not depend on batching), else from the shared generator."""
    u = _rand(len(seeds), count, generator)
    # A seeded row's generator lives where the engine's does, as in sampler.uniforms: the bonus
    # token of a leaf is then the token a step without a draft would have drawn (a CPU
    # generator draws other numbers than a GPU's from the same seed).
    device = _device_of(generator)
    for i, s in enumerate(seeds):
        if s is not None:
            g = request_generator(s + stream, steps[i], device)
            u[i] = torch.rand(count, dtype=torch.float64, device=device, generator=g).cpu()
    return 1.0 - u
