"""Tool calling's text side (models.tools): calls parsed out of a model's text, streamed without
showing a call's start as content, and tools written into prompts with or without template support."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.errors import InvalidRequestError
from specserve.models.chat import ChatError, render_chat
from specserve.models.tools import CallStream, check_tools, forced_calls, forced_schema, parse_calls

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module")
def smollm_tokenizer(smollm_checkpoint):
    return smollm_checkpoint.tokenizer


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_calls_are_parsed_out_of_text_and_the_rest_stays_content():
    text = f"Let me check.\n{CALL}\n<tool_call>{{\"name\": \"get_time\", \"arguments\": \"{{}}\"}}</tool_call>"
    content, calls = parse_calls(text, ["get_weather", "get_time"])
    assert content.strip() == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    # Only calls: no content. A block that does not parse, or names no given tool, stays in the content.
    assert parse_calls(CALL, ["get_weather"])[0] is None
    for bad in ("<tool_call>{not json}</tool_call>", CALL.replace("get_weather", "rm_rf"),
                '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>', "<tool_call>unclosed"):
        content, calls = parse_calls("x " + bad, ["get_weather"])
        assert calls == [] and content == "x " + bad


def test_an_output_that_is_only_a_call_object_is_the_call():
    """Llama-3.1 writes a bare JSON call, Qwen2.5-Coder-1.5B one in a ```json fence; JSON inside prose
    or naming no given tool stays content."""
    args = {"city": "Paris", "unit": "C"}
    obj = json.dumps({"name": "get_weather", "arguments": args}, indent=2)
    for text in (obj, f"```json\n{obj}\n```", f"  ```\n{obj}\n```\n", f"[{obj}, {obj}]", f"{obj}\n{obj}", f"{obj}; {obj}",
                 json.dumps({"name": "get_weather", "parameters": args})):
        content, calls = parse_calls(text, ["get_weather"])
        assert content is None and calls and all(json.loads(c.arguments) == args for c in calls), text
    for text in (f"Here: {obj}", f"```python\n{obj}\n```", json.dumps({"name": "other", "arguments": {}}),
                 '{"answer": 42}', f"[{obj}, 3]", f"{obj}\n{obj[:-3]}", f"{obj} and then", f"[{obj}] [{obj}]"):
        assert parse_calls(text, ["get_weather"]) == (text, []), text


@pytest.mark.parametrize("text", [f"Sure: {CALL} done", "no call at all, just < and <tool and <tool_ca", CALL,
                                  "<tool_call>{broken}</tool_call> tail", "a <tool_call",
                                  '```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```',
                                  '{"answer": 1}', "```python\nprint(1)\n```", "``", "  \n", f"\n{CALL}",
                                  f"Sure.\n{CALL}\n"])
def test_streaming_holds_back_what_may_be_a_call_and_ends_as_the_whole_text_would(text):
    """Fed one character at a time: no streamed piece holds a call's opening, and streamed content
    plus what finish() gives equals parse_calls over the whole text."""
    s = CallStream(["get_weather"])
    streamed = "".join(s.feed(ch) for ch in text)
    assert "<tool_call>" not in streamed
    rest, calls = s.finish()
    content, want = parse_calls(text, ["get_weather"])
    assert streamed + rest == (content or "")
    if text.startswith("```python"):  # an answer that cannot be a call streams at once
        assert CallStream(["get_weather"]).feed(text) == text
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in want]


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.sampled_from(["\n", "  ", "\t", "Sure.", " done", "<", "<tool", "<tool_call>", "{", "x",
                                        CALL, "<tool_call>{broken}</tool_call>", "\u2028"]), max_size=8),
       cuts=st.lists(st.integers(1, 9), min_size=1, max_size=8))
def test_streamed_content_and_calls_are_the_whole_texts_in_any_chunking(pieces, cuts):
    """Whatever the output and however it arrives, streamed content plus finish() is what
    parse_calls gives the whole text (whitespace beside calls alone was streamed as content)."""
    text = "".join(pieces)
    s = CallStream(["get_weather"])
    streamed, at, k = [], 0, 0
    while at < len(text):
        step = cuts[k % len(cuts)]
        streamed.append(s.feed(text[at : at + step]))
        at, k = at + step, k + 1
    rest, calls = s.finish()
    content, want = parse_calls(text, ["get_weather"])
    assert "".join(streamed) + rest == (content or "")
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in want]


def test_forced_schemas_and_their_calls():
    tools = check_tools([WEATHER, TIME], "required")
    schema = forced_schema(tools, "required", parallel=False)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    assert "maxItems" not in forced_schema(tools, "required", parallel=True)
    assert forced_schema(tools, "auto", True) is None
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert forced_schema(tools, named, True) == WEATHER["function"]["parameters"]
    assert forced_schema(tools, {"type": "function", "function": {"name": "get_time"}}, True) == {"type": "object"}
    calls = forced_calls('[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]',
                         "required")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {}), ("get_weather", {"city": "Rome"})]
    assert [c.name for c in forced_calls('{"city": "Oslo"}', named)] == ["get_weather"]
    assert forced_calls('[{"name": "get_time", "argu', "required") is None  # cut short
    # An output nested past Python's recursion limit is no call (RecursionError escaped before).
    deep = "[" * 5000 + "]" * 5000
    assert forced_calls(deep, "required") is None and forced_calls(deep, named) is None
    assert parse_calls(deep, ["get_weather"]) == (deep, [])
    wrapped = '{"name": "get_weather", "arguments": "' + "[" * 5000 + '"}'
    assert parse_calls(f"<tool_call>{deep}</tool_call>", ["get_weather"])[1] == []
    assert parse_calls(wrapped, ["get_weather"]) == (wrapped, [])


@pytest.mark.parametrize(("tools", "choice", "param"), [
    ([{"type": "function", "function": {"name": "has space"}}], "auto", "tools[0].function.name"),
    ([WEATHER, WEATHER], "auto", "tools[1].function.name"),
    ([{"type": "retrieval"}], "auto", "tools[0]"),
    ([WEATHER], {"type": "function", "function": {"name": "get_time"}}, "tool_choice"),
    ([], "required", "tool_choice"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "auto", "tools[0].function.parameters"),
])
def test_bad_tools_are_refused_naming_the_field(tools, choice, param):
    with pytest.raises(InvalidRequestError) as e:
        check_tools(tools, choice)
    assert e.value.param == param


QWEN_LIKE = (  # the parts of Qwen2.5's template that read tools, calls and results
    "{% if tools %}TOOLS:{% for t in tools %}{{ t | tojson }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}"
    "{% if m.tool_call_id %}(for {{ m.tool_call_id }}){% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


def test_a_template_that_reads_tools_gets_them_with_parsed_arguments(smollm_tokenizer):
    prompt = render_chat(smollm_tokenizer, CONVERSATION, chat_template=QWEN_LIKE, tools=check_tools([WEATHER], "auto"))
    assert prompt.startswith("TOOLS:")
    assert json.loads(prompt[len("TOOLS:") : prompt.index(";<user>")]) == WEATHER
    assert '[call get_weather {"city": "Paris"}]' in prompt  # an object, not a JSON string in a string
    assert "<tool>18 C, sunny(for call_1)" in prompt


def test_a_template_without_tools_gets_them_written_into_the_messages(smollm_tokenizer):
    assert "tools" not in (smollm_tokenizer.chat_template or "")
    prompt = render_chat(smollm_tokenizer, CONVERSATION, tools=check_tools([WEATHER], "auto"))
    assert "<tools>\n" + json.dumps(check_tools([WEATHER], "auto")[0]) in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in prompt
    # Without tools a plain conversation renders as before.
    plain = [{"role": "user", "content": "hi"}]
    assert render_chat(smollm_tokenizer, plain) == smollm_tokenizer.apply_chat_template(plain, True)


@pytest.mark.parametrize(("message", "param"), [
    ({"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}, "messages[0].tool_calls"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}, "messages[0].tool_calls[0]"),
    ({"role": "user", "content": "x", "tool_call_id": "c1"}, "messages[0].tool_call_id"),
    # Valid JSON nested past Python's recursion limit: RecursionError, not ValueError (was a 500).
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}]},
     "messages[0].tool_calls[0].function.arguments"),
])
def test_bad_calls_in_a_conversation_are_refused_naming_the_field(smollm_tokenizer, message, param):
    with pytest.raises(ChatError) as e:
        render_chat(smollm_tokenizer, [message])
    assert e.value.param == param


def test_llm_chat_takes_tools_and_their_calls_read_back(smollm_llm):
    """LLM.chat(tools=...) prompts as the server does; a call held to the template's form is read back."""
    from specserve import SamplingParams
    from specserve.sampling_params import StructuredOutput

    params = SamplingParams(max_tokens=48, temperature=0,
                            structured_output=StructuredOutput.regex(r'<tool_call>\n\{"name": "get_weather", '
                                                                     r'"arguments": \{"city": "(Paris|Rome)"\}\}\n</tool_call>'))
    out = smollm_llm.chat(CONVERSATION[:1], params, tools=[WEATHER])[0]
    bare = smollm_llm.chat(CONVERSATION[:1], SamplingParams(max_tokens=1))[0]
    assert len(out.prompt_token_ids) > len(bare.prompt_token_ids) + 50  # the tools' description is in the prompt
    content, calls = parse_calls(out.outputs[0].text, ["get_weather"])
    assert content is None and calls[0].name == "get_weather" and json.loads(calls[0].arguments)["city"] in ("Paris", "Rome")
    with pytest.raises(InvalidRequestError):
        smollm_llm.chat(CONVERSATION[:1], params, tools=[{"type": "function", "function": {"name": "two words"}}])


@pytest.mark.slow
def test_qwen_calls_a_tool_when_asked_and_not_otherwise():
    """The real Qwen2.5-Coder-0.5B with its own template and a get_weather tool (greedy, prompt
    lookup drafting): the weather ask comes back as a call to it, a haiku ask as text."""
    from specserve import LLM, SamplingParams
    from specserve.errors import ModelPackageMissingError
    from specserve.models.bundled import ensure_bundled

    try:
        ensure_bundled("qwen2.5-coder-0.5b-instruct", progress=False)
    except ModelPackageMissingError as exc:
        pytest.skip(f"Qwen2.5-Coder-0.5B is not installed: {exc}")
    llm = LLM("qwen2.5-coder-0.5b-instruct", kv_cache_gib=0.25, spec_method="ngram")
    asks = ["What's the weather like in Paris right now?", "Write a haiku about autumn."]
    outs = llm.chat([[{"role": "user", "content": a}] for a in asks], SamplingParams(max_tokens=64, temperature=0),
                    tools=[WEATHER])
    content, calls = parse_calls(outs[0].outputs[0].text, ["get_weather"])
    assert content is None and [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments)["city"] == "Paris"
    assert parse_calls(outs[1].outputs[0].text, ["get_weather"])[1] == []
