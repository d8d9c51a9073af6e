"""Exactness of the batched rejection sampler against chi-square tests (>= 10^6 draws each)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specserve.sampling.rejection import SpecBatch, rejection_sample
from specserve.sampling.sampler import SamplingMetadata, logits_to_probs
from specserve.sampling_params import SamplingParams

VOCAB = 50
DRAWS = 1_000_000
CHUNK = 100_000  # requests per batched call
P_MIN = 1e-3


def _processed(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    n = logits.shape[0]
    meta = SamplingMetadata.build([params] * n, [0] * n, logits.device)
    return logits_to_probs(logits, meta.temperature, meta.top_k, meta.top_p, True, True)


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of counts against probs; zero-probability cells must be empty."""
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token the target gives probability 0"
    probs = probs.astype(np.float64)
    expected = probs[support] / probs[support].sum() * counts.sum()
    return float(chisquare(counts[support], expected).pvalue)


def _run(k: int, params: SamplingParams, one_hot: bool, seed: int):
    """Emitted first tokens and bonus tokens (when all K accepted) over DRAWS requests."""
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(k + 1, VOCAB, generator=g) * 2.0
    draft_logits = target_logits[:k] + torch.randn(k, VOCAB, generator=g) * 1.5  # a related draft
    q = _processed(target_logits, params)  # what the target wants, per position
    p = _processed(draft_logits, params) if k else torch.zeros(0, VOCAB)
    first, bonus = [], []
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(DRAWS // CHUNK):
        if k:
            if one_hot:  # a deterministic proposer: always the same guess per position
                drafts = p.argmax(-1).repeat(CHUNK, 1)
            else:
                drafts = torch.stack([torch.multinomial(p[j], CHUNK, True, generator=gen) for j in range(k)], 1)
        else:
            drafts = torch.zeros(CHUNK, 0, dtype=torch.long)
        meta = SamplingMetadata.build([params] * CHUNK, [0] * CHUNK, torch.device("cpu"))
        batch = SpecBatch(
            num_draft=[k] * CHUNK,
            draft_token_ids=drafts.tolist(),
            draft_probs=[None] * CHUNK,
            meta=meta,
            flat_draft_probs=None if one_hot or not k else p.repeat(CHUNK, 1),
        )
        res = rejection_sample(target_logits.repeat(CHUNK, 1), batch, gen)
        first.extend(t[0] for t in res.token_ids)
        bonus.extend(t[-1] for t, a in zip(res.token_ids, res.num_accepted) if a == k and k > 0)
        assert all(1 <= len(t) <= k + 1 for t in res.token_ids)
    return q, np.bincount(first, minlength=VOCAB), np.bincount(bonus, minlength=VOCAB) if bonus else None


CASES = [
    pytest.param(SamplingParams(temperature=1.0), id="T1"),
    pytest.param(SamplingParams(temperature=0.6), id="T0.6"),
    pytest.param(SamplingParams(temperature=1.3, top_k=10), id="T1.3-topk10"),
    pytest.param(SamplingParams(temperature=0.8, top_p=0.7), id="T0.8-topp0.7"),
    pytest.param(SamplingParams(temperature=1.0, top_k=20, top_p=0.9), id="topk20-topp0.9"),
]


@pytest.mark.parametrize(
    ("params", "k"),
    # The quick tier: K 1 and 3 at plain temperatures (the quick tree tests take top-k and top-p);
    # top-k, top-p and K 5 chains are slow.
    [pytest.param(CASES[0].values[0], 1, id="T1-K1")]
    + [pytest.param(c.values[0], 3, id=f"{c.id}-K3", marks=[pytest.mark.slow] if "top" in c.id else [])
       for c in CASES]
    + [pytest.param(CASES[4].values[0], 5, id=f"{CASES[4].id}-K5", marks=pytest.mark.slow)],
)
def test_first_token_matches_target(params, k):
    q, first, bonus = _run(k, params, one_hot=False, seed=10 * k + 1)
    assert _chi2(first, q[0].numpy()) > P_MIN
    if bonus is not None and bonus.sum() > 1000:
        assert _chi2(bonus, q[k].numpy()) > P_MIN


@pytest.mark.parametrize("params", [CASES[0], pytest.param(*CASES[3].values, id=CASES[3].id, marks=pytest.mark.slow)])
def test_one_hot_proposals(params):
    q, first, bonus = _run(3, params, one_hot=True, seed=7)
    assert _chi2(first, q[0].numpy()) > P_MIN
    if bonus is not None and bonus.sum() > 1000:
        assert _chi2(bonus, q[3].numpy()) > P_MIN


def test_no_draft_is_plain_sampling():
    q, first, _ = _run(0, SamplingParams(temperature=0.9), one_hot=False, seed=3)
    assert _chi2(first, q[0].numpy()) > P_MIN


def test_greedy_accepts_argmax_prefix():
    logits = torch.randn(4, VOCAB)
    am = logits.argmax(-1).tolist()
    meta = SamplingMetadata.build([SamplingParams(temperature=0)] * 3, [0] * 3, torch.device("cpu"))
    wrong = (am[1] + 1) % VOCAB
    batch = SpecBatch(
        num_draft=[3, 3, 0],
        draft_token_ids=[am[:3], [am[0], wrong, am[2]], []],
        draft_probs=[None, None, None],
        meta=meta,
    )
    rows = torch.cat([logits, logits, logits[:1]])
    res = rejection_sample(rows, batch, None)
    assert res.token_ids[0] == am  # all accepted + bonus
    assert res.token_ids[1] == [am[0], am[1]]  # rejected at 2nd, recovered = argmax
    assert res.token_ids[2] == [am[0]]
    assert res.num_accepted == [3, 1, 0]


def test_greedy_fast_path_matches_the_batched_rule():
    """All-greedy batches take a pure-Python walk over one argmax; it emits what the batched
    tensor rule emits, for jagged K, drafts that match in part, in full and not at all."""
    from specserve.sampling.rejection import _sample_rows

    g = torch.Generator().manual_seed(7)
    for trial in range(50):
        ks = [int(k) for k in torch.randint(0, 6, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g)]
        logits = torch.randn(sum(k + 1 for k in ks), VOCAB, generator=g)
        am = logits.argmax(-1).tolist()
        drafts, row = [], 0
        for k in ks:  # the argmax for a random prefix, then random tokens
            good = int(torch.randint(0, k + 1, (1,), generator=g))
            drafts.append(am[row : row + good] + torch.randint(0, VOCAB, (k - good,), generator=g).tolist())
            row += k + 1
        meta = SamplingMetadata.build([SamplingParams(temperature=0)] * len(ks), [0] * len(ks), torch.device("cpu"))
        batch = SpecBatch(num_draft=ks, draft_token_ids=drafts, draft_probs=[None] * len(ks), meta=meta)
        fast, slow = rejection_sample(logits, batch, None), _sample_rows(logits, batch, None)
        assert fast.token_ids == slow.token_ids and fast.num_accepted == slow.num_accepted, trial
        assert rejection_sample(logits, batch, None, am).token_ids == slow.token_ids


def test_seeded_requests_are_reproducible_and_batch_invariant():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, VOCAB, generator=g)
    p = torch.softmax(torch.randn(2, VOCAB, generator=g), -1)
    params = SamplingParams(temperature=1.0, seed=42)

    def once(n_other: int):
        ps = [SamplingParams(temperature=1.0)] * n_other + [params]
        meta = SamplingMetadata.build(ps, [5] * len(ps), torch.device("cpu"))
        batch = SpecBatch([2] * len(ps), [[1, 2]] * len(ps), [p] * len(ps), meta)
        return rejection_sample(logits.repeat(len(ps), 1), batch, torch.Generator().manual_seed(n_other)).token_ids[-1]

    assert once(0) == once(3) == once(7)


def test_rows_past_a_requests_stop_are_never_made_into_distributions(monkeypatch):
    """Each row made into a distribution is a pass over the vocabulary (1.5-6 ms for 152k ids):
    only the rows a request reaches are made, in doubling chunks. A draft rejected at once costs
    one row; a chain accepted to its end costs its K + 1 rows in 1 + log2 chunks."""
    import specserve.sampling.rejection as rej

    calls: list[int] = []
    real = rej.logits_to_probs

    def counted(logits, *args, **kw):  # noqa: ANN001, ANN202
        calls.append(logits.shape[0])
        return real(logits, *args, **kw)

    monkeypatch.setattr(rej, "logits_to_probs", counted)
    k = 8
    logits = torch.full((k + 1, VOCAB), -30.0)
    logits[:, 3] = 30.0  # the target all but surely says 3 at every position
    params = SamplingParams(temperature=1.0, seed=1)
    meta = SamplingMetadata.build([params], [0], torch.device("cpu"))
    res = rejection_sample(logits, SpecBatch([k], [[4] * k], [None], meta), None)  # wrong at once
    assert res.token_ids == [[3]] and calls == [1]
    calls.clear()
    res = rejection_sample(logits, SpecBatch([k], [[3] * k], [None], meta), None)  # right to the end
    assert res.token_ids == [[3] * (k + 1)] and sum(calls) == k + 1 and calls == [1, 2, 4, 2]
