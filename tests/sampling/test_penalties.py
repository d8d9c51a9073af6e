"""The sparse penalties equal a dense reference on random trees whose paths repeat tokens."""

from __future__ import annotations

import random

import pytest
import torch

from specserve.engine.scheduler import ScheduledRequest
from specserve.sampling.penalties import apply_penalties
from specserve.sampling_params import SamplingParams
from specserve.spec.tree import DraftTree


def _dense_reference(rows: torch.Tensor, sr: ScheduledRequest) -> torch.Tensor:
    """Count every token of every row's path over the whole vocabulary, then penalise."""
    p = sr.sampling_params
    n, vocab = rows.shape
    counts = torch.bincount(torch.tensor(sr.penalized_output, dtype=torch.long), minlength=vocab).double().repeat(n, 1)
    if sr.draft is not None:
        mask = sr.draft.ancestor_mask()
        for i in range(len(sr.draft)):
            for j in mask[i].nonzero().flatten().tolist():
                counts[1 + i, sr.draft.token_ids[j]] += 1
    out = rows.double().clone()
    if p.repetition_penalty != 1.0:
        seen = counts > 0
        if sr.penalized_prompt is not None:
            seen |= torch.bincount(sr.penalized_prompt, minlength=vocab)[None] > 0
        r = p.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
    return out - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).double()


def _random_tree(rng: random.Random, size: int, vocab: int) -> DraftTree:
    parents = [-1] + [rng.randrange(-1, i) for i in range(1, size)]
    return DraftTree(tuple(rng.randrange(vocab) for _ in range(size)), tuple(parents))


@pytest.mark.parametrize("seed", range(20))
def test_sparse_penalties_equal_a_dense_reference(seed):
    rng = random.Random(seed)
    vocab = 40  # small: outputs, prompts and paths share many tokens
    params = SamplingParams(
        presence_penalty=rng.choice([0.0, 0.7, -1.2]), frequency_penalty=rng.choice([0.0, 0.4, 1.9]),
        repetition_penalty=rng.choice([1.0, 1.3, 0.6]),
    )
    if not params.has_penalties:
        params = SamplingParams(frequency_penalty=0.5)
    batch, want = [], []
    logits = torch.randn(0, vocab)
    for i in range(3):
        draft = _random_tree(rng, rng.randint(1, 12), vocab) if i else None  # the first request decodes plainly
        output = [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 20))]
        sr = ScheduledRequest(str(i), [], 0, [], draft, True, params, len(output), penalized_output=output,
                              penalized_prompt=torch.unique(torch.tensor(prompt)) if params.repetition_penalty != 1.0 else None)
        rows = torch.randn(1 + sr.num_spec_tokens, vocab) * 4
        want.append(_dense_reference(rows, sr))
        batch.append(sr)
        logits = torch.cat([logits, rows])
    apply_penalties(logits, batch)
    torch.testing.assert_close(logits.double(), torch.cat(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(6))
def test_a_verified_row_is_penalised_bit_for_bit_as_plain_decoding_after_its_path(seed):
    """Row 1 + i of a tree is changed exactly as the root row of a request whose output already
    holds node i's path: greedy speculation then picks what plain decoding picks, even where
    two logits are within rounding. Requests of one batch have different penalties."""
    rng = random.Random(100 + seed)
    vocab = 50
    batch, plain_rows, plain_reqs = [], [], []
    logits = torch.randn(0, vocab)
    for i in range(3):
        params = SamplingParams(presence_penalty=rng.choice([0.0, 0.3, -0.7]), frequency_penalty=rng.choice([0.1, 0.45]),
                                repetition_penalty=rng.choice([1.0, 1.17, 0.83]))
        draft = _random_tree(rng, rng.randint(1, 10), vocab)
        output = [rng.randrange(vocab) for _ in range(rng.randint(0, 25))]
        prompt = torch.unique(torch.tensor([rng.randrange(vocab) for _ in range(rng.randint(1, 20))]))
        pp = prompt if params.repetition_penalty != 1.0 else None
        sr = ScheduledRequest(str(i), [], 0, [], draft, True, params, len(output), penalized_output=output,
                              penalized_prompt=pp)
        rows = torch.randn(1 + len(draft), vocab) * 3
        for node in range(-1, len(draft)):
            path = [] if node < 0 else [draft.token_ids[j] for j in draft.path(node)]
            plain_reqs.append(ScheduledRequest(f"{i}.{node}", [], 0, [], None, True, params, len(output) + len(path),
                                               penalized_output=output + path, penalized_prompt=pp))
        plain_rows.append(rows.clone())
        batch.append(sr)
        logits = torch.cat([logits, rows])
    plain = torch.cat(plain_rows)
    apply_penalties(logits, batch)
    apply_penalties(plain, plain_reqs)
    assert torch.equal(logits, plain)


def test_an_ending_token_leaves_a_ranked_draft_with_what_follows_it():
    """An ending id (EOS unless ignore_eos, stop_token_ids) adds no token when accepted (it ends
    the output, and its parent's row draws it anyway): its node and subtree leave a deterministic
    draft, other branches stay. A drawn node (an unseeded chain's draw) keeps its ending id, only
    what follows it goes: whether a draw is verified may not depend on what was drawn."""
    from specserve.request import Request
    from specserve.sampling.penalties import prune_banned
    from specserve.spec.tree import SiblingDraw

    eos, stop = 2, 9
    # root 5 -> eos -> 6 -> 7, root 5 -> 8 -> stop -> 4; root 3 -> 4
    tree = DraftTree((5, eos, 6, 7, 8, stop, 4, 3, 4), (-1, 0, 1, 2, 0, 4, 5, -1, 7),
                     scores=(0.9, 0.5, 0.4, 0.3, 0.2, 0.1, 0.1, 0.05, 0.01))
    req = Request("r", [1, 1], SamplingParams(stop_token_ids=[stop]), eos_token_ids=frozenset({eos}))
    cut = prune_banned(tree, req)
    assert cut is not None
    assert cut.token_ids == (5, 8, 3, 4) and cut.parents == (-1, 0, -1, 2)
    assert cut.scores == (0.9, 0.2, 0.05, 0.01)
    # ignore_eos: EOS is a token like any other, the stop id still ends the output
    req = Request("r", [1, 1], SamplingParams(stop_token_ids=[stop], ignore_eos=True), eos_token_ids=frozenset({eos}))
    cut = prune_banned(tree, req)
    assert cut is not None and cut.token_ids == (5, eos, 6, 7, 8, 3, 4)
    # a draft of nothing but an ending id: nothing left
    assert prune_banned(DraftTree((eos,), (-1,)), Request("r", [1], SamplingParams(), eos_token_ids=frozenset({eos}))) is None
    # nothing to cut: the same object back
    plain = DraftTree((5, 6, 7), (-1, 0, 1))
    assert prune_banned(plain, Request("r", [1], SamplingParams(), eos_token_ids=frozenset({eos}))) is plain
    # a drawn chain keeps its ending draw, not what follows; under min_tokens the draw goes too
    drawn = DraftTree.chain([5, eos, 6], torch.full((3, 12), 1 / 12))
    assert drawn.draw is SiblingDraw.IID
    sampled = SamplingParams(temperature=1.0)
    cut = prune_banned(drawn, Request("r", [1], sampled, eos_token_ids=frozenset({eos})))
    assert cut is not None and cut.token_ids == (5, eos) and cut.draw is SiblingDraw.IID
    short = Request("r", [1], SamplingParams(temperature=1.0, min_tokens=4, max_tokens=8), eos_token_ids=frozenset({eos}))
    cut = prune_banned(drawn, short)
    assert cut is not None and cut.token_ids == (5,)
