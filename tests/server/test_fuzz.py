"""Hypothesis-generated bodies against the live API: never a 5xx, the server stays healthy."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specserve import LLM

from .conftest import serve

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40),
)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)

NON_FINITE = st.sampled_from([float("nan"), float("inf"), float("-inf")])
SMALL_INT = st.integers(min_value=-3, max_value=40)
COMMON = {
    "model": st.one_of(st.just("tiny"), st.text(max_size=10), SCALARS),
    "max_tokens": st.one_of(SMALL_INT, VALUES),
    "temperature": st.one_of(st.floats(min_value=-1, max_value=3), NON_FINITE, VALUES),
    "top_p": st.one_of(st.floats(min_value=-0.5, max_value=1.5), NON_FINITE, VALUES),
    "top_k": st.one_of(SMALL_INT, VALUES),
    "n": st.one_of(st.integers(min_value=-1, max_value=20), VALUES),
    "stream": st.one_of(st.booleans(), VALUES),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), VALUES),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=20), VALUES),
    "seed": st.one_of(st.integers(min_value=-(2**64), max_value=2**64), VALUES),
    "logprobs": st.one_of(st.booleans(), SMALL_INT, VALUES),
    "priority": st.one_of(SMALL_INT, VALUES),
    "speculative": st.one_of(st.booleans(), VALUES),
    "reference_text": st.one_of(st.text(max_size=30), VALUES),
    "ignore_eos": st.one_of(st.booleans(), VALUES),
    "presence_penalty": st.one_of(st.floats(min_value=-3, max_value=3), VALUES),
    "logit_bias": st.one_of(st.dictionaries(st.text(max_size=3), st.floats(-5, 5), max_size=2), VALUES),
}
PROMPT = st.one_of(st.text(max_size=60), st.lists(st.text(max_size=20), max_size=3),
                   st.lists(st.integers(min_value=-5, max_value=60000), max_size=20),
                   st.lists(st.lists(st.integers(min_value=0, max_value=50000), max_size=5), max_size=3), VALUES)
MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "bot"]),
                           "content": st.one_of(st.text(max_size=40), VALUES)}),
    VALUES,
)


def _body(extra: dict) -> st.SearchStrategy[dict]:
    fields = {**COMMON, **extra}
    return st.fixed_dictionaries({}, optional=fields).flatmap(
        lambda d: st.dictionaries(st.text(max_size=6), VALUES, max_size=2).map(lambda junk: {**junk, **d})
    )


@pytest.fixture(scope="module")
def fuzz_server(tiny_tok_checkpoint):
    llm = LLM("tiny", dtype="float32", checkpoint=tiny_tok_checkpoint, max_model_len=64, max_num_seqs=16,
              spec_method="ngram", spec_policy="always", profile_spec_costs=False)
    with serve(llm, "tiny", max_waiting=8) as live:
        yield live


def _post(live, path: str, payload: bytes) -> httpx.Response:
    return httpx.post(live.base_url + path, content=payload, headers={"content-type": "application/json"},
                      timeout=60)


FUZZ_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


@FUZZ_SETTINGS
@given(body=_body({"prompt": PROMPT, "echo": st.one_of(st.booleans(), VALUES),
                   "best_of": st.one_of(SMALL_INT, VALUES), "suffix": st.one_of(st.text(max_size=3), VALUES)}))
def test_fuzz_completions(fuzz_server, body):
    r = _post(fuzz_server, "/v1/completions", json.dumps(body).encode())
    assert r.status_code < 500, (body, r.text)
    if r.status_code != 200:
        assert "error" in r.json()


@FUZZ_SETTINGS
@given(body=_body({"messages": st.one_of(st.lists(MESSAGE, max_size=4), VALUES),
                   "max_completion_tokens": st.one_of(SMALL_INT, VALUES),
                   "top_logprobs": st.one_of(SMALL_INT, VALUES)}))
def test_fuzz_chat(fuzz_server, body):
    r = _post(fuzz_server, "/v1/chat/completions", json.dumps(body).encode())
    assert r.status_code < 500, (body, r.text)


@FUZZ_SETTINGS
@given(raw=st.one_of(st.binary(max_size=64), st.text(max_size=64).map(str.encode), VALUES.map(lambda v: json.dumps(v).encode())))
def test_fuzz_raw_bytes(fuzz_server, raw):
    for path in ("/v1/completions", "/v1/chat/completions", "/admin/speculation"):
        r = _post(fuzz_server, path, raw)
        assert r.status_code < 500, (path, raw, r.text)


def test_server_healthy_after_fuzz(fuzz_server):
    r = httpx.post(fuzz_server.base_url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4})
    assert r.status_code == 200
    assert httpx.get(fuzz_server.base_url + "/health").json()["status"] == "ok"
    fuzz_server.wait_idle()
    eng = fuzz_server.engine
    assert eng.check_integrity()
    assert all(b.ref_cnt == 0 for b in eng.kv_manager.pool.blocks)
