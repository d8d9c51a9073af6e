"""Top-k / top-p truncation: the candidate fast path keeps the tokens the plain definition keeps."""

from __future__ import annotations

import pytest
import torch

from specserve.sampling import sampler
from specserve.sampling.sampler import TRUNCATE_CANDIDATES, logits_to_probs

V = 5000


def _by_full_sort(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  tol: float = 1e-5) -> tuple[torch.Tensor, list[bool]]:
    """The kept-token mask the plain definition gives: sort the row, keep its top-k, then the
    shortest prefix of what is left whose mass reaches top_p (in float64); and per row whether
    the cut sits within `tol` of top_p, the rounding of the path tested (either side of it is
    then right)."""
    keep = torch.zeros_like(logits, dtype=torch.bool)
    close = []
    for i in range(logits.shape[0]):
        vals, order = logits[i].double().sort(descending=True)
        k = int(top_k[i]) if int(top_k[i]) > 0 else len(vals)
        p = torch.softmax(vals[:k], dim=0)
        before = p.cumsum(0) - p
        n = int((before < top_p[i]).sum()) if top_p[i] < 1 else k
        keep[i, order[: max(n, 1)]] = True
        edge = before[max(n - 1, 0) : n + 1]
        close.append(bool(top_p[i] < 1 and ((edge - float(top_p[i])).abs() < tol).any()))
    return keep, close


def _rows(seed: int) -> torch.Tensor:
    """Flat to peaked random rows, LM-like (Zipf) rows, and rows of many equal logits (last 4)."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(4, V, generator=g) * scale for scale in (0.3, 1.0, 3.0, 10.0)]
    zipf = -1.1 * torch.arange(1, V + 1).double().log().float() * 3
    rows.append(torch.stack([zipf[torch.randperm(V, generator=g)] + 0.3 * torch.randn(V, generator=g) for _ in range(4)]))
    rows.append(torch.randint(0, 4, (4, V), generator=g).float())
    return torch.cat(rows)


@pytest.mark.parametrize("seed", range(3))
def test_candidate_path_keeps_the_tokens_a_full_sort_keeps(seed):
    logits = _rows(seed)
    n = logits.shape[0]
    g = torch.Generator().manual_seed(100 + seed)
    choices_k = torch.tensor([0, 1, 5, 50, TRUNCATE_CANDIDATES, TRUNCATE_CANDIDATES + 1, 2000, V])
    choices_p = torch.tensor([1.0, 0.999, 0.95, 0.9, 0.5, 0.1])
    top_k = choices_k[torch.randint(0, len(choices_k), (n,), generator=g)]
    top_p = choices_p[torch.randint(0, len(choices_p), (n,), generator=g)]
    out = sampler._truncate(logits, top_k, top_p, True, True)
    kept = torch.isfinite(out)
    assert torch.equal(out[kept], logits[kept])  # kept logits are unchanged
    ref, close = _by_full_sort(logits, top_k, top_p)
    for i in range(n):
        if i >= n - 4:  # equal logits at the edge may be cut in either order: compare counts
            assert kept[i].sum() == ref[i].sum()
        elif not close[i]:
            assert torch.equal(kept[i], ref[i]), (i, int(top_k[i]), float(top_p[i]))
    assert sum(close) < n // 4  # the comparison is not vacuous
    # Rows through the candidates and rows sorted in full both occur, and a row's result does
    # not depend on the other rows of the batch.
    for i in range(n):
        alone = sampler._truncate(logits[i : i + 1], top_k[i : i + 1], top_p[i : i + 1], True, True)
        assert torch.equal(alone[0], out[i])


def test_top_p_one_keeps_every_token_and_probabilities_sum_to_one():
    logits = torch.randn(3, V) * 20  # so peaked that float mass reaches 1.0 long before the tail
    probs = logits_to_probs(logits, torch.ones(3), torch.zeros(3, dtype=torch.long), torch.ones(3))
    assert (probs > 0).sum(1).tolist() == [int((torch.softmax(r, 0) > 0).sum()) for r in logits]
    assert torch.allclose(probs.sum(1), torch.ones(3))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_min_p_keeps_the_tokens_at_least_min_p_times_as_likely_as_the_likeliest(temperature):
    """vLLM's min_p, after temperature and before top-k / top-p: a token survives iff its
    tempered probability is >= min_p x the largest; the survivors are renormalised; 0 is off."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 500, generator=g) * 3
    min_p = torch.tensor([0.0, 0.01, 0.1, 0.3, 0.9, 1.0])
    temp = torch.full((6,), temperature)
    off = torch.zeros(6, dtype=torch.long)
    ones = torch.ones(6)
    got = logits_to_probs(logits, temp, off, ones, False, False, min_p)
    full = torch.softmax(logits / temperature, dim=-1)
    for row in range(6):
        keep = full[row] >= min_p[row] * full[row].max()
        assert torch.equal(got[row] > 0, keep), row
        assert torch.allclose(got[row][keep], full[row][keep] / full[row][keep].sum(), atol=1e-6)
    assert torch.allclose(got[0], full[0])  # min_p 0: untouched
    assert int((got[5] > 0).sum()) == 1  # min_p 1: the likeliest only
    # Before top-k: top-k counts among what min_p kept.
    both = logits_to_probs(logits, temp, torch.full((6,), 3), ones, True, False, min_p)
    for row in range(6):
        assert int((both[row] > 0).sum()) == min(3, int((got[row] > 0).sum()))


def test_wide_nuclei_are_cut_by_buckets_as_a_full_sort_cuts_them():
    """Rows whose nucleus runs past the candidates (temperature-1-like rows of a 32k vocabulary)
    are cut by log-probability buckets, not sorted: the same tokens as the definition, the same
    count where equal logits straddle the cut, and a row's cut does not depend on its batch."""
    g = torch.Generator().manual_seed(7)
    vocab = 32768
    rows = [torch.randn(3, vocab, generator=g) * s for s in (0.5, 1.0, 2.0, 4.0)]
    zipf = -0.9 * torch.arange(1, vocab + 1).double().log().float()
    rows.append(torch.stack([zipf[torch.randperm(vocab, generator=g)] for _ in range(3)]))
    rows.append(torch.randint(0, 200, (3, vocab), generator=g).float() / 50)  # ~160 ties per value
    logits = torch.cat(rows)
    n = logits.shape[0]
    top_p = torch.tensor([0.5, 0.9, 0.95, 0.999])[torch.arange(n) % 4]
    top_k = torch.zeros(n, dtype=torch.long)
    cut, done = sampler._nucleus_by_buckets(logits, top_p)
    out = sampler._truncate(logits, top_k, top_p, False, True)
    kept = torch.isfinite(out)
    wide = kept.sum(1) > TRUNCATE_CANDIDATES
    assert int(wide.sum()) >= n - 3 and bool(done[wide].all())  # the bucket path did the work
    assert torch.equal(out[wide], cut[wide])
    # Float32 bucket sums and a float64 running mass: within ~1e-7 of the exact cut.
    ref, close = _by_full_sort(logits, top_k, top_p, tol=1e-6)
    assert sum(close) <= n // 3  # the comparison is not vacuous
    for i in range(n):
        if i >= n - 3:
            assert kept[i].sum() == ref[i].sum(), i
        elif not close[i]:
            assert torch.equal(kept[i], ref[i]), (i, float(top_p[i]))
    for i in range(n):
        alone = sampler._truncate(logits[i : i + 1], top_k[i : i + 1], top_p[i : i + 1], False, True)
        assert torch.equal(alone[0], out[i])


def test_every_bit_of_a_seed_changes_what_it_draws():
    """A seed keys its request's draws by output position; seeds that differ only in their high
    bits, or a negative seed and a large positive one, draw different noise, and so do a seed's
    streams (torch's CPU generator keeps 32 bits of its seed: before, seeds 1 and 2**32 + 1 drew
    the same tokens, and a speculative step's accept coin was its recovery draw)."""
    cpu = torch.device("cpu")

    def draw(seed: int, step: int) -> list[float]:
        return torch.rand(8, generator=sampler.request_generator(seed, step, cpu)).tolist()

    pairs = [(1, 2**32 + 1), (2, 2**33 + 2), (-1, 2**63 - 1), (-1, 2**32 - 1), (0, 2**62), (5, -5)]
    for a, b in pairs:
        assert draw(a, 0) != draw(b, 0), (a, b)
        assert draw(a, 3) != draw(b, 3), (a, b)
    assert draw(7, 2) == draw(7, 2) and draw(7, 2) != draw(7, 3)
    # a seed's streams (plain draw, accept coins, recovery draw of one position) are apart
    from specserve.sampling.rejection import STREAM_ACCEPT, STREAM_RECOVER

    for seed in (0, 7, 2**31, -3):
        assert len({tuple(draw(seed + stream, 4)) for stream in (0, STREAM_ACCEPT, STREAM_RECOVER)}) == 3
    # seeds below 2**32 draw what they always drew (users' seeded outputs stay reproducible)
    g = torch.Generator().manual_seed((7 * 0x9E3779B97F4A7C15 + 2 * 0x2545F4914F6CDD1D + 1) & ((1 << 63) - 1))
    assert draw(7, 2) == torch.rand(8, generator=g).tolist()
    keys = {tuple(draw(s, t)) for s in range(-20, 20) for t in range(20)}
    assert len(keys) == 40 * 20  # no two (seed, position) pairs alike
