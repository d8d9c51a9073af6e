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


def _native():
    from specserve.kernels import kernels

    return kernels()  # loaded in this process: process_logits and inverse_cdf now take the kernels


def test_native_truncation_keeps_what_the_definition_keeps():
    """With the kernels loaded, process_logits cuts each row natively (one pass for temperature,
    candidates from a sampled threshold, float64 masses, buckets for wide nuclei): the tokens the
    definition keeps, kept logits equal to logits / temperature bit for bit, the same count where
    equal logits straddle the cut, a row's result independent of its batch, and its softmax
    (logits_to_probs) torch's softmax of it within float rounding."""
    k = _native()
    g = torch.Generator().manual_seed(21)
    vocab = 32768
    wide = [torch.randn(2, vocab, generator=g) * s for s in (0.5, 2.0)]
    zipf = -0.9 * torch.arange(1, vocab + 1).double().log().float()
    wide.append(torch.stack([zipf[torch.randperm(vocab, generator=g)] for _ in range(2)]))
    for logits in [_rows(s) for s in range(3)] + [torch.cat(wide)]:
        n, v = logits.shape
        ck = torch.tensor([0, 1, 5, 50, 64, 65, TRUNCATE_CANDIDATES, TRUNCATE_CANDIDATES + 1, 2000, v])
        cp = torch.tensor([1.0, 0.999, 0.95, 0.9, 0.5, 0.1])
        top_k = ck[torch.randint(0, len(ck), (n,), generator=g)]
        top_p = cp[torch.randint(0, len(cp), (n,), generator=g)]
        temp = torch.tensor([0.7, 1.0, 1.3])[torch.randint(0, 3, (n,), generator=g)]
        out, ok = k.truncate_rows(logits, temp, top_k, top_p, torch.zeros(n))
        assert ok and torch.equal(sampler.process_logits(logits, temp, top_k, top_p), out)
        kept = torch.isfinite(out)
        tempered = logits / temp[:, None]
        assert torch.equal(out[kept], tempered[kept])
        ref, close = _by_full_sort(tempered, top_k, top_p, tol=1e-6)
        ties = logits.shape[1] == V  # _rows: the last 4 rows hold many equal logits
        for i in range(n):
            if ties and i >= n - 4:
                assert kept[i].sum() == ref[i].sum(), i
            elif not close[i]:
                assert torch.equal(kept[i], ref[i]), (i, int(top_k[i]), float(top_p[i]))
        assert sum(close) < n // 3
        for i in range(n):
            alone = sampler.process_logits(logits[i : i + 1], temp[i : i + 1], top_k[i : i + 1], top_p[i : i + 1])
            assert torch.equal(alone[0], out[i])
        probs = logits_to_probs(logits, temp, top_k, top_p)
        torch.testing.assert_close(probs, torch.softmax(out, -1), rtol=1e-5, atol=1e-7)
        assert torch.equal(probs > 0, kept)


def test_native_softmax_keeps_every_token_float32_can_hold():
    """top_p = 1 through the kernels: every token whose probability float32 holds stays drawable
    (the fused softmax's exp reaches the denormals, as torch's does), and rows sum to one."""
    _native()
    g = torch.Generator().manual_seed(24)
    for _ in range(5):
        logits = torch.randn(3, V, generator=g) * 20
        probs = logits_to_probs(logits, torch.ones(3), torch.zeros(3, dtype=torch.long), torch.ones(3))
        assert (probs > 0).sum(1).tolist() == [int((torch.softmax(r, 0) > 0).sum()) for r in logits]
        assert torch.allclose(probs.sum(1), torch.ones(3))


def test_native_truncation_hands_torch_the_rows_it_cannot_answer():
    """A NaN, +inf or a row with nothing above -inf: the kernel says so and torch's path answers
    (which used to fail on a NaN gap in its buckets: an index error inside an engine step)."""
    k = _native()
    g = torch.Generator().manual_seed(22)
    ones, off = torch.ones(2), torch.zeros(2, dtype=torch.long)
    for bad in (float("nan"), float("inf")):
        x = torch.randn(2, 300, generator=g)
        x[1, 17] = bad
        assert not k.truncate_rows(x, ones, off, ones * 0.9, torch.zeros(2))[1]
    for bad in (float("nan"), float("inf")):
        x = torch.randn(2, 300, generator=g)
        x[1, 17] = bad
        got = sampler.process_logits(x, ones, off, ones * 0.9)
        want = sampler._truncate(x / ones[:, None], off, ones * 0.9, False, True)
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
        assert torch.isfinite(got[0]).sum() >= 1
        probs = logits_to_probs(x, ones, off, ones * 0.9)
        assert sampler.sample_from_probs(probs, [None, None], [0, 0], None).shape == (2,)
    x = torch.full((2, 300), float("-inf"))
    assert not k.truncate_rows(x, ones, off, ones * 0.9, torch.zeros(2))[1]


def test_native_inverse_cdf_draws_the_index_torch_draws():
    """inverse_cdf through the kernel: torch.searchsorted over the float64 running sum, the same
    index for float32 and float64 rows with zeros, u = 1, and u landing exactly on a running sum;
    rows with a NaN or no mass are torch's to answer."""
    k = _native()
    g = torch.Generator().manual_seed(23)

    def by_torch(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        cdf = p.double().cumsum(-1)
        return torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1)).squeeze(1).clamp_(max=p.shape[-1] - 1)

    for _ in range(60):
        v = int(torch.randint(1, 3000, (1,), generator=g))
        p = torch.rand(6, v, generator=g) ** 8
        p[torch.rand(6, v, generator=g) < 0.7] = 0
        p[:, int(torch.randint(0, v, (1,), generator=g))] += 1e-3
        for dtype in (torch.float32, torch.float64):
            u = 1.0 - torch.rand(6, dtype=torch.float64, generator=g)
            u[0] = 1.0
            assert torch.equal(sampler.inverse_cdf(p.to(dtype), u), by_torch(p.to(dtype), u))
    p = torch.tensor([[0.1, 0.0, 0.2, 0.3, 0.0, 0.4]], dtype=torch.float64)
    cdf = p.cumsum(-1)
    for j in range(6):
        u = (cdf[0, j] / cdf[0, -1]).view(1)
        assert torch.equal(sampler.inverse_cdf(p, u), by_torch(p, u))
    one = torch.ones(1, dtype=torch.float64)
    assert not k.inverse_cdf_rows(torch.zeros(1, 5), one)[1]
    assert not k.inverse_cdf_rows(torch.tensor([[0.5, float("nan")]]), one)[1]
    nan_row = torch.tensor([[0.5, float("nan"), 0.5]])
    assert torch.equal(sampler.inverse_cdf(nan_row, one), by_torch(nan_row, one))


def test_kept_tokens_softmax_and_the_fused_draw_are_the_two_step_paths_bit_for_bit():
    """Where a row keeps a short known list of tokens (a top-k of at most 256, a nucleus that closes
    among the 256 best) the kernel exponentiates only those: the probabilities equal the dense
    softmax of the truncated logits bit for bit (same exp per value, same float64 association).
    `sample_rows` (the sampler's draw without drafts) returns the index inverse_cdf_rows gives on
    truncate_rows' probabilities for the same uniforms, every row, greedy-tempered rows included,
    and each row's token does not depend on its batch."""
    k = _native()
    g = torch.Generator().manual_seed(31)
    for vocab in (9, 17, 1000, 49152):
        logits = torch.randn(12, vocab, generator=g) * torch.tensor([0.3, 1.0, 3.0, 12.0]).repeat(3)[:, None]
        logits[0, :3] += 9
        logits[1] = logits[1].round()  # ties at the cut
        logits[2, 5] = float("-inf")
        rows = logits.shape[0]
        top_k = torch.tensor([0, 1, 3, 40, 64, 65, 256, 257, 0, 0, 5, 0])[:rows]
        top_p = torch.tensor([0.9, 1.0, 0.95, 1.0, 0.5, 0.9, 1.0, 0.99, 0.999, 1.0, 0.8, 0.3])[:rows]
        min_p = torch.tensor([0.0, 0.0, 0.0, 0.05, 0.0, 0.0, 0.1, 0.0, 0.0, 0.0, 0.0, 0.02])[:rows]
        temp = torch.tensor([0.7, 1.0, 1.3, 0.0, 0.5, 2.0, 0.7, 1.0, 0.9, 0.7, 1.1, 0.6])[:rows]
        tempered = torch.where(temp < 1e-5, torch.ones_like(temp), temp)
        probs, ok = k.truncate_rows(logits, tempered, top_k, top_p, min_p, True)
        kept, ok2 = k.truncate_rows(logits, tempered, top_k, top_p, min_p, False)
        ones = torch.ones(rows)
        dense, ok3 = k.truncate_rows(kept, ones, torch.zeros(rows, dtype=torch.long), ones, torch.zeros(rows), True)
        assert ok and ok2 and ok3 and torch.equal(probs, dense)
        for _ in range(20):
            u = 1.0 - torch.rand(rows, dtype=torch.float64, generator=g)
            want, ok4 = k.inverse_cdf_rows(probs, u)
            got, ok5 = k.sample_rows(logits, temp, top_k, top_p, min_p, u, 1e-5)
            assert ok4 and ok5 and torch.equal(got, want)
            alone = [int(k.sample_rows(logits[i:i + 1], temp[i:i + 1], top_k[i:i + 1], top_p[i:i + 1], min_p[i:i + 1],
                                       u[i:i + 1], 1e-5)[0]) for i in range(rows)]
            assert alone == want.tolist()
    bad = torch.randn(2, 300, generator=g)
    bad[1, 7] = float("nan")
    ones = torch.ones(2)
    assert not k.sample_rows(bad, ones, torch.zeros(2, dtype=torch.long), ones * 0.9, torch.zeros(2),
                             torch.full((2,), 0.5, dtype=torch.float64), 1e-5)[1]


def test_the_sampler_draws_the_same_tokens_with_and_without_the_fused_kernel(monkeypatch):
    """Sampler.__call__ takes one native call where it can; without it (native_sample answering
    None: the two-step path) the same uniforms give the same tokens, seeded and unseeded rows, a
    greedy row among them."""
    _native()
    from specserve.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(32)
    logits = torch.randn(5, 3000, generator=g) * 3
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=11), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.6, top_k=20, min_p=0.05),
              SamplingParams(temperature=1.2, top_p=0.5, seed=5)]
    meta = sampler.SamplingMetadata.build(params, [3, 0, 0, 7, 1], torch.device("cpu"))
    fused = sampler.Sampler(torch.device("cpu"), seed=9)(logits.clone(), meta)[0]
    monkeypatch.setattr(sampler, "native_sample", lambda *a: None)
    two_step = sampler.Sampler(torch.device("cpu"), seed=9)(logits.clone(), meta)[0]
    assert torch.equal(fused, two_step) and int(fused[2]) == int(logits[2].argmax())
