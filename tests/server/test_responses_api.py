"""OpenAI's Responses API (POST /v1/responses) on SmolLM2, read by the openai client: the same
answer as chat completions for the same conversation, streamed as typed events, function calls
and their outputs, text.format, and 400s that name the Responses request's fields."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from specserve.server.responses import ResponsesRequest, response_param, to_chat

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(smol_server):
    return openai.OpenAI(base_url=smol_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_response_is_the_chat_completion_of_the_same_conversation(client):
    r = client.responses.create(model="smollm2", instructions="Answer briefly.", input="Name a colour.",
                                max_output_tokens=12, temperature=0)
    c = client.chat.completions.create(model="smollm2", max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."}])
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "smollm2"
    assert r.output_text == c.choices[0].message.content
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (c.usage.prompt_tokens, c.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    want = "incomplete" if c.choices[0].finish_reason == "length" else "completed"
    assert r.status == want and (r.incomplete_details is None) == (want == "completed")
    assert r.instructions == "Answer briefly." and r.max_output_tokens == 12


def test_a_streamed_response_sends_its_events_in_order_and_the_same_text(client):
    kw = dict(model="smollm2", input=[{"role": "developer", "content": "Be terse."},
                                      {"role": "user", "content": [{"type": "input_text", "text": "Count to five."}]}],
              max_output_tokens=16, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if whole.status == "completed" else "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    assert events[0].response.status == "in_progress" and events[0].response.id == events[-1].response.id


@pytest.mark.parametrize("stream", [False, True])
def test_function_calls_go_out_as_items_and_come_back_with_their_outputs(client, stream):
    kw = dict(model="smollm2", input="What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
              max_output_tokens=48, temperature=0.8)
    if stream:
        events = list(client.responses.create(stream=True, **kw))
        r = events[-1].response
        assert "response.function_call_arguments.done" in [e.type for e in events]
    else:
        r = client.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and r.status == "completed"
    for call in calls:
        assert call.name == "get_weather" and call.call_id
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # The call and its output sent back: the same prompt as the chat conversation that carries them.
    follow = client.responses.create(model="smollm2", tools=[WEATHER], max_output_tokens=10, temperature=0, input=[
        {"role": "user", "content": "What is the weather in Paris?"}, calls[0].model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C, sunny"}])
    chat = client.chat.completions.create(
        model="smollm2", max_tokens=10, temperature=0, tools=[{"type": "function", "function": {
            k: v for k, v in WEATHER.items() if k != "type"}}], messages=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": calls[0].call_id, "type": "function", "function": {
                "name": calls[0].name, "arguments": calls[0].arguments}}]},
            {"role": "tool", "tool_call_id": calls[0].call_id, "content": "18 C, sunny"}])
    assert follow.output_text == chat.choices[0].message.content
    assert follow.usage.input_tokens == chat.usage.prompt_tokens


def test_text_format_holds_the_output_to_a_schema(client):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
    r = client.responses.create(model="smollm2", input="Give me a number as JSON.", max_output_tokens=24,
                                text={"format": {"type": "json_schema", "name": "n", "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


@pytest.mark.parametrize("extra, param", [
    ({"input": []}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 10**9}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": 7}}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
])
def test_bad_requests_are_400_naming_the_field(smol_server, extra, param):
    body = {"model": "smollm2", "input": "hi", "max_output_tokens": 4, **extra}
    r = httpx.post(smol_server.base_url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"] or "").startswith(param), r.json()


def test_responses_are_not_stored_and_say_so(smol_server):
    r = httpx.post(smol_server.base_url + "/v1/responses", timeout=60,
                   json={"model": "smollm2", "input": "hi", "previous_response_id": "resp_1"})
    assert r.status_code == 400 and "previous_response_id" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "previous_response_id"
    r = httpx.get(smol_server.base_url + "/v1/responses/resp_1", timeout=60)
    assert r.status_code == 404 and "not stored" in r.json()["error"]["message"]


def test_a_conversation_becomes_the_chat_request_that_asks_the_same():
    req = ResponsesRequest.model_validate({
        "model": "m", "instructions": "sys", "max_output_tokens": 5, "temperature": 0.5, "stream": True,
        "input": [{"role": "developer", "content": "dev"}, {"role": "user", "content": "hi"},
                  {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}", "id": "fc_1"},
                  {"type": "function_call", "call_id": "b", "name": "g", "arguments": "{\"x\": 1}"},
                  {"type": "function_call_output", "call_id": "a", "output": "1"},
                  {"type": "function_call_output", "call_id": "b", "output": "2"},
                  {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}],
        "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "f"},
        "text": {"format": {"type": "json_object"}}, "store": True})
    body = to_chat(req)
    assert [m["role"] for m in body["messages"]] == ["system", "system", "user", "assistant", "tool", "tool", "assistant"]
    assert [c["id"] for c in body["messages"][3]["tool_calls"]] == ["a", "b"]  # one turn's calls together
    assert body["messages"][4] == {"role": "tool", "tool_call_id": "a", "content": "1"}
    assert body["max_completion_tokens"] == 5 and body["temperature"] == 0.5
    assert body["stream_options"] == {"include_usage": True}
    assert body["tools"] == [{"type": "function", "function": {"name": "f"}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert body["response_format"] == {"type": "json_object"}
    assert response_param("messages[2].content") == "input[2].content" and response_param("max_tokens") == "max_output_tokens"
    assert response_param("response_format") == "text.format" and response_param("tools[0]") == "tools[0]"


def test_a_client_that_leaves_a_streamed_response_frees_its_request(smol_server):
    body = {"model": "smollm2", "input": "Write a long story about a lighthouse.", "max_output_tokens": 2000,
            "stream": True, "temperature": 0}
    with httpx.stream("POST", smol_server.base_url + "/v1/responses", json=body, timeout=60) as r:
        assert r.status_code == 200
        deltas = 0
        for line in r.iter_lines():
            deltas += line.startswith("event: response.output_text.delta")
            if deltas == 3:
                break  # the client leaves mid-answer
    smol_server.wait_idle(timeout=20)  # aborted, not run to its 2,000 tokens
    eng = smol_server.engine
    assert eng.check_integrity()
    assert all(b.ref_cnt == 0 for b in eng.kv_manager.pool.blocks)


def test_a_streamed_response_carries_text_with_unicode_line_separators():
    """The chat stream a Responses stream is written from holds its JSON unescaped: an answer with
    U+2028, U+2029 or U+0085 in it (which str.splitlines() also splits at) must come through."""
    import asyncio
    import types

    from specserve.server.app import OpenAIServer, _event

    pieces = ["a\u2028b", "\u2029c\x85", "d\r\ne"]

    async def chat_chunks():  # noqa: ANN202
        for piece in pieces:
            yield _event({"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]})
        yield _event({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}) + "data: [DONE]\n\n"

    async def collect() -> str:
        chunks = chat_chunks()
        resp = types.SimpleNamespace(body_iterator=chunks)
        server = types.SimpleNamespace(model_name="m")
        return "".join([s async for s in OpenAIServer._stream_response(server, resp, ResponsesRequest(input="hi"))])

    sent = asyncio.run(collect())
    events = [json.loads(line[6:]) for line in sent.split("\n") if line.startswith("data: ")]
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == pieces
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "".join(pieces)
