"""`specserve audit --url`: the sampler of a running server, speculation as it serves, against the
target's exact distribution computed here; a server whose verification is biased fails."""

from __future__ import annotations

import math

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.cli import main
from specserve.ops.audit import ServedAPI, audit_served, continuations, teacher_forced_logits

from .conftest import free_port, serve

PARAMS = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def tiny():
    from conftest import tiny_checkpoint

    return tiny_checkpoint("llama", seed=5, vocab=64, layers=2)[1]


def _spots(ckpt) -> tuple[list[list[int]], list[int], torch.Tensor]:  # noqa: ANN001
    """Teacher-forced sequences (a repetitive prompt, so n-gram drafts), the audited positions
    and the exact logits there, from a plain engine."""
    ref = LLM("tiny", checkpoint=ckpt, dtype="float32", profile_spec_costs=False, kv_cache_gib=0.02)
    seqs = continuations(ref.engine, [[3, 4, 5, 6, 7] * 5, [9, 8, 7, 9, 8, 7] * 4], 8)
    spots = [(s, len(s) - 3) for s in seqs]  # in the greedy continuation: its first token is the likeliest
    logits = torch.stack([teacher_forced_logits(ref.engine, s)[j] for s, j in spots])
    return [s for s, _ in spots], [j for _, j in spots], logits


def test_a_served_sampler_passes_and_a_biased_verification_fails(tiny, monkeypatch):
    seqs, positions, logits = _spots(tiny)
    llm = LLM("tiny", checkpoint=tiny, dtype="float32", profile_spec_costs=False, kv_cache_gib=0.05,
              spec_method="ngram", spec_policy="always")
    with serve(llm, name="tiny") as live:
        api = ServedAPI(live.base_url + "/v1")
        report, spec = audit_served(api, seqs, positions, logits, PARAMS, draws=800)
        assert report.passed and not report.reason, report.reason
        assert len(report.positions) == 2 and spec["draft_tokens"] > 0 and spec["verify_steps"] > 0

        runner = llm.engine.runner
        for name in ("_verify_chains", "_verify_trees"):  # verify drafts against q at temperature 1/8
            real = getattr(runner, name)
            monkeypatch.setattr(runner, name, lambda logits, *args, real=real: real(8 * logits, *args))
        bad, spec = audit_served(api, seqs, positions, logits, PARAMS, draws=800)
        assert not bad.passed and "differ" in bad.reason and spec["verify_steps"] > 0, (bad, spec)


def test_audit_url_refuses_bad_addresses_and_speculation_flags(tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    base = ["audit", "--model", "smollm2-135m-instruct", "--prompts", str(prompts)]
    assert main([*base, "--url", "http://127.0.0.1:8000", "--spec-method", "ngram"]) == 2
    assert "leave --spec-method" in capsys.readouterr().err
    assert main([*base, "--url", "ftp://example"]) == 2
    assert "not an http(s) address" in capsys.readouterr().err
    assert main([*base, "--url", f"http://127.0.0.1:{free_port()}"]) == 2  # nothing listens: before any loading
    err = capsys.readouterr().err
    assert err.startswith("error: cannot list the models") and "Traceback" not in err


def test_a_server_that_drafts_nothing_passes_saying_so(tiny):
    seqs, positions, logits = _spots(tiny)
    llm = LLM("tiny", checkpoint=tiny, dtype="float32", profile_spec_costs=False, kv_cache_gib=0.05)
    with serve(llm, name="tiny") as live:
        report, spec = audit_served(ServedAPI(live.base_url), seqs, positions, logits, PARAMS, draws=200)
    assert report.passed and spec["verify_steps"] == 0 and "verified no drafts" in report.reason


class _FakeServer:
    """A server whose answers are scripted: `first` tokens, always the same second one."""

    base = "http://fake"

    def __init__(self, first: list[int], tokens_as_text: bool = False) -> None:
        self.first, self.as_text, self.calls = first, tokens_as_text, 0

    def model_name(self) -> str:
        return "fake"

    def post(self, path: str, body: dict) -> dict:
        self.calls += 1
        name = (lambda t: str(t)) if self.as_text else (lambda t: f"token_id:{t}")
        first = self.first if self.calls % 8 == 0 else [5] * len(self.first)  # one call in 8 as scripted
        return {"choices": [{"logprobs": {"tokens": [name(f), name(0), name(0)]}} for f in first]}


def test_positions_with_too_few_answers_are_not_judged_and_text_tokens_are_refused():
    from specserve.errors import ConfigError

    seqs, positions, logits = [[1, 2, 3, 4]] * 2, [2, 2], torch.randn(2, 64)
    # Another model: the continuation's token comes up in one answer of 128; its second token is always
    # the same. 50 answers a position are too few to judge (they would pool into one chi-square cell).
    report, spec = audit_served(_FakeServer([3] + [5] * 15), seqs, positions, logits, PARAMS, draws=800)
    assert not report.passed and "in no position did 100 answers" in report.reason
    assert spec["untested_positions"] == 2 and spec["requests"] == 2 * 8 * 50
    with pytest.raises(ConfigError, match="return_tokens_as_token_ids"):
        audit_served(_FakeServer([3] * 16, tokens_as_text=True), seqs, positions, logits, PARAMS, draws=800)


def test_the_model_card_names_the_precision_and_the_served_audit_computes_its_reference_in_it(tiny, monkeypatch):
    """A server sampling on int4 audited against this machine's `auto` would fail on the
    precisions' KL alone (SmolLM2: mean KL 0.08 nats, against 0.006 for auto vs float32): the
    reference is computed as the server's /v1/models card says, unless --precisions names one."""
    import specserve
    from specserve.errors import ConfigError
    from specserve.ops import audit

    llm = LLM("tiny", checkpoint=tiny, dtype="float32", profile_spec_costs=False, kv_cache_gib=0.02)
    with serve(llm, name="tiny") as live:
        card = ServedAPI(live.base_url).model_card()
    assert card["precision"] == {"quantization": "none", "dtype": "float32", "kv_cache_dtype": "auto"}

    built: list[dict] = []

    class Stop(Exception):
        pass

    def fake_llm(model, **kw):  # noqa: ANN001, ANN003, ANN202
        built.append({k: v for k, v in kw.items() if k in audit.PRECISION_KEYS})
        if kw.get("quantization") == "fp4":
            raise ConfigError("Unknown quantization 'fp4'")
        raise Stop

    monkeypatch.setattr(specserve, "LLM", fake_llm)
    said = {"quantization": "int4", "dtype": "float32", "kv_cache_dtype": "fp16"}
    for card, precisions, expect in [
        ({"id": "m", "precision": said}, [], said),  # the server's
        ({"id": "m", "precision": said}, ["none"], {"quantization": "none"}),  # --precisions' first
        ({"id": "m"}, [], {}),  # another server: this machine's defaults
        ({"id": "m", "precision": {"quantization": 4}}, [], {}),  # a card it cannot read: the same
    ]:
        monkeypatch.setattr(ServedAPI, "model_card", lambda self, card=card: card)
        with pytest.raises(Stop):
            audit.run_audit("m", ["hi"], url="http://127.0.0.1:1", precisions=precisions)
        assert built.pop() == expect
    monkeypatch.setattr(ServedAPI, "model_card", lambda self: {"id": "m", "precision": {**said, "quantization": "fp4"}})
    with pytest.raises(ConfigError, match="computes in quantization fp4.*give --precisions P"):
        audit.run_audit("m", ["hi"], url="http://127.0.0.1:1")


class _SamplingServer:
    """A server that samples each answer's second token from `q` (its first is always `first`)."""

    base = "http://fake"

    def __init__(self, first: int, q: torch.Tensor) -> None:
        self.first, self.q, self.gen = first, q, torch.Generator().manual_seed(3)

    def model_name(self) -> str:
        return "fake"

    def post(self, path: str, body: dict) -> dict:
        second = torch.multinomial(self.q, body["n"], replacement=True, generator=self.gen).tolist()
        return {"choices": [{"logprobs": {"tokens": [f"token_id:{t}" for t in (self.first, x, 0)]}}
                            for x in second]}


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, top_k=3),
                                    SamplingParams(temperature=1.0, top_p=0.7),
                                    SamplingParams(temperature=1.0, min_p=math.exp(-1 - 5e-5))],  # cut: 1 - 5e-5
                         ids=["top_k", "top_p", "min_p"])
def test_the_served_audit_lets_another_machine_cut_truncation_on_the_other_side_of_a_near_tie(params):
    """Where the 3rd and 4th logits differ by 1e-4 (less than machine kinds' numerics do), a server
    that keeps the 4th instead of the 3rd samples what the model says as well as the reference: the
    served audit passes it; a server that also emits a token far outside the cut still fails."""
    from specserve.ops.audit import processed

    logits = torch.full((1, 64), -4.0)
    logits[0, :4] = torch.tensor([2.0, 1.5, 1.0, 1.0 - 1e-4])
    if params.top_p < 1.0:  # the mass before the 3rd token lands on top_p: the 3rd is the last kept
        logits[0, :4] = torch.tensor([1.0, 0.0, -0.5, -0.5 - 1e-4])
        params = SamplingParams(temperature=1.0, top_p=float(processed(logits, SamplingParams())[0, :2].sum()) + 1e-3)
    q = processed(logits, params)[0]
    swapped = logits.clone()
    swapped[0, [2, 3]] = logits[0, [3, 2]]
    q_other = processed(swapped, params)[0]
    assert q[3] == 0 and q_other[3] > 0.05  # the other machine keeps the token the reference drops
    seqs, positions = [[1, 2, 3, 4]], [2]
    report, _ = audit_served(_SamplingServer(3, q_other), seqs, positions, logits, params, draws=2000)
    assert report.passed, report.reason
    wrong = q_other.clone()
    wrong[40] = 0.02  # and a token well below every cut
    report, _ = audit_served(_SamplingServer(3, wrong / wrong.sum()), seqs, positions, logits, params, draws=2000)
    assert not report.passed and "probability 0" in report.reason
