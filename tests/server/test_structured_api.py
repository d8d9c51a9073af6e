"""Structured output through the OpenAI API: response_format json_object / json_schema, vLLM's
guided_* extras, streaming, and 400s that name what is wrong."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "population": {"type": "integer", "minimum": 0}},
    "required": ["city", "population"],
    "additionalProperties": False,
}
MSGS = [{"role": "user", "content": "Give me a city and its population as JSON."}]


@pytest.fixture(scope="module")
def client(smol_server):
    return openai.OpenAI(base_url=smol_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_json_schema_chat_parses_and_validates_streaming_or_not(client, smol_server):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model="smollm2", messages=MSGS, max_tokens=64, temperature=0.7, seed=1,
                                       response_format=fmt)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    stream = client.chat.completions.create(model="smollm2", messages=MSGS, max_tokens=64, temperature=0.7, seed=1,
                                            response_format=fmt, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == r.choices[0].message.content
    smol_server.wait_idle()
    assert smol_server.engine.check_integrity()


def test_json_object_and_guided_extras(client):
    bob = [{"role": "user", "content": "Return a JSON object with the keys name and age for Bob, who is 42."}]
    # Greedy: speculation leaves greedy output exactly as plain, so this text is the same on every
    # machine and ends. A sampled text's tokens depend on what the adaptive policy drafted (timing)
    # and "any JSON object" has no bound: one may nest until max_tokens, so sampled requests only
    # promise a dict where they stop and an object's opening where they do not.
    r = client.chat.completions.create(model="smollm2", messages=bob, max_tokens=128, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    sampled = client.chat.completions.create(model="smollm2", messages=bob, max_tokens=48, temperature=0.7, seed=3,
                                             n=4, response_format={"type": "json_object"})
    for ch in sampled.choices:
        text = ch.message.content
        assert text.startswith("{"), text
        if ch.finish_reason == "stop":
            assert isinstance(json.loads(text), dict), text
        else:
            assert ch.finish_reason == "length" and sampled.usage.completion_tokens > 0
    c = client.completions.create(model="smollm2", prompt="Is water wet? Answer:", max_tokens=8, temperature=0.9,
                                  extra_body={"guided_choice": ["yes", "no"]})
    assert c.choices[0].text in ("yes", "no")
    c = client.completions.create(model="smollm2", prompt="A date:", max_tokens=16, temperature=0.9,
                                  extra_body={"guided_regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"})
    assert len(c.choices[0].text) == 10 and c.choices[0].text.startswith("20")


@pytest.mark.parametrize("body,needle", [
    ({"response_format": {"type": "xml"}}, "xml"),
    ({"response_format": {"type": "json_schema"}}, "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "compiled"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "one output constraint"),
    ({"guided_regex": "(unclosed"}, "compiled"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    # No finite text satisfies these: the engine's forced-text lookup never returned on them (its
    # string grew until the server ran out of memory), so they are refused before any work.
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "minItems": 1, "items": {"$ref": "#"}}}}}, "no finite value"),
    ({"guided_grammar": 'root ::= "a" | "b" x\nx ::= "c" x'}, "never end"),
    ({"guided_regex": "ab[^\\s\\S]"}, "no finite output"),  # a class no character is in: no token was allowed
    # Schema text that is valid JSON nested past Python's recursion limit (a 500 before).
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": '{"type": "array", "items": ' * 1200 + "{}" + "}" * 1200}}}, "nests deeper"),
])
def test_bad_constraints_are_400_with_a_reason(smol_server, body, needle):
    r = httpx.post(smol_server.base_url + "/v1/chat/completions", timeout=60,
                   json={"model": "smollm2", "messages": MSGS, "max_tokens": 8, **body})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    smol_server.wait_idle()
    eng = smol_server.engine
    assert eng.check_integrity()


@pytest.mark.parametrize("path,body,param", [
    # A compile error names the field the constraint came in, not the one its kind usually comes in.
    ("/v1/completions", {"prompt": "x", "guided_json": {"type": "nonsense"}}, "guided_json"),
    ("/v1/completions", {"prompt": "x", "guided_json": {"type": "array", "minItems": 1, "items": {"$ref": "#"}}},
     "guided_json"),
    ("/v1/chat/completions", {"messages": MSGS, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": 5}}}, "response_format"),
    ("/v1/chat/completions", {"messages": MSGS, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": "{"}}}, "response_format"),
    ("/v1/chat/completions", {"messages": MSGS, "guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
])
def test_constraint_errors_name_the_field_sent(smol_server, path, body, param):
    r = httpx.post(smol_server.base_url + path, timeout=60, json={"model": "smollm2", "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
