"""Batched token sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

The same `logits_to_probs` turns logits into the distribution a request samples from; the
speculative rejection sampler applies it to both target and draft logits, so the acceptance
test compares exactly the distributions the user asked for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from specserve.kernels import (
    native_inverse_cdf,
    native_sample,
    native_truncation,
    row_argmax,
    row_topk,
)
from specserve.sampling_params import GREEDY_EPS, SamplingParams

_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant (golden ratio) to spread (seed, step) pairs
_M64 = (1 << 64) - 1
_M32 = (1 << 32) - 1


def _mix64(x: int) -> int:
    """SplitMix64's finalizer: every output bit depends on every input bit."""
    x &= _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _fold(seed: int) -> int:
    """A 64-bit seed (negative ones as their two's complement) in 32 bits, every bit counting:
    the high half, mixed, flips the low half. Seeds in [0, 2**32) are kept as they are, so their
    draws are what they always were."""
    key = seed & _M64
    high = key >> 32
    return (key & _M32) ^ (_mix64(high) & _M32) if high else key


def request_generator(seed: int, step: int, device: torch.device) -> torch.Generator:
    """A generator keyed by (seed, output position), so a seeded request draws the same noise
    for its t-th token however it is batched, chunked or preempted.

    torch's CPU generator keeps only the low 32 bits of what it is seeded with, and the key below
    spreads a seed's low bits only into them; the seed is folded to 32 bits first so that its
    high bits count. Before, seeds equal in their low 32 bits drew the same tokens, and so did
    the streams a seed draws apart (seed + STREAM_ACCEPT / STREAM_RECOVER, multiples of 2**40):
    a speculative step's accept coin, its recovery draw and the plain draw of one position were
    one number, correlated, on the CPU."""
    g = torch.Generator(device=device)
    g.manual_seed((_fold(seed) * _MIX + step * 0x2545F4914F6CDD1D + 1) & ((1 << 63) - 1))
    return g


class _AsTensor:
    """A SamplingMetadata setting as a tensor on its device, made on first read and kept."""

    def __init__(self, source: str, dtype: torch.dtype) -> None:
        self.source, self.dtype = source, dtype

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, meta: SamplingMetadata | None, owner: type | None = None) -> torch.Tensor:
        if meta is None:
            return self  # type: ignore[return-value]
        tensor = meta.__dict__[self.name] = torch.tensor(getattr(meta, self.source), dtype=self.dtype, device=meta.device)
        return tensor


@dataclass
class SamplingMetadata:
    """Per-row sampling settings for one step: the flags as they are, the settings as tensors on
    `device`, made when first read. (A greedy step reads none of them: its rows are argmaxed. Made
    up front, the five tensors were ~50 us of every SmolLM2 step's ~0.5 ms of host time on a
    2-vCPU Zen 4, tensor calls being slow on caches a forward has just swept.)"""

    temperatures: tuple[float, ...]  # 0 for greedy rows
    top_ks: tuple[int, ...]  # 0 = off
    top_ps: tuple[float, ...]  # 1 = off
    min_ps: tuple[float, ...]  # 0 = off
    greedies: tuple[bool, ...]
    seeds: list[int | None]
    steps: list[int]  # output position each row samples (keys the seeded generators)
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    need_logprobs: bool
    any_min_p: bool = False
    any_greedy: bool = True
    device: torch.device = torch.device("cpu")

    temperature = _AsTensor("temperatures", torch.float32)  # [N]
    top_k = _AsTensor("top_ks", torch.long)  # [N]
    top_p = _AsTensor("top_ps", torch.float32)  # [N]
    min_p = _AsTensor("min_ps", torch.float32)  # [N]
    greedy = _AsTensor("greedies", torch.bool)  # [N]

    def to(self, device: torch.device) -> SamplingMetadata:
        """The same settings with their tensors on `device`."""
        return dataclasses.replace(self, device=device)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        steps: list[int],
        device: torch.device,
    ) -> SamplingMetadata:
        """Collect per-row settings (one row per token to sample)."""
        temps = tuple(0.0 if p.is_greedy else float(p.temperature) for p in params)
        top_k = tuple(p.effective_top_k for p in params)
        top_p = tuple(float(p.top_p) for p in params)
        min_p = tuple(float(p.min_p) for p in params)
        greedy = tuple(p.is_greedy for p in params)
        return cls(
            temperatures=temps,
            top_ks=top_k,
            top_ps=top_p,
            min_ps=min_p,
            greedies=greedy,
            seeds=[p.seed for p in params],
            steps=list(steps),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            any_top_k=any(k > 0 for k, g in zip(top_k, greedy) if not g),
            any_top_p=any(p < 1.0 for p, g in zip(top_p, greedy) if not g),
            need_logprobs=any(p.logprobs for p in params),
            any_min_p=any(p > 0.0 for p, g in zip(min_p, greedy) if not g),
            device=device,
        )


def process_logits(
    logits: torch.Tensor,  # [N, V] float32
    temperature: torch.Tensor,  # [N]; rows with 0 are treated as 1 (callers argmax them)
    top_k: torch.Tensor,  # [N] int64, 0 = off
    top_p: torch.Tensor,  # [N] float32
    any_top_k: bool = True,
    any_top_p: bool = True,
    min_p: torch.Tensor | None = None,  # [N] float32, 0 = off
    any_min_p: bool = True,
    probs: bool = False,
) -> torch.Tensor:  # [N, V] logits, -inf where truncated (probs: their softmax)
    """Temperature, then min-p, then top-k, then top-p (nucleus) truncation (vLLM's order): the
    logits whose softmax a token is drawn from, a new tensor (with `probs`, that softmax). Min-p
    keeps the tokens whose probability is at least min_p times the likeliest one's: logit >= max
    logit + log(min_p), after temperature."""
    temp = torch.where(temperature < GREEDY_EPS, torch.ones_like(temperature), temperature)
    # Natively where the kernels answer (one pass or two over a row instead of a dozen tensor
    # operations: 152k-id rows at top_p 0.9, ~1.2 ms each by torch); the flags say which settings count.
    off = torch.zeros_like(temp)
    native = native_truncation(logits, temp, top_k if any_top_k else off.long(), top_p if any_top_p else off + 1.0,
                               min_p if min_p is not None and any_min_p else off, probs)
    if native is not None:
        return native
    logits = logits / temp[:, None]
    if min_p is not None and any_min_p:
        floor = logits.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]  # log(0) = -inf: off
        logits = logits.masked_fill(logits < floor, float("-inf"))
    if any_top_k or any_top_p:
        logits = _truncate(logits, top_k, top_p, any_top_k, any_top_p)
    return torch.softmax(logits, dim=-1) if probs else logits


_UNTRUNCATED = SamplingParams(temperature=0.0)  # a greedy row's settings: no top-k, top-p or min-p


def processed_rows(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:  # [N, V], one request per row
    """Rows as logprobs_mode processed_* reports them: each through its request's temperature,
    min-p, top-k and top-p (`process_logits`); a greedy request's row unchanged (vLLM's greedy
    rows: no temperature, no truncation, whatever top_k / top_p it carries)."""
    meta = SamplingMetadata.build([_UNTRUNCATED if p.is_greedy else p for p in params], [0] * len(params),
                                  logits.device)
    return process_logits(logits, meta.temperature, meta.top_k, meta.top_p, meta.any_top_k, meta.any_top_p,
                          meta.min_p, meta.any_min_p)


def logits_to_probs(logits: torch.Tensor, *settings: object, **flags: object) -> torch.Tensor:  # [N, V] probabilities
    """The distribution a token is drawn from: the softmax of `process_logits` (same arguments)."""
    return process_logits(logits, *settings, probs=True, **flags)  # type: ignore[arg-type, misc]


# Top-k / top-p first look at this many best tokens per row (torch.topk, linear in the
# vocabulary) instead of sorting the whole row: a full sort of a 49k vocabulary cost 23% of a
# sampled batch's wall time. Rows whose nucleus does not fit among them are sorted in full.
TRUNCATE_CANDIDATES = 256


def _truncate(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, any_top_k: bool, any_top_p: bool
) -> torch.Tensor:
    """Logits with the tokens outside each row's top-k and nucleus set to -inf (top_p >= 1: no
    nucleus).

    The kept set is a prefix of the row in descending order, so it is decided among the best
    TRUNCATE_CANDIDATES tokens when it ends there: the row's top-k is at most that many, or its
    nucleus closes within them (the mass before the last candidate reaches top_p). Other rows
    are sorted in full. Both paths compute the same masses with the same operations in the same
    order (`_nucleus`), so they keep the same tokens, and which path a row takes depends on that
    row alone: a row's result never depends on the rest of the batch. Rows whose nucleus (top-p
    alone) runs past the candidates are cut by log-probability buckets (`_nucleus_by_buckets`)
    rather than sorted."""
    vocab = logits.shape[-1]
    k = torch.where((top_k > 0) & any_top_k, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    nucleus = (top_p < 1.0) & any_top_p
    untouched = (k == vocab) & ~nucleus
    c = min(TRUNCATE_CANDIDATES, vocab)
    cand, idx = logits.topk(c, dim=-1)  # descending
    stats = _RowStats.of(logits) if bool(nucleus.any()) else None
    remove = _nucleus(logits, cand, k, top_p, nucleus, stats)
    fits = (k <= c) | (remove[:, -1] & (k == vocab))  # top-k, or the nucleus, ends among the candidates
    out = torch.full_like(logits, float("-inf")).scatter_(-1, idx, cand.masked_fill(remove, float("-inf")))
    if bool(untouched.any()):
        out[untouched] = logits[untouched]
    rest = ~fits & ~untouched
    by_mass = (rest & nucleus & (k == vocab)).nonzero().squeeze(1)  # top-p alone, nucleus past the candidates
    if by_mass.numel():
        whole = by_mass.numel() == logits.shape[0]  # every row (T = 1, top_p 0.95: often): no row copies
        assert stats is not None
        cut, done = (_nucleus_by_buckets(logits, top_p, stats) if whole else
                     _nucleus_by_buckets(logits[by_mass], top_p[by_mass], stats.rows(by_mass)))
        if whole and bool(done.all()):
            return cut
        out[by_mass[done]] = cut[done]
        rest[by_mass[done]] = False
    rest = rest.nonzero().squeeze(1)
    if rest.numel():
        sub = logits[rest]
        sorted_logits, order = sub.sort(dim=-1, descending=True)
        drop = _nucleus(sub, sorted_logits, k[rest], top_p[rest], nucleus[rest],
                        stats.rows(rest, with_e=False) if stats else None)
        out[rest] = torch.empty_like(sub).scatter_(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return out


# The nucleus of a row past the candidates, found without sorting the row: buckets of
# log-probability below the row's likeliest token, this many per nat and this many in all (the
# last also holds everything lower).
NUCLEUS_BUCKETS_PER_NAT = 128
NUCLEUS_BUCKETS = 4096


class _RowStats(NamedTuple):
    """Per row: the largest logit, e^(logit - largest) and the sum of those, computed once for the
    candidates' normaliser and the buckets' masses (each pass over a 49k row costs as much as the
    cut itself)."""

    row_max: torch.Tensor  # [N]
    e: torch.Tensor | None  # [N, V] (None where only the normaliser is wanted)
    total: torch.Tensor  # [N]

    @classmethod
    def of(cls, logits: torch.Tensor) -> _RowStats:
        row_max = logits.max(dim=-1).values
        e = (logits - row_max[:, None]).exp()
        return cls(row_max, e, e.sum(-1))

    def rows(self, idx: torch.Tensor, with_e: bool = True) -> _RowStats:
        """The stats of rows `idx` (e copied only with_e: the sorted rows' normaliser needs none)."""
        return _RowStats(self.row_max[idx], self.e[idx] if with_e and self.e is not None else None, self.total[idx])


def _nucleus_by_buckets(logits: torch.Tensor, top_p: torch.Tensor,
                        stats: _RowStats | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p of rows whose nucleus is too wide for the candidates, without a full sort.

    The probabilities go into buckets by log-probability. The bucket where the running mass
    (likeliest first) reaches top_p is the only one whose tokens need ordering: every bucket
    above it is kept whole, every one below dropped. Returns the truncated logits and, per row,
    whether the cut was found this way; the caller sorts the other rows (the cut fell in the
    last bucket, or its bucket holds too many tokens to order cheaply).

    Within the cut's bucket tokens go by descending logit, equal logits by ascending id, so the
    kept set is a function of the row alone. Bucket masses are float32 sums and the running mass
    is float64: a full sort's float32 running sum can differ from this only where the mass lands
    within rounding of top_p. Why: a full sort of a 49k vocabulary costs ~1.5 ms a row on one
    core, and about half the rows of a real model at temperature 1 and top_p 0.95 need it
    (SmolLM2, prose and code prompts)."""
    n = logits.shape[0]
    last = NUCLEUS_BUCKETS - 1
    stats = stats if stats is not None and stats.e is not None else _RowStats.of(logits)
    gap = stats.row_max[:, None] - logits  # nats below the likeliest token
    # int32 bucket ids (scatter and gather take them): half the bytes of int64 in the passes below.
    # (A NaN gap, from a NaN or infinite logit, goes to the last bucket: an index, not a crash.)
    bucket = gap.mul_(NUCLEUS_BUCKETS_PER_NAT).nan_to_num_(nan=float(last)).clamp_(max=last).to(torch.int32)
    probs = stats.e / stats.total[:, None]  # e^(logit - max) is e^-(gap) exactly: a - b = -(b - a)
    mass = torch.zeros(n, NUCLEUS_BUCKETS, dtype=probs.dtype, device=probs.device).scatter_add_(1, bucket, probs)
    through = mass.double().cumsum(-1)
    tp = top_p.double()[:, None]
    cut = (through < tp).sum(-1).clamp_(max=last)  # the first bucket whose running mass reaches top_p
    before = torch.where(cut > 0, through.gather(1, (cut - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    cut32 = cut.to(torch.int32)[:, None]  # compared as int32: no int64 copy of the bucket ids
    in_cut = bucket == cut32
    count = in_cut.sum(-1)
    done = (cut < last) & (count <= 4 * TRUNCATE_CANDIDATES)
    width = int(count[done].max()) if bool(done.any()) else 1
    # The cut bucket's tokens by descending logit, then ascending id (ids sorted first, then a
    # stable sort by value), each with the mass before it.
    ids = logits.masked_fill(~in_cut, float("-inf")).topk(width, dim=-1).indices.sort(dim=-1).values
    ids = ids.gather(1, logits.gather(1, ids).sort(dim=-1, descending=True, stable=True).indices)
    member = in_cut.gather(1, ids)
    p = probs.gather(1, ids).double().masked_fill(~member, 0.0)
    keep = bucket < cut32
    keep.scatter_(1, ids, keep.gather(1, ids) | (member & (before[:, None] + p.cumsum(-1) - p < tp)))
    return logits.masked_fill(~keep, float("-inf")), done


def _nucleus(logits: torch.Tensor, desc: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor,
             nucleus: torch.Tensor, stats: _RowStats | None = None) -> torch.Tensor:
    """Which of `desc` (a row's best values, descending: the top candidates or the whole sorted
    row) top-k (k: tokens it keeps, the vocabulary when off) and top-p remove; never the first.
    A token is dropped when the mass strictly before it already reaches top_p; the mass is of the
    row after top-k, normalised over the kept top-k when k is within the candidates, else over
    the whole row (a k between the two only happens on the sorted path, over all of desc)."""
    n = desc.shape[-1]
    remove = torch.arange(n, device=desc.device)[None, :] >= k[:, None]
    if bool(nucleus.any()):
        c = min(TRUNCATE_CANDIDATES, logits.shape[-1])
        kept = desc.masked_fill(remove, float("-inf"))
        stats = stats if stats is not None else _RowStats.of(logits)
        whole = stats.row_max + stats.total.log()
        norm = torch.where(k <= c, kept[:, :c].logsumexp(-1), torch.where(k == logits.shape[-1], whole, kept.logsumexp(-1)))
        probs = (kept - norm[:, None]).exp()
        mass_before = probs.cumsum(dim=-1) - probs
        remove |= (mass_before >= top_p[:, None]) & nucleus[:, None]
    remove[:, 0] = False
    return remove


def uniforms(
    seeds: list[int | None], steps: list[int], device: torch.device,
    generator: torch.Generator | None, stream: int = 0,
) -> torch.Tensor:  # [N] float64 in (0, 1]
    """One uniform per row; seeded rows draw from their own (seed + stream, step) generator."""
    u = torch.rand(len(seeds), dtype=torch.float64, device=device, generator=generator)
    if all(s is None for s in seeds):
        return 1.0 - u
    for i, s in enumerate(seeds):
        if s is not None:
            g = request_generator(s + stream, steps[i], device)
            u[i] = torch.rand(1, dtype=torch.float64, device=device, generator=g)[0]
    return 1.0 - u  # (0, 1]: never lands on a zero-probability token at the start of the cdf


def draw_tokens(logits: torch.Tensor, meta: SamplingMetadata, u: torch.Tensor,
                rows: torch.Tensor | None = None) -> torch.Tensor:  # [N, V], [N] -> [N] int64
    """The token plain sampling draws from each row of `logits` with the uniforms u, under meta's
    settings (or those of meta's rows `rows`): inverse_cdf(logits_to_probs(...), u). One native
    call where the kernels answer (the same token bit for bit, without the [N, V] probabilities:
    SmolLM2 at T 0.7 / top_p 0.9, ~0.3 -> ~0.1 ms of a 3.7 ms decode step), else the two steps.
    A greedy row's own top-k / top-p / min-p may differ from what process_logits passes it; the
    callers replace a greedy row's draw by its argmax."""
    t, k, p, mp = meta.temperature, meta.top_k, meta.top_p, meta.min_p
    if rows is not None:
        t, k, p, mp = t[rows], k[rows], p[rows], mp[rows]
    native = native_sample(logits, t, k, p, mp, u, GREEDY_EPS)
    if native is not None:
        return native
    return inverse_cdf(logits_to_probs(logits, t, k, p, meta.any_top_k, meta.any_top_p, mp, meta.any_min_p), u)


def sample_from_probs(
    probs: torch.Tensor,  # [N, V]
    seeds: list[int | None],
    steps: list[int],
    generator: torch.Generator | None,
    stream: int = 0,
) -> torch.Tensor:  # [N] int64
    """Inverse-CDF draw, one uniform per row: the first token whose cumulative mass reaches u.

    The cumulative sum is taken in float64 so rounding cannot shift mass between tokens, and
    a token with zero probability can never be returned (its cdf equals its predecessor's).
    """
    return inverse_cdf(probs, uniforms(seeds, steps, probs.device, generator, stream))


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:  # [N, V], [N] in (0, 1] -> [N] int64
    """The first token whose cumulative mass (float64) reaches u times the row's total."""
    native = native_inverse_cdf(probs, u)  # the same index without a float64 copy of the row
    if native is not None:
        return native
    cdf = probs.double().cumsum(dim=-1)
    return torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1)).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def mass_around(probs: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [N, V], [N]
    """Per row, in float64: the mass of the ids below x[i] and the row's total, so that
    `inverse_cdf(probs, u)` returns x[i] exactly when lo < u * total <= lo + probs[i, x[i]]
    (up to the last bit of the summation order). Without a cdf of the whole row: a few rows
    (a chain's drafts over a 152k vocabulary) take one slice sum each; many rows (tests, a
    small vocabulary) one masked sum."""
    if probs.shape[0] <= 64:
        xs = x.tolist()
        lo = torch.stack([probs[i, :t].sum(dtype=torch.float64) for i, t in enumerate(xs)])
        rest = torch.stack([probs[i, t:].sum(dtype=torch.float64) for i, t in enumerate(xs)])
        return lo, lo + rest
    below = torch.arange(probs.shape[1], device=probs.device)[None, :] < x[:, None]
    lo = torch.where(below, probs, 0.0).sum(1, dtype=torch.float64)
    return lo, lo + torch.where(below, 0.0, probs).sum(1, dtype=torch.float64)


def top_logprobs(
    logp: torch.Tensor,  # [N, V] log-probabilities
    k: int,
) -> list[list[tuple[int, float]]]:  # per row: k (token id, logprob) pairs, most likely first
    """The k most likely tokens of each row (of the rows the runner's logprobs_mode says; natively
    where the kernels are loaded: torch's top-k took ~0.4 ms a 152k-id row)."""
    values, ids, _ = row_topk(logp.float(), k)
    return [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]


class Sampler:
    """Turns the logits of the rows that need a token into token ids (and logprobs)."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, meta: SamplingMetadata  # logits: [N, V] float32
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # ([N] token ids, [N] logprobs or None)
        """Sample one token per row."""
        if meta.all_greedy:
            tokens = row_argmax(logits)
        else:
            sampled = draw_tokens(logits, meta, uniforms(meta.seeds, meta.steps, logits.device, self.generator))
            # Greedy rows beside sampled ones take their argmax (a pass over every row: skipped
            # when none is greedy, as in a batch of chat requests).
            tokens = torch.where(meta.greedy, row_argmax(logits), sampled) if meta.any_greedy else sampled
        logprobs = None
        if meta.need_logprobs:
            # Logprobs of the rows as given, before temperature / truncation: logprobs_mode
            # raw_logprobs where no processor changed a row (the runner replaces the others).
            logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
        return tokens, logprobs
