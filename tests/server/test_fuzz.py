"""Hypothesis-generated bodies and headers against the live API: never a 5xx, the server stays
healthy and leaks no KV block. Strings hold any code point, lone surrogates included (JSON's
\\ud800-\\udfff escapes can carry them); headers hold any bytes but line breaks."""

from __future__ import annotations

import json
import os
import socket

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specserve import LLM

from .conftest import serve

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ANY_CHAR = st.characters(exclude_categories=())  # every code point, surrogates included
LONE_SURROGATE = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, exclude_categories=())


def text(max_size: int) -> st.SearchStrategy[str]:
    """Ordinary text, or text of any code points with lone surrogates mixed in."""
    return st.one_of(st.text(max_size=max_size), st.text(st.one_of(ANY_CHAR, LONE_SURROGATE), max_size=max_size))


SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), text(40),
)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(text(8), inner, max_size=4)),
                      max_leaves=12)

NON_FINITE = st.sampled_from([float("nan"), float("inf"), float("-inf")])
SMALL_INT = st.integers(min_value=-3, max_value=40)
COMMON = {
    "model": st.one_of(st.just("tiny"), text(10), SCALARS),
    "max_tokens": st.one_of(SMALL_INT, VALUES),
    "temperature": st.one_of(st.floats(min_value=-1, max_value=3), NON_FINITE, VALUES),
    "top_p": st.one_of(st.floats(min_value=-0.5, max_value=1.5), NON_FINITE, VALUES),
    "top_k": st.one_of(SMALL_INT, VALUES),
    "n": st.one_of(st.integers(min_value=-1, max_value=20), VALUES),
    "stream": st.one_of(st.booleans(), VALUES),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), VALUES),
    "stop": st.one_of(text(5), st.lists(text(5), max_size=20), VALUES),
    "seed": st.one_of(st.integers(min_value=-(2**64), max_value=2**64), VALUES),
    "logprobs": st.one_of(st.booleans(), SMALL_INT, VALUES),
    "priority": st.one_of(SMALL_INT, VALUES),
    "speculative": st.one_of(st.booleans(), VALUES),
    "reference_text": st.one_of(text(30), VALUES),
    "ignore_eos": st.one_of(st.booleans(), VALUES),
    "presence_penalty": st.one_of(st.floats(min_value=-3, max_value=3), VALUES),
    "logit_bias": st.one_of(st.dictionaries(text(3), st.floats(-5, 5), max_size=2), VALUES),
    "user": st.one_of(text(20), VALUES),
    "response_format": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "xml"])}),
                                 st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.one_of(
                                     st.fixed_dictionaries({"name": st.just("s"), "schema": st.sampled_from(
                                         [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"type": "array"},
                                          {"minimum": 3}, {"type": 7}])}), VALUES)}),
                                 VALUES),
    "tools": st.one_of(st.just([]), VALUES, st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "x"]), "function": st.one_of(
        st.fixed_dictionaries({"name": st.one_of(text(6), st.just("f"))}, optional={"parameters": st.one_of(VALUES, st.just({"type": 7}))}),
        VALUES)}), max_size=2)),
    "frequency_penalty": st.one_of(st.floats(min_value=-3, max_value=3), VALUES),
    "repetition_penalty": st.one_of(st.floats(min_value=-1, max_value=3), NON_FINITE, VALUES),
    "min_p": st.one_of(st.floats(min_value=-0.5, max_value=1.5), NON_FINITE, VALUES),
    "min_tokens": st.one_of(SMALL_INT, VALUES),
    "stop_token_ids": st.one_of(st.lists(st.integers(min_value=-2, max_value=50000), max_size=5),
                                st.just(list(range(49152))), VALUES),
    "include_stop_str_in_output": st.one_of(st.booleans(), VALUES),
    "request_class": st.one_of(st.sampled_from(["a", "b.c", "x" * 65]), text(8), VALUES),
    "guided_choice": st.one_of(st.lists(text(6), max_size=3), VALUES),
    "guided_regex": st.one_of(st.sampled_from(["[a-z]+", "(yes|no)", "\\d{1,3}", "[", "a*", "", "(?=x)y"]), text(8), VALUES),
    "guided_json": st.one_of(st.sampled_from([{"type": "object"}, {"type": "integer"}, {"enum": ["a", 1]}, {"type": "bogus"},
                                              "{\"type\": \"string\"}", "{"]), VALUES),
    "guided_grammar": st.one_of(st.sampled_from(['root ::= "a" | "b"', "root ::=", 'root ::= [0-9]+']), text(10), VALUES),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}}]), VALUES),
}
PROMPT = st.one_of(text(60), st.lists(text(20), max_size=3),
                   st.lists(st.integers(min_value=-5, max_value=60000), max_size=20),
                   st.lists(st.lists(st.integers(min_value=0, max_value=50000), max_size=5), max_size=3), VALUES)
MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "bot"]),
                           "content": st.one_of(text(40), st.lists(st.fixed_dictionaries(
                               {"type": st.just("text"), "text": text(10)}), max_size=2), VALUES)},
                          optional={"name": st.one_of(text(8), VALUES)}),
    VALUES,
)


def _body(extra: dict) -> st.SearchStrategy[dict]:
    fields = {**COMMON, **extra}
    return st.fixed_dictionaries({}, optional=fields).flatmap(
        lambda d: st.dictionaries(text(6), VALUES, max_size=2).map(lambda junk: {**junk, **d})
    )


@pytest.fixture(scope="module")
def fuzz_server(tiny_tok_checkpoint):
    llm = LLM("tiny", dtype="float32", checkpoint=tiny_tok_checkpoint, max_model_len=64, max_num_seqs=16,
              spec_method="ngram", spec_policy="always", profile_spec_costs=False)
    with serve(llm, "tiny", max_waiting=8, api_key=KEY, protect_metrics=True, max_request_bytes=1 << 16) as live:
        yield live


def _post(live, path: str, payload: bytes) -> httpx.Response:
    return httpx.post(live.base_url + path, content=payload, headers={"content-type": "application/json", **AUTH},
                      timeout=60)


# FUZZ_EXAMPLES raises the count for a longer hunt.
FUZZ_SETTINGS = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "150")), deadline=None,
                         suppress_health_check=list(HealthCheck))


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


RESPONSE_ITEM = st.one_of(
    MESSAGE,
    st.fixed_dictionaries({"type": st.sampled_from(["function_call", "function_call_output", "message", "x"])},
                          optional={"call_id": st.one_of(text(6), VALUES), "name": st.one_of(st.just("f"), text(6)),
                                    "arguments": st.one_of(st.just("{}"), text(10), VALUES),
                                    "output": st.one_of(text(10), VALUES), "role": st.sampled_from(["user", "developer"]),
                                    "content": st.one_of(text(10), st.lists(st.fixed_dictionaries({
                                        "type": st.sampled_from(["input_text", "output_text", "input_image"]),
                                        "text": text(6)}), max_size=2))}),
)


@FUZZ_SETTINGS
@given(body=_body({"input": st.one_of(text(40), st.lists(RESPONSE_ITEM, max_size=4), VALUES),
                   "instructions": st.one_of(text(20), VALUES),
                   "max_output_tokens": st.one_of(SMALL_INT, VALUES),
                   "tools": st.one_of(VALUES, st.lists(st.fixed_dictionaries(
                       {"type": st.sampled_from(["function", "web_search"]), "name": st.one_of(st.just("f"), text(6))},
                       optional={"parameters": st.one_of(VALUES, st.just({"type": 7}))}), max_size=2)),
                   "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required", {"type": "function", "name": "f"}]),
                                            VALUES),
                   "text": st.one_of(st.fixed_dictionaries({"format": st.one_of(
                       st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])},
                                             optional={"schema": st.sampled_from([{"type": "object"}, {"type": 7}])}),
                       VALUES)}), VALUES),
                   "previous_response_id": st.one_of(text(8), VALUES), "store": st.one_of(st.booleans(), VALUES),
                   "metadata": VALUES}))
def test_fuzz_responses(fuzz_server, body):
    r = _post(fuzz_server, "/v1/responses", json.dumps(body).encode())
    assert r.status_code < 500, (body, r.text)
    if r.status_code != 200:
        assert "error" in r.json()


# Bodies of valid values only, in any combination: they reach sampling, speculation, grammars,
# penalties, logprobs and streaming instead of stopping at validation.
VOCAB = 49152
VALID = {
    "max_tokens": st.integers(min_value=1, max_value=12),
    "min_tokens": st.integers(min_value=0, max_value=12),
    "temperature": st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    "top_p": st.sampled_from([0.01, 0.5, 1.0]),
    "top_k": st.sampled_from([-1, 0, 1, 3, 50]),
    "min_p": st.sampled_from([0.0, 0.3, 1.0]),
    "n": st.integers(min_value=1, max_value=3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "stop": st.one_of(text(3).filter(bool), st.lists(text(3).filter(bool), max_size=3)),
    "stop_token_ids": st.lists(st.integers(min_value=0, max_value=VOCAB - 1), max_size=4),
    "include_stop_str_in_output": st.booleans(),
    "seed": st.integers(min_value=0, max_value=2**40),
    "presence_penalty": st.sampled_from([-2.0, 0.0, 1.5]),
    "frequency_penalty": st.sampled_from([-2.0, 0.0, 2.0]),
    "repetition_penalty": st.sampled_from([0.5, 1.0, 2.0]),
    "logit_bias": st.dictionaries(st.integers(min_value=0, max_value=VOCAB - 1).map(str), st.sampled_from([-100, -1, 5, 100]),
                                  max_size=3),
    "ignore_eos": st.booleans(),
    "speculative": st.booleans(),
    "priority": st.integers(min_value=-2, max_value=2),
    "request_class": st.sampled_from(["default", "chat", "batch.1"]),
    "guided_choice": st.lists(text(4).filter(bool), min_size=1, max_size=3),
    "guided_regex": st.sampled_from(["[a-z]{1,5}", "(yes|no)", "\\d{1,3}"]),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]),
}


TOOLS = [{"type": "function", "function": {"name": "a", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}},
         {"type": "function", "function": {"name": "b"}}]


@pytest.fixture(scope="module")
def draft_server(tiny_tok_checkpoint):
    """The same tiny model drafting for itself with its first layer, in trees: the model-drafter
    paths (its own KV, tree verification, its memory in /metrics every step)."""
    llm = LLM("tiny", dtype="float32", checkpoint=tiny_tok_checkpoint, max_model_len=64, max_num_seqs=16,
              spec_method="draft", draft_checkpoint=tiny_tok_checkpoint, draft_num_layers=1, draft_p_min=0.0,
              spec_tree="tree", spec_policy="always", profile_spec_costs=False)
    with serve(llm, "tiny", max_waiting=8, api_key=KEY, protect_metrics=True, max_request_bytes=1 << 16) as live:
        yield live


@pytest.fixture(params=["ngram", pytest.param("draft", marks=pytest.mark.slow)])
def valid_server(request):
    return request.getfixturevalue("fuzz_server" if request.param == "ngram" else "draft_server")


@FUZZ_SETTINGS
@given(body=st.fixed_dictionaries({"prompt": st.one_of(text(30), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)),
                                   "logprobs": st.integers(min_value=0, max_value=5), "echo": st.booleans()},
                                  optional=VALID))
def test_fuzz_valid_completions(valid_server, body):
    _check_valid(valid_server, "/v1/completions", body)


@FUZZ_SETTINGS
@given(body=st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]), "content": text(20)}), min_size=1, max_size=3)},
    optional={**VALID, "logprobs": st.booleans(), "top_logprobs": st.integers(min_value=0, max_value=20),
              "tools": st.lists(st.sampled_from(TOOLS), min_size=1, max_size=2, unique_by=lambda t: t["function"]["name"]),
              "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "a"}}]),
              "parallel_tool_calls": st.booleans()}))
def test_fuzz_valid_chat(valid_server, body):
    _check_valid(valid_server, "/v1/chat/completions", body)


def _check_valid(live, path: str, body: dict) -> None:
    """Valid fields may still conflict (a grammar with ignore_eos, min_tokens above max_tokens): a
    400 that says why. Otherwise a 200 whose body, or every streamed event, is strict JSON."""
    r = _post(live, path, json.dumps(body).encode())
    assert r.status_code in (200, 400), (body, r.text)
    if r.status_code == 400:
        assert r.json()["error"]["message"], (body, r.text)
        return
    if body.get("stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", (body, r.text[-500:])
        for e in events[:-1]:
            assert "error" not in json.loads(e, parse_constant=_refuse), (body, e)
    else:
        assert len(json.loads(r.text, parse_constant=_refuse)["choices"]) == body.get("n", 1), (body, r.text)


def _refuse(name: str) -> None:
    raise AssertionError(f"{name} in a response: not JSON")


@FUZZ_SETTINGS
@given(raw=st.one_of(st.binary(max_size=64), st.text(max_size=64).map(str.encode), VALUES.map(lambda v: json.dumps(v).encode())))
def test_fuzz_raw_bytes(fuzz_server, raw):
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/admin/speculation"):
        r = _post(fuzz_server, path, raw)
        assert r.status_code < 500, (path, raw, r.text)


HEADER_VALUE = st.one_of(
    st.binary(max_size=40),
    text(20).map(lambda s: s.encode("utf-8", "surrogatepass")),  # UTF-8, and lone surrogates as CESU bytes
    st.just(f"Bearer {KEY}".encode()),
).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
# Header names that do not change the framing (Content-Length, Transfer-Encoding stay the client's).
HEADER_NAME = st.one_of(
    st.sampled_from([b"Authorization", b"Content-Type", b"Accept", b"User-Agent", b"X-Request-Id", b"Cookie"]),
    st.from_regex(rb"\Ax-[a-z0-9-]{1,10}\Z"),
)


def _raw_status(port: int, request: bytes) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(request)
        data = b""
        while b"\r\n" not in data:
            chunk = s.recv(4096)
            assert chunk, "the server closed the connection without an answer"
            data += chunk
    return int(data.split(b" ", 2)[1])


@FUZZ_SETTINGS
@given(headers=st.lists(st.tuples(HEADER_NAME, HEADER_VALUE), max_size=4),
       path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/metrics", "/v1/models"]))
def test_fuzz_headers(fuzz_server, headers, path):
    body = json.dumps({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    if "completions" not in path:
        body = b""
    head = [f"{'POST' if body else 'GET'} {path} HTTP/1.1".encode(), b"Host: x", b"Content-Type: application/json",
            b"Content-Length: " + str(len(body)).encode()]
    head += [name + b": " + value for name, value in headers]
    status = _raw_status(fuzz_server.port, b"\r\n".join(head) + b"\r\n\r\n" + body)
    assert status < 500, (headers, status)


@pytest.mark.parametrize("which", ["fuzz_server", "draft_server"])
def test_server_healthy_after_fuzz(request, which):
    live = request.getfixturevalue(which)
    r = httpx.post(live.base_url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4}, headers=AUTH)
    assert r.status_code == 200
    assert httpx.get(live.base_url + "/health").json()["status"] == "ok"
    live.wait_idle()
    eng = live.engine
    assert eng.check_integrity()
    assert all(b.ref_cnt == 0 for b in eng.kv_manager.pool.blocks)
    if eng.proposer is not None and hasattr(eng.proposer, "kv"):
        assert eng.proposer.kv.num_free_blocks == eng.proposer.kv.num_blocks
