"""specserve audit: the real verification passes, biased ones fail; precision KL is measured."""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.ops.audit import (
    audit_precision,
    audit_speculation,
    continuations,
    teacher_forced_logits,
)
from specserve.sampling.sampler import logits_to_probs
from specserve.sampling.tree_rejection import TreeVerifyResult

PARAMS = SamplingParams(temperature=1.0, top_k=50)


@pytest.fixture(scope="module")
def pair():
    from conftest import tiny_checkpoint

    _, target = tiny_checkpoint("llama", seed=5, vocab=256, layers=2)
    _, draft = tiny_checkpoint("llama", seed=6, vocab=256, layers=1)
    kw = dict(dtype="float32", profile_spec_costs=False, kv_cache_gib=0.05)
    return LLM("tiny", checkpoint=target, **kw), LLM("tiny-draft", checkpoint=draft, **kw)


def _logits(pair):
    target, draft = pair
    ids = continuations(target.engine, [list(range(3, 20))], 20)[0]
    assert len(ids) == 37
    return teacher_forced_logits(target.engine, ids)[:-1][-6:], teacher_forced_logits(draft.engine, ids)[:-1][-6:], ids


def test_teacher_forced_logits_match_decoding(pair):
    target, _ = pair
    eng = target.engine
    eng.runner.keep_logits = True
    prompt = list(range(5, 25))
    target.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    decoded = eng.runner.last_logits[-1]
    eng.runner.keep_logits = False
    forced = teacher_forced_logits(eng, prompt)
    assert torch.allclose(forced[-1], decoded, atol=1e-4)
    assert eng.check_integrity()


def test_real_verification_passes_and_biased_ones_fail(pair):
    q_logits, p_logits, ids = _logits(pair)
    nxt = ids[-6:]
    ok = audit_speculation(q_logits, nxt, PARAMS, draft_logits=p_logits, draws=20_000)
    assert ok.passed, ok.reason
    ok1 = audit_speculation(q_logits, nxt, PARAMS, draws=20_000)  # one-hot drafts
    assert ok1.passed, ok1.reason

    def always_accept(rows, trees, meta, g):
        return [TreeVerifyResult([t.token_ids[0], 0], [0], None) for t in trees]

    def residual_from_q(rows, trees, meta, g):  # the classic bug: after a rejection, sample q, not max(0, q - p)
        q = logits_to_probs(rows[:1], meta.temperature[:1], meta.top_k[:1], meta.top_p[:1])[0]
        out = []
        for t in trees:
            x = t.token_ids[0]
            p = t.dists[0] if t.dists is not None else torch.nn.functional.one_hot(torch.tensor(x), q.shape[0]).float()
            if torch.rand((), generator=g) < min(1.0, float(q[x] / p[x])):
                out.append(TreeVerifyResult([x, 0], [0], None))
            else:
                out.append(TreeVerifyResult([int(torch.multinomial(q, 1, generator=g))], [], None))
        return out

    for biased in (always_accept, residual_from_q):
        bad = audit_speculation(q_logits, nxt, PARAMS, draft_logits=p_logits, draws=4_000, verifier=biased)
        assert not bad.passed, biased.__name__
        assert "differ" in bad.reason or "probability 0" in bad.reason


def test_precision_audit_measures_kl(pair):
    q_logits, _, _ = _logits(pair)
    same = audit_precision(q_logits, q_logits.clone(), PARAMS)
    assert same.passed and same.summary()["max_kl"] < 1e-9
    noisy = audit_precision(q_logits, q_logits + 0.5 * torch.randn_like(q_logits), PARAMS, max_kl=1e-3)
    assert not noisy.passed and noisy.summary()["mean_kl"] > 1e-3


def test_cli_refuses_bad_input_with_status_2(tmp_path, capsys):
    from specserve.cli import main

    assert main(["audit", "--model", "smollm2-135m-instruct", "--prompts", str(tmp_path / "missing.txt")]) == 2
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert main(["audit", "--model", "smollm2-135m-instruct", "--prompts", str(empty)]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": 3}\n')
    assert main(["audit", "--model", "smollm2-135m-instruct", "--prompts", str(bad)]) == 2
    assert "prompt" in capsys.readouterr().err
    # settings that would check nothing, always fail, or crash: refused before a model loads
    good = tmp_path / "good.txt"
    good.write_text("hello\n")
    for flags, message in ((["--positions", "0"], "--positions must be >= 1"), (["--draws", "0"], "--draws must be >= 1"),
                           (["--alpha", "2"], "--alpha (the significance level)"), (["--max-kl", "-1"], "--max-kl")):
        argv = ["audit", "--model", "no-such-model", "--prompts", str(good), "--spec-method", "ngram", *flags]
        assert main(argv) == 2
        assert message in capsys.readouterr().err
