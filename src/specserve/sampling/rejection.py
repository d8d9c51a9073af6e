"""Exact speculative sampling (Leviathan et al. 2023; Chen et al. 2023), batched over jagged K.

Vocabulary of the docstring, per request with K draft tokens x_1..x_K proposed from draft
distributions p_1..p_K and target distributions q_1..q_{K+1} from one verify pass:

* **accepted** token: draft x_i is kept with probability min(1, q_i(x_i) / p_i(x_i)), tested in
  order; the first failure ends the run.
* **recovered** token: at the first rejected position i, a replacement is drawn from
  normalize(max(0, q_i - p_i)), the part of q that p under-covers.
* **bonus** token: when all K drafts are accepted, one more token is drawn from q_{K+1}
  for free.

So every step emits between 1 and K+1 tokens, and each emitted token is distributed exactly as
the target alone would have sampled it. Both p and q are the *processed* distributions
(temperature, top-k, top-p applied by `logits_to_probs`). A deterministic proposer (n-gram,
reference text) has p = one-hot(x): acceptance then has probability q(x) and the recovered
distribution is q with x removed. Greedy requests are the limit T -> 0: accept while the draft
equals the target argmax, and the argmax at the first mismatch is the recovered token.

**One-hot drafts are coupled to plain sampling.** For p = one-hot(x) the rule above is the
same as: draw the token the plain sampler would draw at this output position (inverse cdf of q
with that position's plain uniform u), keep x if the draw is x, else emit the draw and stop.
P(keep) = q(x), and given a rejection the draw is distributed as q with x removed, so the two
rules emit the same distribution; the second also emits *the same tokens* as decoding without
speculation for the same uniforms. A seeded request drafted by n-gram, lookahead or reference
text, or by a model drafter (which offers seeded requests its likeliest tokens, without their
distribution: `spec.tree.drafts_ranked`), therefore gets the text it gets without speculation,
whatever the adaptive policy decided (which depends on timing). The test "the draw is x" needs
only the mass below x and the total (`mass_around`), not the row's cdf. Unseeded requests'
drawn chains keep the rule above: its acceptance, sum min(p, q), is higher than a drawn token's
coupled to plain sampling, sum p * q, and than the draft's top token's, q(x).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.kernels import row_argmax
from specserve.sampling.sampler import (
    SamplingMetadata,
    inverse_cdf,
    logits_to_probs,
    mass_around,
    sample_from_probs,
    uniforms,
)

# Independent random streams per (seed, output position): the accept test and the recovered
# draw must not reuse the noise that keys the plain (bonus) sample of the same position.
STREAM_ACCEPT = 1 << 40
STREAM_RECOVER = 2 << 40


@dataclass
class SpecBatch:
    """Verify-step inputs for the requests that sample this step (K_i may be 0)."""

    num_draft: list[int]  # K_i per request
    draft_token_ids: list[list[int]]  # per request, K_i ids
    # Per request, draft probabilities [K_i, V] or None for a deterministic (one-hot) proposer.
    draft_probs: list[torch.Tensor | None]
    meta: SamplingMetadata  # one row per request (its params); steps = output index of row 0
    # Alternative to draft_probs when every request has them: all rows stacked, [sum K_i, V].
    flat_draft_probs: torch.Tensor | None = None


@dataclass
class SpecResult:
    """Per request: emitted tokens (accepted drafts + recovered/bonus) and counts."""

    token_ids: list[list[int]]
    num_accepted: list[int]
    logprobs: list[list[float]] | None


def rejection_sample(
    target_logits: torch.Tensor,  # [sum(K_i + 1), V] float32, rows grouped by request
    batch: SpecBatch,
    generator: torch.Generator | None,
    target_argmax: list[int] | None = None,  # the rows' argmax, where the caller has it
) -> SpecResult:
    """Verify every request's drafts at once; returns the tokens each request emits."""
    if batch.meta.all_greedy and not batch.meta.need_logprobs:
        if target_argmax is None:
            target_argmax = row_argmax(target_logits).tolist()
        return greedy_accept(target_argmax, batch.draft_token_ids)
    return _sample_rows(target_logits, batch, generator)


def greedy_accept(target_argmax: list[int], draft_token_ids: list[list[int]]) -> SpecResult:
    """Every request greedy: each keeps its drafts while they equal the target's argmax, then
    emits the argmax of its first mismatching row (recovered) or of its last row (bonus). The
    same rule as `_sample_rows` applies to greedy requests, over one argmax: a verify step of a
    small model (or on a GPU) is short enough that a few dozen tensor ops show in it."""
    out, accepted, row = [], [], 0
    for drafts in draft_token_ids:
        n = 0
        while n < len(drafts) and drafts[n] == target_argmax[row + n]:
            n += 1
        out.append([*drafts[:n], target_argmax[row + n]])
        accepted.append(n)
        row += len(drafts) + 1
    return SpecResult(out, accepted, None)


def _sample_rows(
    target_logits: torch.Tensor,  # [sum(K_i + 1), V] float32, rows grouped by request
    batch: SpecBatch,
    generator: torch.Generator | None,
) -> SpecResult:
    """The rule for any mix of greedy and sampled requests (and logprobs).

    Sampled requests go position by position: at position j only the requests whose drafts so
    far were all accepted need their row as a distribution (temperature, truncation, softmax: a
    pass over the vocabulary each, ~1.5-5 ms for a 152k-id row) to test draft j. Rows are made
    in doubling chunks (1, 2, 4, ... positions) for those requests, so one rejected at its first
    draft costs one row where making all nine rows of a K = 8 chain cost 15 ms at temperature
    0.8 and 60 ms with top-p 0.95 (Qwen2.5's vocabulary, a 2-vCPU Zen 3), and a run of
    acceptances a few batched passes. Every decision reads its own row and its own uniforms
    (keyed by seed and output position for seeded requests), so seeded requests emit what
    making every row first emitted.
    """
    device = target_logits.device
    meta = batch.meta
    n_req = len(batch.num_draft)
    ks = torch.tensor(batch.num_draft, dtype=torch.long, device=device)
    starts = torch.cumsum(ks + 1, 0) - (ks + 1)  # row of each request's position 0
    draft0 = torch.cumsum(ks, 0) - ks  # index of each request's first draft among all drafts
    flat_drafts = torch.tensor([t for ids in batch.draft_token_ids for t in ids] or [0], dtype=torch.long,
                               device=device)
    num_acc = torch.zeros(n_req, dtype=torch.long, device=device)
    last = torch.zeros(n_req, dtype=torch.long, device=device)  # the token emitted at the stop row

    if meta.any_greedy:  # (an empty set of greedy rows passes through as empty tensors)
        # Greedy requests: keep drafts while they equal the target argmax; the argmax of the first
        # mismatching row (or of the bonus row) is emitted.
        g = meta.greedy.nonzero().squeeze(1)
        local, pos = _runs(ks[g] + 1)
        req = g[local]
        am = row_argmax(target_logits.index_select(0, starts[req] + pos))
        is_draft = pos < ks[req]
        miss = ~is_draft | (flat_drafts[torch.where(is_draft, draft0[req] + pos, 0)] != am)
        first = torch.full((g.numel(),), 1 << 30, dtype=torch.long, device=device)
        first = first.scatter_reduce(0, local[miss], pos[miss], reduce="amin")
        num_acc[g] = first
        last[g] = am[pos == first[local]]

    if meta.all_greedy:  # nothing below to do
        return _result(target_logits, batch, starts, num_acc, last)
    live = (~meta.greedy).nonzero().squeeze(1)  # sampled requests whose drafts so far were all kept
    one_hot = torch.tensor(_one_hot_requests(batch), dtype=torch.bool, device=device)
    probs = _draft_prob_rows(batch)  # [sum K_i, V'] or None: row draft0[i] + j is request i's p_j
    vocab = target_logits.shape[-1]
    all_unseeded = all(s is None for s in meta.seeds)

    def draw_u(reqs: torch.Tensor, j: int, stream: int) -> torch.Tensor:  # [len(reqs)] float64
        if all_unseeded:
            return uniforms([None] * reqs.numel(), [0] * reqs.numel(), device, generator, stream)
        rs = reqs.tolist()
        return uniforms([meta.seeds[r] for r in rs], [meta.steps[r] + j for r in rs], device, generator, stream)

    chunk, chunk_row0, chunk_j0, span = target_logits.new_empty(0), ks.new_zeros(n_req), 0, 0
    j = 0
    while live.numel():
        if j >= chunk_j0 + span:  # the next chunk of positions, for the requests still going
            span, chunk_j0 = max(1, 2 * span), j
            local, pos = _runs(torch.clamp(ks[live] + 1 - j, max=span))
            req = live[local]
            chunk = logits_to_probs(
                target_logits.index_select(0, starts[req] + j + pos),
                meta.temperature[req], meta.top_k[req], meta.top_p[req], meta.any_top_k, meta.any_top_p,
                meta.min_p[req], meta.any_min_p,
            )
            chunk_row0[live] = (pos == 0).nonzero().squeeze(1)  # each request's first row in the chunk
        q = chunk.index_select(0, chunk_row0[live] + (j - chunk_j0))  # [len(live), V] position j
        bonus = ks[live] == j
        coupled = one_hot[live] & ~bonus
        tested = ~one_hot[live] & ~bonus
        x = flat_drafts[torch.where(bonus, 0, draft0[live] + j)]
        # The plain sampler's uniform of this output position: bonus rows draw with it, and one-hot
        # drafts are kept where its draw is the draft (a rejection emits that same draw).
        u_plain = torch.zeros(live.numel(), dtype=torch.float64, device=device)
        need = (bonus | coupled).nonzero().squeeze(1)
        if need.numel():
            u_plain[need] = draw_u(live[need], j, 0)
        keep = torch.zeros(live.numel(), dtype=torch.bool, device=device)
        a = coupled.nonzero().squeeze(1)
        if a.numel():
            keep[a] = _coupled_accept(q[a], x[a], u_plain[a])
        b = tested.nonzero().squeeze(1)
        if b.numel():
            # Accept with probability min(1, q/p): u * p <= q avoids dividing by p.
            assert probs is not None
            xb = x[b]
            inside = xb < probs.shape[1]
            p_x = torch.where(inside, probs[draft0[live[b]] + j, xb.clamp(max=probs.shape[1] - 1)], 0.0)
            q_x = q[b].gather(1, xb[:, None]).squeeze(1)
            u = draw_u(live[b], j, STREAM_ACCEPT)
            keep[b] = (u * p_x.double() <= q_x.double()) & (p_x > 0)
        stop = (~keep).nonzero().squeeze(1)
        if stop.numel():
            # Bonus rows and one-hot rejections emit the plain draw; a rejection of a draft with a
            # distribution draws from normalize(max(0, q - p)), q itself if q <= p everywhere (only
            # when q == p, where rejection has probability 0).
            drawn = inverse_cdf(q[stop], u_plain[stop])
            c = tested[stop].nonzero().squeeze(1)
            if c.numel():
                assert probs is not None
                rows = stop[c]
                qs = q[rows]
                ps = probs[draft0[live[rows]] + j, :vocab].to(qs.dtype)
                residual = qs.clone()
                residual[:, : ps.shape[1]] -= ps
                residual.clamp_(min=0)
                mass = residual.sum(dim=-1, keepdim=True)
                residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), qs)
                reqs = live[rows].tolist()
                drawn[c] = sample_from_probs(residual, [meta.seeds[r] for r in reqs],
                                             [meta.steps[r] + j for r in reqs], generator, STREAM_RECOVER)
            num_acc[live[stop]] = j
            last[live[stop]] = drawn
        live = live[keep]
        j += 1

    return _result(target_logits, batch, starts, num_acc, last)


def _result(target_logits: torch.Tensor, batch: SpecBatch, starts: torch.Tensor, num_acc: torch.Tensor,
            last: torch.Tensor) -> SpecResult:
    """Each request's kept drafts and the token of its stop row (num_acc, last: [n_req]), with
    the emitted tokens' logprobs where asked (starts: each request's first logits row)."""
    accepted, ends = num_acc.tolist(), last.tolist()
    out_tokens = [ids[:a] + [t] for ids, a, t in zip(batch.draft_token_ids, accepted, ends)]
    logprobs = None
    if batch.meta.need_logprobs:
        local, pos = _runs(num_acc + 1)
        emitted = torch.tensor([t for toks in out_tokens for t in toks], dtype=torch.long, device=target_logits.device)
        lp = torch.log_softmax(target_logits.index_select(0, starts[local] + pos), dim=-1)
        flat = lp.gather(1, emitted[:, None]).squeeze(1).tolist()
        logprobs, at = [], 0
        for toks in out_tokens:
            logprobs.append(flat[at : at + len(toks)])
            at += len(toks)
    return SpecResult(out_tokens, accepted, logprobs)


def _runs(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [sum(lengths)] each
    """Consecutive runs of the given lengths: each element's run and its position in the run."""
    local = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
    pos = torch.arange(local.numel(), device=lengths.device) - (torch.cumsum(lengths, 0) - lengths)[local]
    return local, pos


def _coupled_accept(q: torch.Tensor, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:  # [N] bool
    """Whether the plain draw (uniform u) of each row of q is its one-hot draft x."""
    lo, total = mass_around(q, x)
    t = u * total
    return (t > lo) & (t <= lo + q.gather(1, x[:, None]).squeeze(1).double())


def _one_hot_requests(batch: SpecBatch) -> list[bool]:
    """Requests whose drafts come without a distribution (a deterministic proposer)."""
    if batch.flat_draft_probs is not None:
        return [False] * len(batch.num_draft)
    return [dp is None for dp in batch.draft_probs]


def _draft_prob_rows(batch: SpecBatch) -> torch.Tensor | None:  # [sum K_i, V'] or None
    """Every draft's distribution, one row per draft in request order (zero rows for requests
    without one, never read); None when no request has distributions."""
    if batch.flat_draft_probs is not None:
        return batch.flat_draft_probs
    given = [dp for dp, k in zip(batch.draft_probs, batch.num_draft) if k and dp is not None]
    if not given:
        return None
    with_drafts = [dp for dp, k in zip(batch.draft_probs, batch.num_draft) if k]
    if len(with_drafts) == 1:  # one request (batch 1): its rows as they are, no copy
        return given[0][: next(k for k in batch.num_draft if k)]
    width = max(dp.shape[-1] for dp in given)
    ref = given[0]
    if len(given) == len(with_drafts) and all(dp.shape[-1] == width for dp in given):
        return torch.cat([dp[:k] for dp, k in zip(batch.draft_probs, batch.num_draft) if k])
    return torch.cat([
        (torch.nn.functional.pad(dp[:k], (0, width - dp.shape[-1])) if dp is not None
         else ref.new_zeros(k, width))
        for dp, k in zip(batch.draft_probs, batch.num_draft) if k
    ])
