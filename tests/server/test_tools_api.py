"""Tool calling through the OpenAI API on SmolLM2 (the openai client parses every response):
forced calls held to the tools' schemas, calls the model writes itself parsed out of its text
(streamed or not), conversations that carry calls and results, and 400s that name the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}}, "required": ["zone"],
    "additionalProperties": False}}}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
# With tool_choice auto the model writes what it likes; this regex makes it write a call after some text.
WRITES_A_CALL = r'Let me look\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Rome", "unit": "C"\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def client(smol_server):
    return openai.OpenAI(base_url=smol_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _schema(tool):
    return tool["function"]["parameters"]


def test_a_named_tool_is_called_with_arguments_its_schema_accepts(client, smol_server):
    r = client.chat.completions.create(model="smollm2", messages=MSGS, tools=[WEATHER, TIME], max_tokens=48,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       temperature=0.8, seed=3)
    msg = r.choices[0].message
    assert msg.content is None and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), _schema(WEATHER))
    assert r.choices[0].finish_reason == "stop"  # (OpenAI's for a named tool)
    smol_server.wait_idle()
    assert smol_server.engine.check_integrity()


@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_name_given_tools_streamed_or_not(client, smol_server, parallel):
    kw = dict(model="smollm2", messages=MSGS, tools=[WEATHER, TIME], tool_choice="required", max_tokens=96,
              temperature=0, parallel_tool_calls=parallel)
    r = client.chat.completions.create(**kw)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert calls and (parallel or len(calls) == 1)
    for c in calls:
        tool = {"get_weather": WEATHER, "get_time": TIME}[c.function.name]
        jsonschema.validate(json.loads(c.function.arguments), _schema(tool))
    chunks = list(client.chat.completions.create(**kw, stream=True))
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    streamed = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert content == ""
    assert [(tc.index, tc.function.name, tc.function.arguments) for tc in streamed] == [
        (k, c.function.name, c.function.arguments) for k, c in enumerate(calls)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    smol_server.wait_idle()
    assert smol_server.engine.check_integrity()


def test_a_call_the_model_writes_is_parsed_out_of_its_text_streamed_or_not(client):
    kw = dict(model="smollm2", messages=MSGS, tools=[WEATHER], max_tokens=64, temperature=0,
              extra_body={"guided_regex": WRITES_A_CALL})
    r = client.chat.completions.create(**kw)  # tool_choice defaults to auto when tools are given
    msg = r.choices[0].message
    assert msg.content.strip() == "Let me look."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Rome", "unit": "C"})]
    assert r.choices[0].finish_reason == "tool_calls"
    chunks = list(client.chat.completions.create(**kw, stream=True))
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert content == msg.content and "<tool_call" not in content
    streamed = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert [(tc.function.name, tc.function.arguments) for tc in streamed] == [
        (c.function.name, c.function.arguments) for c in msg.tool_calls]
    # tool_choice none: the same text is content, nothing is parsed.
    r = client.chat.completions.create(**kw, tool_choice="none")
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"


def test_a_conversation_with_calls_and_results_is_answered(client):
    msgs = [*MSGS,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
            {"role": "tool", "tool_call_id": "call_7", "content": "18 C and sunny"}]
    r = client.chat.completions.create(model="smollm2", messages=msgs, tools=[WEATHER], tool_choice="none",
                                       max_tokens=8, temperature=0)
    assert r.choices[0].message.content and r.usage.prompt_tokens > 100  # the tools and the result are in the prompt


@pytest.mark.parametrize(("extra", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "ignore_eos": True}, "ignore_eos"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}], "tool_choice": "required"},
     "tools"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{nope"}}]}]}, "arguments"),
])
def test_bad_tool_requests_are_400_naming_the_field(smol_server, extra, param):
    body = {"model": "smollm2", "messages": MSGS, "max_tokens": 4, **extra}
    r = httpx.post(smol_server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert param in (r.json()["error"]["param"] or ""), r.json()
    r = httpx.post(smol_server.base_url + "/v1/completions",
                   json={"model": "smollm2", "prompt": "hi", "max_tokens": 2, "tools": [WEATHER]}, timeout=60)
    assert r.status_code == 400 and "tools" in r.json()["error"]["param"]


@pytest.mark.parametrize("stream", [False, True])
def test_every_choice_of_n_gets_its_own_calls(client, smol_server, stream):
    kw = dict(model="smollm2", messages=MSGS, tools=[WEATHER, TIME], tool_choice="required", max_tokens=96,
              temperature=1.0, seed=11, n=3, stream=stream)
    got: dict[int, list] = {0: [], 1: [], 2: []}
    finish = {}
    if stream:
        for ch in client.chat.completions.create(**kw):
            for c in ch.choices:
                got[c.index] += c.delta.tool_calls or []
                assert not c.delta.content
                if c.finish_reason:
                    finish[c.index] = c.finish_reason
    else:
        r = client.chat.completions.create(**kw)
        for c in r.choices:
            got[c.index] = c.message.tool_calls or []
            finish[c.index] = c.finish_reason
    assert finish == {0: "tool_calls", 1: "tool_calls", 2: "tool_calls"}
    for calls in got.values():
        assert calls
        for c in calls:
            jsonschema.validate(json.loads(c.function.arguments), _schema({"get_weather": WEATHER, "get_time": TIME}[c.function.name]))
    smol_server.wait_idle()
    assert smol_server.engine.check_integrity()


def test_tokenize_counts_the_tools_a_chat_request_would_prompt_with(smol_server, client):
    body = {"model": "smollm2", "messages": MSGS, "tools": [WEATHER]}
    r = httpx.post(smol_server.base_url + "/tokenize", json=body, timeout=60)
    bare = httpx.post(smol_server.base_url + "/tokenize", json={"model": "smollm2", "messages": MSGS}, timeout=60)
    assert r.status_code == bare.status_code == 200, r.text
    assert r.json()["count"] > bare.json()["count"] + 50
    chat = client.chat.completions.create(model="smollm2", messages=MSGS, tools=[WEATHER], tool_choice="none",
                                          max_tokens=1, temperature=0)
    assert chat.usage.prompt_tokens == r.json()["count"]
