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
text therefore gets the text it gets without speculation, whatever the adaptive policy decided
(which depends on timing). The test "the draw is x" needs only the mass below x and the total
(`mass_around`), not the row's cdf. Proposals with a distribution (a draft model) keep the
rule above: its acceptance, sum min(p, q), is higher than a coupled draw's, sum p * q.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


def _expand(t: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return t.repeat_interleave(counts, dim=0)


def rejection_sample(
    target_logits: torch.Tensor,  # [sum(K_i + 1), V] float32, rows grouped by request
    batch: SpecBatch,
    generator: torch.Generator | None,
    target_argmax: list[int] | None = None,  # the rows' argmax, where the caller has it
) -> SpecResult:
    """Verify every request's drafts at once; returns the tokens each request emits."""
    if batch.meta.all_greedy and not batch.meta.need_logprobs:
        if target_argmax is None:
            target_argmax = target_logits.argmax(dim=-1).tolist()
        return greedy_accept(target_argmax, batch.draft_token_ids)
    return _sample_rows(target_logits, batch, generator)


def greedy_accept(target_argmax: list[int], draft_token_ids: list[list[int]]) -> SpecResult:
    """Every request greedy: each keeps its drafts while they equal the target's argmax, then
    emits the argmax of its first mismatching row (recovered) or of its last row (bonus). The
    same rule as the batched path below, in plain Python over one argmax: a verify step of a
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
    """The batched rule for any mix of greedy and sampled requests (and logprobs)."""
    device = target_logits.device
    n_req = len(batch.num_draft)
    ks = torch.tensor(batch.num_draft, dtype=torch.long, device=device)
    rows_per_req = ks + 1
    total_rows = int(rows_per_req.sum())
    meta = batch.meta

    # Row bookkeeping: request index and position j (0..K_i) of every logits row.
    req_of_row = torch.repeat_interleave(torch.arange(n_req, device=device), rows_per_req)
    starts = torch.cumsum(rows_per_req, 0) - rows_per_req
    pos_of_row = torch.arange(total_rows, device=device) - starts[req_of_row]
    is_draft_row = pos_of_row < ks[req_of_row]  # rows that verify a draft token

    # Draft token of each draft row (-1 padding on bonus rows).
    flat_drafts = torch.full((total_rows,), -1, dtype=torch.long, device=device)
    draft_ids = [t for ids in batch.draft_token_ids for t in ids]
    if draft_ids:
        flat_drafts[is_draft_row] = torch.tensor(draft_ids, dtype=torch.long, device=device)

    greedy_row = _expand(meta.greedy, rows_per_req)
    target_argmax = target_logits.argmax(dim=-1)

    # --- greedy: accept while the draft equals the target argmax.
    accept = (flat_drafts == target_argmax) & is_draft_row

    if not meta.all_greedy:
        q = logits_to_probs(
            target_logits,
            _expand(meta.temperature, rows_per_req),
            _expand(meta.top_k, rows_per_req),
            _expand(meta.top_p, rows_per_req),
            meta.any_top_k,
            meta.any_top_p,
            _expand(meta.min_p, rows_per_req),
            meta.any_min_p,
        )  # [rows, V]
        p = _draft_probs_rows(batch, q, flat_drafts, is_draft_row)  # [rows, V], 0 on bonus rows
        safe_draft = flat_drafts.clamp(min=0)
        q_x = q.gather(1, safe_draft[:, None]).squeeze(1)
        p_x = p.gather(1, safe_draft[:, None]).squeeze(1)
        u = _uniforms(meta, req_of_row, pos_of_row, device, generator)
        # Accept with probability min(1, q/p): u * p <= q avoids dividing by p.
        sampled_accept = (u * p_x.double() <= q_x.double()) & (p_x > 0) & is_draft_row
        # One-hot drafts: keep x where the plain sampler's draw at that position is x. The plain
        # uniforms are drawn for these rows and (below) for the other stop rows only.
        u_plain = torch.empty(total_rows, dtype=torch.float64, device=device)
        coupled_row = is_draft_row & ~greedy_row & _expand(_one_hot_requests(batch, device), rows_per_req)
        if bool(coupled_row.any()):
            rows = coupled_row.nonzero().squeeze(1)
            u_plain[rows] = _uniforms(meta, req_of_row[rows], pos_of_row[rows], device, generator, stream=0)
            sampled_accept[rows] = _coupled_accept(q, rows, flat_drafts[rows], u_plain[rows], req_of_row[rows])
        accept = torch.where(greedy_row, accept, sampled_accept)

    # A request stops at its first rejected draft row, or at its bonus row if none is rejected;
    # the stop position is its number of accepted drafts.
    stop = (is_draft_row & ~accept) | ~is_draft_row
    big = torch.full((n_req,), total_rows, dtype=torch.long, device=device)
    num_acc_t = big.scatter_reduce(0, req_of_row[stop], pos_of_row[stop], reduce="amin")
    acc_of_row = num_acc_t[req_of_row]
    final = target_argmax  # token emitted if a row is the stop (greedy: its argmax)
    if not meta.all_greedy:
        # Only a request's stop row emits a drawn token, so only those rows are drawn from (a
        # 152k-id row's float64 residual and cdf cost ~1 ms; a K = 8 chain has nine rows).
        at_stop = (pos_of_row == acc_of_row).nonzero().squeeze(1)  # [n_req]
        qs = q[at_stop]
        # Bonus (and K=0) rows and one-hot rejections: the plain sampler's draw for that output
        # position, so a request that does not speculate samples exactly as it would without.
        # A one-hot rejection reuses the uniform its test used (unseeded, a new one would not do).
        fresh = at_stop[~coupled_row[at_stop]]
        if fresh.numel():
            u_plain[fresh] = _uniforms(meta, req_of_row[fresh], pos_of_row[fresh], device, generator, stream=0)
        plain = inverse_cdf(qs, u_plain[at_stop])
        recover = is_draft_row[at_stop] & ~coupled_row[at_stop]
        drawn = plain
        if bool(recover.any()):
            ps = p[at_stop]
            # Recovered distribution normalize(max(0, q - p)); if q <= p everywhere (can only
            # happen when q == p, where rejection has probability 0) fall back to q.
            residual = (qs - ps).clamp_(min=0)
            mass = residual.sum(dim=-1, keepdim=True)
            residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), qs)
            seeds_row, steps_row = _row_seeds(meta, req_of_row[at_stop], pos_of_row[at_stop])
            recovered = sample_from_probs(residual, seeds_row, steps_row, generator, STREAM_RECOVER)
            drawn = torch.where(recover, recovered, plain)
        final = target_argmax.clone()
        final[at_stop] = torch.where(greedy_row[at_stop], target_argmax[at_stop], drawn)
    emitted_mask = pos_of_row <= acc_of_row
    emitted = torch.where(pos_of_row < acc_of_row, flat_drafts, final)[emitted_mask]
    num_acc = num_acc_t.tolist()
    flat = emitted.tolist()
    out_tokens: list[list[int]] = []
    at = 0
    for a in num_acc:
        out_tokens.append(flat[at : at + a + 1])
        at += a + 1
    logprobs = None
    if meta.need_logprobs:
        lp = torch.log_softmax(target_logits[emitted_mask], dim=-1).gather(1, emitted[:, None]).squeeze(1).tolist()
        logprobs = []
        at = 0
        for a in num_acc:
            logprobs.append(lp[at : at + a + 1])
            at += a + 1
    return SpecResult(out_tokens, num_acc, logprobs)


def _coupled_accept(
    q: torch.Tensor, rows: torch.Tensor, x: torch.Tensor, u: torch.Tensor, req: torch.Tensor
) -> torch.Tensor:  # [len(rows)] bool
    """Whether the plain draw (uniform u) of each one-hot draft row of q is its draft x. A few
    rows (a chain or two) are tested in order and a request's rows after its first miss are
    skipped (never emitted; each row costs a pass over the vocabulary); many rows at once."""
    if rows.numel() > 64:
        lo, total = mass_around(q[rows], x)
        t = u * total
        return (t > lo) & (t <= lo + q[rows, x].double())
    out = torch.zeros(rows.numel(), dtype=torch.bool, device=q.device)
    missed: set[int] = set()
    for i, (r, rq) in enumerate(zip(rows.tolist(), req.tolist())):
        if rq in missed:
            continue
        lo, total = mass_around(q[r : r + 1], x[i : i + 1])
        t = u[i] * total[0]
        hit = bool(t > lo[0]) and bool(t <= lo[0] + q[r, x[i]].double())
        out[i] = hit
        if not hit:
            missed.add(rq)
    return out


def _one_hot_requests(batch: SpecBatch, device: torch.device) -> torch.Tensor:  # [n_req] bool
    """Requests whose drafts come without a distribution (a deterministic proposer)."""
    if batch.flat_draft_probs is not None:
        return torch.zeros(len(batch.num_draft), dtype=torch.bool, device=device)
    return torch.tensor([dp is None for dp in batch.draft_probs], dtype=torch.bool, device=device)


def _draft_probs_rows(
    batch: SpecBatch, q: torch.Tensor, flat_drafts: torch.Tensor, is_draft_row: torch.Tensor
) -> torch.Tensor:  # [rows, V]
    """Draft distribution of every draft row: given probabilities or one-hot(x)."""
    p = torch.zeros_like(q)
    vocab = q.shape[-1]
    draft_rows = is_draft_row.nonzero().squeeze(1)  # [sum K_i]
    if batch.flat_draft_probs is not None:
        probs = batch.flat_draft_probs[:, :vocab].to(q.dtype)
        p[draft_rows, : probs.shape[-1]] = probs
        return p
    given = [dp is not None for dp, k in zip(batch.draft_probs, batch.num_draft) if k]
    if not any(given):  # every proposer deterministic: one-hot rows
        p[draft_rows, flat_drafts[draft_rows]] = 1.0
        return p
    per_req_rows = torch.split(draft_rows, [k for k in batch.num_draft if k])
    if any(given):
        rows = torch.cat([r for r, g in zip(per_req_rows, given) if g])
        probs = torch.cat([
            dp[:k, :vocab] for dp, k in zip(batch.draft_probs, batch.num_draft) if k and dp is not None
        ]).to(q.dtype)
        p[rows, : probs.shape[-1]] = probs
    if not all(given):
        rows = torch.cat([r for r, g in zip(per_req_rows, given) if not g])
        p[rows, flat_drafts[rows]] = 1.0
    return p


def _row_seeds(
    meta: SamplingMetadata, req_of_row: torch.Tensor, pos_of_row: torch.Tensor
) -> tuple[list[int | None], list[int]]:
    if all(seed is None for seed in meta.seeds):
        n = int(req_of_row.shape[0])
        return [None] * n, [0] * n
    reqs = req_of_row.tolist()
    pos = pos_of_row.tolist()
    seeds = [meta.seeds[r] for r in reqs]
    steps = [meta.steps[r] + j for r, j in zip(reqs, pos)]
    return seeds, steps


def _uniforms(
    meta: SamplingMetadata, req_of_row: torch.Tensor, pos_of_row: torch.Tensor,
    device: torch.device, generator: torch.Generator | None, stream: int = STREAM_ACCEPT,
) -> torch.Tensor:  # [rows] float64 U(0, 1]
    seeds, steps = _row_seeds(meta, req_of_row, pos_of_row)
    return uniforms(seeds, steps, device, generator, stream)
