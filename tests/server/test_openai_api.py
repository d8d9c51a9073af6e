"""The official `openai` client against a live specserve server with SmolLM2 on loopback."""

from __future__ import annotations

import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def client(smol_server):
    return openai.OpenAI(base_url=smol_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_completion_and_usage(client, smol_server):
    r = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=8, temperature=0)
    tok = smol_server.engine.tokenizer
    assert len(r.choices) == 1 and r.choices[0].text
    assert r.usage.prompt_tokens == len(tok.encode("The capital of France is"))
    assert 1 <= r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.choices[0].finish_reason in ("stop", "length")


def test_chat_and_streaming_equals_non_streaming(client):
    msgs = [{"role": "user", "content": "Name three colors."}]
    full = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=24, temperature=0.8, seed=7)
    text = full.choices[0].message.content
    assert text and full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=24, temperature=0.8, seed=7,
                                            stream=True, stream_options={"include_usage": True})
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            if ch.delta.content:
                pieces.append(ch.delta.content)
            if ch.finish_reason:
                finish = ch.finish_reason
    assert "".join(pieces) == text
    assert finish == full.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_n_choices_and_seed_reproducibility(client):
    kw = dict(model="smollm2", prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=42)
    a = client.completions.create(n=2, **kw)
    b = client.completions.create(n=2, **kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text  # distinct samples
    c = client.completions.create(**{**kw, "seed": 43})
    assert c.choices[0].text != a.choices[0].text
    assert 2 <= a.usage.completion_tokens <= 24  # counted over both choices
    assert a.usage.prompt_tokens == c.usage.prompt_tokens  # the prompt counts once, not once per choice


def test_stop_strings(client):
    r = client.completions.create(model="smollm2", prompt="def add(a, b):", max_tokens=40, temperature=0, stop=["\n"])
    assert r.choices[0].finish_reason == "stop" and "\n" not in r.choices[0].text


def test_streamed_completion_equals_full(client):
    kw = dict(model="smollm2", prompt="List: apples, pears,", max_tokens=20, temperature=0.7, seed=3, stop=[" and"])
    full = client.completions.create(**kw).choices[0].text
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(stream=True, **kw) if ch.choices)
    assert streamed == full


def test_logprobs(client):
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                       temperature=0, logprobs=True)
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens and all(t.logprob <= 0 for t in lp)
    c = client.completions.create(model="smollm2", prompt="Hi", max_tokens=4, temperature=0, logprobs=0)
    assert len(c.choices[0].logprobs.token_logprobs) == c.usage.completion_tokens


def test_extra_body_fields(client):
    r = client.completions.create(
        model="smollm2", prompt="def add(a, b):\n    return a + b\n", max_tokens=10, temperature=0,
        extra_body={"top_k": 5, "speculative": True, "priority": -1, "reference_text": "def add(a, b):\n    return"},
    )
    assert r.choices[0].text is not None


def client_models_retrieve(base: str, name: str):
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0).models.retrieve(name)


def test_models_health_metrics_admin(smol_server):
    base = smol_server.base_url
    models = httpx.get(base + "/v1/models").json()
    assert models["data"][0]["id"] == "smollm2"
    assert httpx.get(base + "/health").json()["status"] == "ok"
    # OpenAI's retrieve-model, vLLM's /version and /ping
    assert client_models_retrieve(base, "smollm2").id == "smollm2"
    missing = httpx.get(base + "/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert httpx.get(base + "/version").json()["version"]
    assert httpx.get(base + "/ping").json()["status"] == httpx.post(base + "/ping").json()["status"] == "ok"
    text = httpx.get(base + "/metrics").text
    for name in ("specserve_time_to_first_token_seconds", "specserve_time_per_output_token_seconds",
                 "specserve_e2e_request_latency_seconds", "specserve_request_queue_time_seconds",
                 "specserve_num_requests_running", "specserve_num_requests_waiting", "specserve_kv_blocks_used",
                 "specserve_kv_blocks_free", "specserve_prefix_cache_hit_rate", "specserve_prompt_tokens_total",
                 "specserve_generation_tokens_total", "specserve_spec_draft_tokens_total",
                 "specserve_spec_accepted_tokens_total", "specserve_inter_token_latency_seconds",
                 "specserve_spec_accepted_length", "specserve_spec_drafts_total", "specserve_spec_guard_holds_total",
                 "specserve_spec_guard_plain_probes_total", "specserve_spec_draft_time_scale"):
        assert name in text, name
    assert httpx.post(base + "/admin/speculation", json={"enabled": False}).json() == {"enabled": False}
    smol_server.wait_idle()
    httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 1})  # let the loop apply it
    assert httpx.get(base + "/admin/speculation").json()["enabled"] is False
    httpx.post(base + "/admin/speculation", json={"enabled": True})
    httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert httpx.get(base + "/admin/speculation").json()["enabled"] is True


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("post", "/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 400),
        ("post", "/v1/completions", {"prompt": "hi", "temperature": 5}, 400),
        ("post", "/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400),
        ("post", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400),
        ("post", "/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, 400),
        ("post", "/v1/completions", {"prompt": "hi", "top_p": 0}, 400),
        ("post", "/v1/completions", {"prompt": "hi", "n": 0}, 400),
        ("post", "/v1/completions", {"prompt": ""}, 400),
        ("post", "/v1/completions", {"prompt": [[]]}, 400),
        ("post", "/v1/completions", {"prompt": [10**12]}, 400),
        ("post", "/v1/completions", {"prompt": "word " * 9000}, 400),
        ("post", "/v1/completions", {}, 400),
        ("post", "/v1/chat/completions", {"messages": []}, 400),
        ("post", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400),
        ("post", "/v1/chat/completions", {"messages": "hello"}, 400),
        ("post", "/v1/nope", {}, 404),
        ("get", "/v1/completions", None, 405),
        ("post", "/admin/speculation", {"enabled": "yes"}, 400),
    ],
)
def test_errors_have_openai_shape(smol_server, method, path, body, status):
    r = httpx.request(method, smol_server.base_url + path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and "type" in err


def test_malformed_json_is_400(smol_server):
    r = httpx.post(smol_server.base_url + "/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    smol_server.wait_idle()
    assert smol_server.engine.check_integrity()


def test_echo_with_logprobs_scores_the_prompt(client, smol_server):
    """lm-eval-harness's loglikelihood request: echo, logprobs, max_tokens 0 (or 1). The echoed
    prompt comes with its tokens' logprobs; they agree with generation's own logprobs."""
    ctx = "The capital of France is"
    gen = client.completions.create(model="smollm2", prompt=ctx, max_tokens=1, temperature=0, logprobs=1)
    cont_lp = gen.choices[0].logprobs.token_logprobs[0]
    text = ctx + gen.choices[0].text
    n_prompt = len(smol_server.engine.tokenizer.encode(text))
    r = client.completions.create(model="smollm2", prompt=text, max_tokens=0, echo=True, logprobs=2, temperature=0)
    c = r.choices[0]
    assert c.text == text and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == n_prompt
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n_prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert lp.token_logprobs[-1] == pytest.approx(cont_lp, abs=1e-3)  # the greedy token, scored in the prompt
    assert max(lp.top_logprobs[-1].values()) == pytest.approx(lp.token_logprobs[-1], abs=1e-3)
    more = client.completions.create(model="smollm2", prompt=text, max_tokens=3, echo=True, logprobs=0, temperature=0)
    assert len(more.choices[0].logprobs.token_logprobs) == n_prompt + more.usage.completion_tokens
    assert more.choices[0].logprobs.token_logprobs[:n_prompt] == pytest.approx(lp.token_logprobs, abs=1e-4)
    chunks = list(client.completions.create(model="smollm2", prompt=text, max_tokens=0, echo=True, logprobs=2,
                                            temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
    assert chunks[0].choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="smollm2", prompt=text, max_tokens=0)


def test_tokenize_and_detokenize(client, smol_server):
    """vLLM's /tokenize (a prompt, or messages through the chat template) counts what the
    completion endpoints count; /detokenize spells ids back."""
    base = smol_server.base_url
    prompt = "The capital of France is"
    r = httpx.post(base + "/tokenize", json={"prompt": prompt})
    assert r.status_code == 200, r.text
    body = r.json()
    done = client.completions.create(model="smollm2", prompt=prompt, max_tokens=1, temperature=0)
    assert body["count"] == len(body["tokens"]) == done.usage.prompt_tokens
    assert body["max_model_len"] == smol_server.engine.max_model_len
    msgs = [{"role": "user", "content": "Name three colors."}]
    r = httpx.post(base + "/tokenize", json={"model": "smollm2", "messages": msgs})
    chat = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=1, temperature=0)
    assert r.status_code == 200 and r.json()["count"] == chat.usage.prompt_tokens
    r = httpx.post(base + "/detokenize", json={"tokens": body["tokens"]})
    assert r.status_code == 200 and r.json()["prompt"] == prompt
    for path, bad, param in (("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": "a", "messages": msgs}, "prompt"),
                             ("/detokenize", {"tokens": [-1]}, "tokens"), ("/detokenize", {"tokens": [10**9]}, "tokens"),
                             ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
                             ("/tokenize", {"prompt": "a", "frobnicate": 1}, "frobnicate")):
        r = httpx.post(base + path, json=bad)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (path, bad, r.text)


def test_continue_final_message_and_chat_template_kwargs(client, smol_server):
    """vLLM's chat extras: the last assistant message is continued (no new turn is opened), and
    chat_template_kwargs reach the template; conflicting settings are 400s."""
    base = smol_server.base_url
    msgs = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is"}]
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    r = httpx.post(base + "/tokenize", json={"messages": msgs, **extra})
    assert r.status_code == 200, r.text
    text = httpx.post(base + "/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
    assert text.endswith("The capital of France is")
    out = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=4, temperature=0, extra_body=extra)
    assert out.usage.prompt_tokens == r.json()["count"]
    assert "Paris" in out.choices[0].message.content
    opened = httpx.post(base + "/tokenize", json={"messages": msgs}).json()
    assert opened["count"] > r.json()["count"]  # a new assistant turn after the closed message
    r = httpx.post(base + "/tokenize", json={"messages": msgs, "chat_template_kwargs": {"unused_switch": True}})
    assert r.status_code == 200 and r.json()["tokens"] == opened["tokens"]
    for bad, param in (({"continue_final_message": True}, "continue_final_message"),
                       ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
                       ({"chat_template_kwargs": [1]}, "chat_template_kwargs")):
        r = httpx.post(base + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)


def test_a_retried_ask_drafts_from_the_first_answer(client, smol_server):
    """The server keeps finished requests' outputs (--suffix-cache-requests): the same ask again
    is drafted from the first answer and comes out the same."""
    eng = smol_server.engine
    msgs = [{"role": "user", "content": "List five facts about the planet Saturn, one per line."}]
    first = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=64, temperature=0)
    smol_server.wait_idle()
    before = eng.spec_counters["num_accepted_tokens"]
    again = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=64, temperature=0)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert eng.spec_counters["num_accepted_tokens"] - before >= again.usage.completion_tokens // 2
    smol_server.wait_idle()
    metrics = httpx.get(smol_server.base_url + "/metrics", timeout=30).text
    kept = [line for line in metrics.splitlines() if line.startswith("specserve_suffix_cache_tokens{")]
    assert kept and float(kept[0].split()[-1]) >= first.usage.completion_tokens


def test_usage_counts_each_requests_drafts(client, smol_server):
    """usage.completion_tokens_details carries OpenAI's predicted-output counters for the request's
    drafts (accepted and rejected draft tokens) and usage.speculation its verify steps, streamed or
    not; they equal the engine's counters over that request. A request that never drafts reports
    zeros and no speculation block."""
    eng = smol_server.engine
    msgs = [{"role": "user", "content": "List five facts about the planet Mars, one per line."}]
    client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=48, temperature=0)
    smol_server.wait_idle()
    for stream in (False, True):
        smol_server.wait_idle()
        before = dict(eng.spec_counters)
        kw = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
        r = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=48, temperature=0, **kw)
        usage = next(c.usage for c in r if c.usage is not None) if stream else r.usage
        smol_server.wait_idle()
        drafted = eng.spec_counters["num_draft_tokens"] - before["num_draft_tokens"]
        accepted = eng.spec_counters["num_accepted_tokens"] - before["num_accepted_tokens"]
        steps = eng.spec_counters["num_drafts"] - before["num_drafts"]
        assert accepted > 0, "the repeated ask drafts from the first answer"
        details = usage.completion_tokens_details
        assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (accepted, drafted - accepted)
        assert usage.speculation == {"verify_steps": steps, "draft_tokens": drafted, "accepted_tokens": accepted,
                                     "decode_steps": usage.completion_tokens - 1 - accepted}  # ended by length
        assert accepted <= usage.completion_tokens - steps  # every verify step also yields the target's own token
    plain = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=16, temperature=0,
                                           extra_body={"speculative": False})
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    assert plain.usage.completion_tokens_details.rejected_prediction_tokens == 0
    assert plain.usage.speculation is None


def test_a_predicted_output_is_drafted_from_and_the_answer_stays_the_models(client, smol_server):
    """OpenAI's Predicted Outputs: `prediction` is drafted from (prompt lookup searches it as text
    before the prompt) and counted in usage; the answer is the model's own either way."""
    msgs = [{"role": "user", "content": "Write a Python function that returns the area of a circle."}]
    plain = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=40, temperature=0,
                                           extra_body={"speculative": False})
    smol_server.wait_idle()
    smol_server.engine.reset_suffix_cache()  # the earlier answer is not what drafts below
    expected = plain.choices[0].message.content
    r = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=40, temperature=0,
                                       prediction={"type": "content", "content": [{"type": "text", "text": expected}]})
    assert r.choices[0].message.content == expected
    details = r.usage.completion_tokens_details
    assert details.accepted_prediction_tokens >= r.usage.completion_tokens // 2
    with pytest.raises(openai.BadRequestError, match="not both"):
        client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=4,
                                       prediction={"type": "content", "content": "x"}, extra_body={"reference_text": "x"})
    with pytest.raises(openai.BadRequestError, match="prediction"):
        client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=4,
                                       prediction={"type": "file", "content": "x"})
