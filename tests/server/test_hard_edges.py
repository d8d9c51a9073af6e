"""Hard edges of the HTTP server, one class of failure at a time: text that is not Unicode, clients
that leave, requests that can never fit, bodies too large to read, data lost or ignored, draining,
and secrets. Each test failed on the server before its fix."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import threading
import time

import httpx
import pytest

from specserve import LLM
from specserve.cli import build_parser, main, resolve_api_key
from specserve.errors import ConfigError

from .conftest import serve

KEY = "sekret-ключ"  # a non-ASCII key: compared as UTF-8 bytes
AUTH = {"Authorization": f"Bearer {KEY}".encode()}
# Tiny model: 512 bytes of KV per token, so this budget holds 1,024 tokens, half the context.
KV_TOKENS = 1024
MAX_MODEL_LEN = 2048
BODY_LIMIT = 2 << 20


@pytest.fixture(scope="module")
def edge(tiny_tok_checkpoint):
    """Tiny model, KV smaller than the context, few slots, an API key, metrics protected."""
    llm = LLM(
        "tiny",
        dtype="float32",
        checkpoint=tiny_tok_checkpoint,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_gib=KV_TOKENS * 512 / (1 << 30),
        max_num_seqs=4,
        spec_method="ngram",
        spec_policy="always",
        profile_spec_costs=False,
    )
    assert llm.engine.kv_manager.capacity_tokens == KV_TOKENS
    with serve(
        llm, "tiny", max_waiting=2, api_key=KEY, protect_metrics=True, max_request_bytes=BODY_LIMIT
    ) as live:
        yield live


def _post(live, path: str, body: dict | bytes, **kw) -> httpx.Response:  # noqa: ANN001
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **AUTH, **kw.pop("headers", {})}
    return httpx.post(live.base_url + path, content=content, headers=headers, timeout=60, **kw)


def _assert_clean(live) -> None:  # noqa: ANN001
    live.wait_idle()
    eng = live.engine
    assert eng.check_integrity()
    assert all(b.ref_cnt == 0 for b in eng.kv_manager.pool.blocks)


def _raw_request(
    port: int, head: bytes, body: bytes = b"", timeout: float = 10.0
) -> tuple[int, bytes]:
    """Send bytes as they are (headers httpx would refuse to send); the status and the rest."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head + b"\r\n\r\n" + body)
        data = b""
        while True:
            header, _, rest = data.partition(b"\r\n\r\n")
            length = re.search(rb"(?i)content-length: (\d+)", header)
            if length and len(rest) >= int(length.group(1)):
                break
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return int(data.split(b"\r\n", 1)[0].split()[1]), data


# ---------------------------------------------------------------------- 1. text that is not Unicode
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
SURROGATE = "@@LONE@@"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": SURROGATE, "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", "a" + SURROGATE], "max_tokens": 2}, "prompt[1]"),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": SURROGATE}]},
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            {
                **CHAT,
                "messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}],
            },
            "messages[0].content[0].text",
        ),
        ("/v1/chat/completions", {**CHAT, "model": SURROGATE}, "model"),
        ("/v1/completions", {"prompt": "x", "stop": SURROGATE}, "stop"),
        ("/v1/completions", {"prompt": "x", "stop": ["ok", SURROGATE]}, "stop[1]"),
        ("/v1/completions", {"prompt": "x", "reference_text": SURROGATE}, "reference_text"),
        ("/v1/chat/completions", {**CHAT, "user": SURROGATE}, "user"),
        (
            "/v1/chat/completions",
            {
                **CHAT,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {SURROGATE: {"type": "string"}}},
                    },
                },
            },
            "response_format.json_schema.schema.properties.\\ud800",
        ),
        ("/v1/completions", {"prompt": "x", "logit_bias": {SURROGATE: 1}}, "logit_bias.\\ud800"),
        # Echoed back in the Response object, never read by the chat path: a 500 after the answer
        # (a stream cut off mid-way) until the Responses body was checked too.
        ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "metadata": {"k": SURROGATE}}, "metadata.k"),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "stream": True, "metadata": {SURROGATE: "v"}},
         "metadata.\\ud800"),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 2,
                           "text": {"format": {"type": "json_object", "description": SURROGATE}}}, "text.format.description"),
    ],
)
def test_lone_surrogates_are_400_naming_the_field(edge, path, body, param):
    raw = json.dumps(body).replace(SURROGATE, "\\ud800").encode()
    r = _post(edge, path, raw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "Unicode" in err["message"], err
    _assert_clean(edge)


@pytest.mark.parametrize(
    "value",
    ["Bearer ключ".encode(), b"Bearer \xff\xfe", b"\xc3\x28", "Bearer sekret-ключ!".encode()],
)
def test_non_ascii_authorization_is_401(edge, value):
    body = json.dumps(CHAT).encode()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: " + value + b"\r\nContent-Length: " + str(len(body)).encode()
    )
    status, data = _raw_request(edge.port, head, body)
    assert status == 401, data
    assert b"invalid_api_key" in data


def test_odd_headers_are_never_5xx(edge):
    body = json.dumps(CHAT).encode()
    for extra in (
        b"X-Whatever: \xff\xfe\xfd",
        b"Content-Type: application/json; charset=\xe9\xe9",
        b"User-Agent: \xf0\x9f\x98\x80",
        b"Accept: \x80\x81",
    ):
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: "
            + AUTH["Authorization"]
            + b"\r\n"
            + extra
            + b"\r\nContent-Length: "
            + str(len(body)).encode()
        )
        status, data = _raw_request(edge.port, head, body)
        assert status < 500, (extra, data)
    _assert_clean(edge)


# ---------------------------------------------------------------------- 2. a client that leaves
def _metric(live, name: str, labels: str = "") -> float:  # noqa: ANN001
    text = httpx.get(live.base_url + "/metrics", headers=AUTH).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and labels in line
    )


def test_non_streaming_request_is_aborted_when_its_client_leaves(edge):
    edge.wait_idle()
    aborted = _metric(edge, "specserve_requests_total", 'finish_reason="abort"')
    body = json.dumps(
        {"prompt": "Count:", "max_tokens": 1000, "ignore_eos": True, "temperature": 1.0}
    ).encode()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: "
        + AUTH["Authorization"]
        + b"\r\nContent-Length: "
        + str(len(body)).encode()
    )
    eng = edge.engine
    with socket.create_connection(("127.0.0.1", edge.port)) as s:
        s.sendall(head + b"\r\n\r\n" + body)
        deadline = time.time() + 30
        while not any(r.num_output_tokens >= 8 for r in list(eng.scheduler.running)):
            assert time.time() < deadline, "the request never started"
            time.sleep(0.01)
    gone = time.time()
    while eng.has_unfinished_requests() or edge.server.async_engine.num_in_flight:
        assert time.time() - gone < 2.0, "the engine kept working for a client that left"
        time.sleep(0.02)
    _assert_clean(edge)
    assert _metric(edge, "specserve_requests_total", 'finish_reason="abort"') == aborted + 1


# ---------------------------------------------------------------------- 3. requests that can never fit
def test_prompt_plus_max_tokens_beyond_the_kv_cache_is_400_before_any_work(edge):
    steps = edge.engine.num_steps
    # 1,500 tokens fit the context (2,048) but not the KV cache (1,024).
    r = _post(edge, "/v1/completions", {"prompt": "hello", "max_tokens": 1500})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert "KV cache holds 1,024 tokens" in err["message"] and "--kv-cache-gib" in err["message"]
    assert edge.engine.num_steps == steps


def test_omitted_max_tokens_is_capped_at_what_fits(edge):
    r = _post(
        edge,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "go"}], "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert (
        usage["total_tokens"] == KV_TOKENS and r.json()["choices"][0]["finish_reason"] == "length"
    )
    _assert_clean(edge)


def test_more_sequences_than_the_server_holds_is_400_not_429(edge):
    r = _post(edge, "/v1/completions", {"prompt": ["a", "b"], "n": 4, "max_tokens": 2})  # 8 > 4 + 2
    assert r.status_code == 400, r.text
    assert "retry-after" not in r.headers
    assert "--max-num-seqs" in r.json()["error"]["message"]


# ---------------------------------------------------------------------- 4. cost before refusal
def test_body_over_the_limit_is_413_from_content_length_before_it_is_sent(edge):
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: "
        + AUTH["Authorization"]
        + b"\r\nContent-Length: "
        + str(10 * BODY_LIMIT).encode()
    )
    status, data = _raw_request(edge.port, head, b'{"prompt": "')  # the rest never comes
    assert status == 413, data
    assert b"--max-request-bytes" in data


def test_chunked_body_over_the_limit_is_413(edge):
    def chunks():  # noqa: ANN202 - no Content-Length: the limit is enforced while reading
        yield b'{"prompt": "'
        for _ in range(BODY_LIMIT // 65536):
            yield b"a" * 65536
        yield b'a"}'  # one byte over (more could be refused unread and reset the connection)

    r = httpx.post(
        edge.base_url + "/v1/completions",
        content=chunks(),
        timeout=60,
        headers={"content-type": "application/json", **AUTH},
    )
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "request_too_large"


def test_prompt_with_too_many_characters_is_refused_before_tokenizing(edge):
    chars = edge.server.max_prompt_chars
    assert chars == KV_TOKENS * edge.server.token_chars
    t0 = time.perf_counter()
    r = _post(edge, "/v1/completions", {"prompt": "ab " * (chars // 3 + 1), "max_tokens": 1})
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"], r.text
    assert time.perf_counter() - t0 < 1.0


def test_health_answers_within_a_second_while_big_prompts_are_handled(edge):
    # ~1.5 MB each, refused by their length; and prompts just under that bound, tokenized.
    big = [
        {"prompt": f"{i} " + "lorem ipsum dolor sit amet " * 55_000, "max_tokens": 1}
        for i in range(3)
    ]
    words = "lorem ipsum " * (edge.server.max_prompt_chars // 12 - 1)
    near = [{"prompt": f"{i} {words}", "max_tokens": 1} for i in range(3)]
    latencies: list[float] = []

    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=120, headers=AUTH) as c:

            async def probe(stop: asyncio.Event) -> None:
                while not stop.is_set():
                    t0 = time.perf_counter()
                    assert (await c.get(edge.base_url + "/health")).status_code == 200
                    latencies.append(time.perf_counter() - t0)
                    await asyncio.sleep(0.05)

            stop = asyncio.Event()
            prober = asyncio.create_task(probe(stop))
            await asyncio.sleep(0.1)
            rs = await asyncio.gather(
                *[c.post(edge.base_url + "/v1/completions", json=b) for b in big + near]
            )
            stop.set()
            await prober
            return [r.status_code for r in rs]

    assert asyncio.run(run()) == [400] * 6
    assert max(latencies) < 1.0, latencies


def test_long_prompts_tokenize_without_holding_the_gil(edge):
    tok = edge.engine.tokenizer
    text = "the quick brown fox jumps over the lazy dog " * 20_000
    gaps: list[float] = []
    done = threading.Event()

    def ticker() -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            time.sleep(0.001)
            gaps.append(time.perf_counter() - t0)

    th = threading.Thread(target=ticker)
    th.start()
    t0 = time.perf_counter()
    ids = tok.encode(text)
    took = time.perf_counter() - t0
    done.set()
    th.join()
    assert len(ids) > 100_000
    assert max(gaps) < max(0.1, took / 3), (max(gaps), took)


# ---------------------------------------------------------------------- 5. data lost or ignored
def _stream(live, path: str, body: dict) -> list[dict]:  # noqa: ANN001
    events = []
    with httpx.stream(
        "POST", live.base_url + path, json={**body, "stream": True}, headers=AUTH, timeout=60
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def test_streamed_chat_logprobs_cover_every_token(edge):
    # A long stop string holds text back, so early tokens have empty text deltas.
    body = {
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": 24,
        "temperature": 1.0,
        "seed": 3,
        "ignore_eos": True,
        "logprobs": True,
        "stop": ["@@@@@@@@@@@@@@@@"],
        "stream_options": {"include_usage": True},
    }
    events = _stream(edge, "/v1/chat/completions", body)
    entries = [
        e
        for ev in events
        for ch in ev["choices"]
        if ch.get("logprobs")
        for e in ch["logprobs"]["content"]
    ]
    usage = next(ev["usage"] for ev in events if ev.get("usage"))
    assert len(entries) == usage["completion_tokens"] == 24
    full = _post(
        edge, "/v1/chat/completions", {k: v for k, v in body.items() if k != "stream_options"}
    ).json()
    assert [e["token"] for e in full["choices"][0]["logprobs"]["content"]] == [
        e["token"] for e in entries
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_top_logprobs_chat(edge, stream):
    body = {
        "messages": [{"role": "user", "content": "abc abc abc"}],
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 5,
    }
    if stream:
        entries = [
            e
            for ev in _stream(edge, "/v1/chat/completions", body)
            for ch in ev["choices"]
            if ch.get("logprobs")
            for e in ch["logprobs"]["content"]
        ]
    else:
        r = _post(edge, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        entries = r.json()["choices"][0]["logprobs"]["content"]
    assert len(entries) == 12
    for e in entries:
        top = e["top_logprobs"]
        assert len(top) == 5
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert top[0]["token"] == e["token"] and top[0]["logprob"] == pytest.approx(
            e["logprob"], abs=1e-4
        )
        # a token's own bytes: its text's where that is whole (a split character's part is U+FFFD)
        assert all(bytes(t["bytes"]).decode() == t["token"] for t in top if "\ufffd" not in t["token"])
    _assert_clean(edge)


def test_logprobs_bytes_and_offsets_follow_characters_split_over_tokens(edge):
    """A character spelled by several tokens (an emoji): chat logprobs give each token's own bytes,
    which join into the character (before: the bytes of U+FFFD), and an echoed prompt's
    text_offset points into its text at the character each token belongs to (before: the offsets
    counted a U+FFFD per token and ran past the text's end)."""
    tok = edge.engine.tokenizer
    emoji = next(c for c in "🫠🎉𝔘ꙮ" if len(tok.encode(c, add_special_tokens=False)) > 1)
    parts = tok.encode(emoji, add_special_tokens=False)
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 1, "logprobs": True, "top_logprobs": 2,
            "logit_bias": {str(parts[0]): 100}}
    r = _post(edge, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    entry = r.json()["choices"][0]["logprobs"]["content"][0]
    assert bytes(entry["bytes"]) == tok.token_bytes(parts[0]) and emoji.encode().startswith(bytes(entry["bytes"]))
    assert entry["token"] == "\ufffd"  # its text alone (vLLM's); the bytes say which part it is
    prompt = f"a{emoji}{emoji} b{emoji}"
    r = _post(edge, "/v1/completions", {"prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 0,
                                        "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    offsets, text = choice["logprobs"]["text_offset"], choice["text"]
    assert text.startswith(prompt) and offsets == sorted(offsets) and offsets[-1] < len(text), (offsets, text)
    ids = tok.encode(prompt, add_special_tokens=True)
    starts = [text.find(emoji, i) for i in range(len(prompt)) if prompt.startswith(emoji, i)]
    assert sum(offsets[j] in starts for j in range(len(ids))) >= 3 * len(parts) - 3  # each part at its character
    # streamed, the offsets run on from chunk to chunk (vLLM's): the same list as the whole response's
    # (before: each chunk's offsets started again at 0)
    body = {"prompt": prompt, "max_tokens": 8, "echo": True, "logprobs": 0, "temperature": 0, "ignore_eos": True,
            "logit_bias": {str(parts[0]): 100}}
    whole = _post(edge, "/v1/completions", body).json()["choices"][0]["logprobs"]["text_offset"]
    streamed = [o for ev in _stream(edge, "/v1/completions", body) for ch in ev["choices"]
                if ch.get("logprobs") for o in ch["logprobs"]["text_offset"]]
    assert streamed == whole and len(whole) > len(ids)
    _assert_clean(edge)


@pytest.mark.parametrize("stream", [False, True])
def test_top_logprobs_completions(edge, stream):
    body = {
        "prompt": "one two one two one two",
        "max_tokens": 10,
        "temperature": 0.8,
        "seed": 5,
        "logprobs": 3,
    }
    if stream:
        blocks = [
            ch["logprobs"] for ev in _stream(edge, "/v1/completions", body) for ch in ev["choices"]
        ]
        tops = [t for b in blocks if b for t in b["top_logprobs"]]
        chosen = [lp for b in blocks if b for lp in b["token_logprobs"]]
    else:
        r = _post(edge, "/v1/completions", body)
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        tops, chosen = lp["top_logprobs"], lp["token_logprobs"]
    assert len(tops) == len(chosen) == 10
    for top, mine in zip(tops, chosen):
        assert 1 <= len(top) <= 3  # texts of distinct tokens may coincide
        assert max(top.values()) >= mine - 1e-4


@pytest.mark.parametrize("path", ["plain", "chain", "tree"])
def test_top_logprobs_from_every_sampling_path(tiny_tok_checkpoint, path):
    """Plain decoding, verified chains and verified trees each give every emitted token its k
    likeliest tokens; greedy, the chosen token heads the list with its own logprob."""
    from specserve import SamplingParams
    from specserve.spec.tree import DraftTree

    def make(**spec) -> LLM:  # noqa: ANN003
        return LLM(
            "tiny",
            dtype="float32",
            checkpoint=tiny_tok_checkpoint,
            max_model_len=256,
            spec_policy="always",
            profile_spec_costs=False,
            **spec,
        )

    prompt = ["a b a b a b a b a b a b"]
    params = SamplingParams(
        max_tokens=40, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=4
    )
    greedy = make().generate(prompt, params)[0].outputs[0].token_ids
    llm = make(**({} if path == "plain" else {"spec_method": "ngram", "spec_tree": path}))
    if (
        path == "tree"
    ):  # branching drafts: a wrong first sibling, then the right path under the second

        def propose(requests, ks):  # noqa: ANN001, ANN202
            out = {}
            for req in requests:
                nxt = greedy[req.num_output_tokens : req.num_output_tokens + 3]
                if len(nxt) == 3:
                    wrong = (nxt[0] + 1) % llm.engine.arch.vocab_size
                    out[req.request_id] = DraftTree((wrong, *nxt), (-1, -1, 1, 2))
            return out

        llm.engine.proposer.propose = propose
    out = llm.generate(prompt, params)[0].outputs[0]
    assert out.token_ids == greedy
    assert len(out.top_logprobs) == len(out.logprobs) == 40
    for tid, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
        assert len(top) == 4 and top[0][0] == tid and top[0][1] == pytest.approx(lp, abs=1e-4)
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    if path != "plain":
        assert (
            llm.engine.spec_counters["num_accepted_tokens"] > 0
        )  # drafts were verified and accepted


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"frobnicate": 1, "store": True}, "frobnicate"),
        (
            {"messages": [{"role": "user", "content": "hi", "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
            "tool_calls",
        ),
        ({"stream_options": {"include_usage": True, "chunky": 3}}, "chunky"),
    ],
)
def test_unknown_or_unsupported_fields_are_400_naming_them(edge, extra, named):
    r = _post(edge, "/v1/chat/completions", {**CHAT, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert named in err["message"] and named in err["param"], err
    if "store" in extra:
        assert "store" in err["message"]


def test_logit_bias_is_applied_and_bad_entries_are_400(edge):
    """OpenAI's logit_bias: string token ids to biases in [-100, 100]; +100 forces a token."""
    body = {"prompt": [5, 6, 7, 5, 6, 7], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    r = _post(edge, "/v1/completions", body)
    assert r.status_code == 200, r.text
    plain = r.json()["choices"][0]["logprobs"]["tokens"]
    for token in ("9", "11"):
        r = _post(edge, "/v1/completions", {**body, "logit_bias": {token: 100}})
        assert r.status_code == 200, r.text
        forced = r.json()["choices"][0]["logprobs"]["tokens"]
        assert len(forced) == 6 and len(set(forced)) == 1, forced
        assert forced != plain
    for bad, what in (({"abc": 1}, "token ids"), ({"5": 101}, "[-100, 100]"), ({"99999999": 1}, "outside the vocabulary"),
                      ({"-3": 1}, "token ids")):
        r = _post(edge, "/v1/completions", {**body, "logit_bias": bad})
        assert r.status_code == 400, (bad, r.text)
        assert what in r.json()["error"]["message"] and r.json()["error"]["param"] == "logit_bias", r.text


def test_penalties_are_applied_and_range_checked(edge):
    body = {"prompt": [5, 6, 7, 5, 6, 7], "max_tokens": 16, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    plain = _post(edge, "/v1/completions", body).json()["choices"][0]["logprobs"]["tokens"]
    r = _post(edge, "/v1/chat/completions", {**CHAT, "presence_penalty": 1.0, "frequency_penalty": 0.5})
    assert r.status_code == 200, r.text
    r = _post(edge, "/v1/completions", {**body, "frequency_penalty": 2.0, "presence_penalty": 2.0})
    assert r.status_code == 200, r.text
    penalized = r.json()["choices"][0]["logprobs"]["tokens"]
    assert penalized != plain
    assert len(set(penalized)) >= len(set(plain))  # repeats cost more: no fewer distinct tokens
    for name in ("presence_penalty", "frequency_penalty"):
        r = _post(edge, "/v1/completions", {**body, name: 2.5})
        assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text
    r = _post(edge, "/v1/completions", {**body, "repetition_penalty": 1.8})  # vLLM's extra
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"]["tokens"] != plain
    for bad in (0, 1e-300, 0.005, 2.5):  # 1e-300 rounded to 0 in float32 and drew garbage
        r = _post(edge, "/v1/completions", {**body, "repetition_penalty": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty", r.text
    r = _post(edge, "/v1/completions", {**body, "temperature": 1.0, "seed": 1, "min_p": 0.2})  # vLLM's extra
    assert r.status_code == 200, r.text
    r = _post(edge, "/v1/completions", {**body, "min_p": 1.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_p", r.text


def test_min_tokens_stop_token_ids_and_include_stop_str_are_applied(edge):
    """vLLM's extras: stop_token_ids end the output, min_tokens holds them back,
    include_stop_str_in_output keeps the stop string; bad values are 400."""
    body = {"prompt": [5, 6, 7, 5, 6, 7], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    plain = _post(edge, "/v1/completions", body).json()["choices"][0]
    vocab = edge.engine.arch.vocab_size
    r = _post(edge, "/v1/completions", {**body, "stop_token_ids": list(range(vocab)), "logprobs": 1})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and len(choice["logprobs"]["tokens"]) == 1, choice
    # min_tokens leaves the ids below 10 until then: 4 of them at least, then a stop token
    r = _post(edge, "/v1/completions", {**body, "stop_token_ids": list(range(10, vocab)), "logprobs": 1, "min_tokens": 4})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    allowed = {edge.engine.tokenizer.decode([i], skip_special_tokens=False) for i in range(10)}
    tokens = choice["logprobs"]["tokens"]
    assert choice["finish_reason"] == "stop" and len(tokens) >= 5 and set(tokens[:4]) <= allowed, choice
    r = _post(edge, "/v1/completions", {**body, "stop_token_ids": list(range(vocab)), "min_tokens": 4})
    assert r.status_code == 400 and "whole vocabulary" in r.json()["error"]["message"], r.text
    stop = plain["text"][2:4]
    for include in (False, True):
        r = _post(edge, "/v1/completions", {**body, "stop": [stop], "include_stop_str_in_output": include})
        assert r.status_code == 200, r.text
        cut = plain["text"].find(stop) + (len(stop) if include else 0)
        assert r.json()["choices"][0]["text"] == plain["text"][:cut]
    messages = {"messages": CHAT["messages"]}
    r = _post(edge, "/v1/chat/completions", {**messages, "min_tokens": 3})  # max_tokens sized to fit, at least 3
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 3
    for bad, param in (({"min_tokens": 13}, "min_tokens"), ({"min_tokens": -1}, "min_tokens"),
                       ({"stop_token_ids": [-2]}, "stop_token_ids"), ({"stop_token_ids": [vocab + 5]}, "stop_token_ids"),
                       ({"min_tokens": 1.5}, "min_tokens")):
        r = _post(edge, "/v1/completions", {**body, **bad})
        assert r.status_code == 400, (bad, r.text)
        err = r.json()["error"]
        assert err["param"] == param, (bad, err)
    r = _post(edge, "/v1/chat/completions", {**messages, "min_tokens": 5000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
    _assert_clean(edge)


def test_errors_name_the_field_at_fault_and_only_the_reason(edge):
    """A 400's `param` is the request field to fix (none for a body that is not JSON: before,
    the byte offset of the JSON error), and a grammar error gives the reason without the
    library's log prefix (its time and source path)."""
    body = {"prompt": "hello", "max_tokens": 4}
    cases = [
        ({**body, "guided_regex": "("}, "guided_regex"),
        ({**body, "guided_grammar": "root ::= "}, "guided_grammar"),
        ({**body, "guided_choice": []}, "guided_choice"),
        ({**body, "response_format": {"type": "bogus"}}, "response_format"),
        ({**body, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}},
         "response_format"),
    ]
    for bad, param in cases:
        r = _post(edge, "/v1/completions", bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
        assert not re.search(r"\[\d\d:\d\d:\d\d\]|/project/|\.cc:\d", r.json()["error"]["message"]), r.text
    r = _post(edge, "/v1/chat/completions", {**CHAT, "logit_bias": {"99999999": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    long_chat = {"messages": [{"role": "user", "content": "x " * (2 * MAX_MODEL_LEN)}], "max_tokens": 4}
    r = _post(edge, "/v1/chat/completions", long_chat)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    r = _post(edge, "/v1/completions", b'{"model": "x", "prompt": ')
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] is None and "not valid JSON" in err["message"], r.text
    r = _post(edge, "/v1/completions", b"hello", headers={"content-type": "text/plain"})
    assert r.status_code == 400 and "application/json" in r.json()["error"]["message"], r.text
    assert httpx.head(edge.base_url + "/health", timeout=10).status_code == 200
    _assert_clean(edge)


def test_streamed_and_whole_responses_look_alike(edge):
    """A streamed response's id has the same shape as a whole one's (a random id, not the engine's
    request counter, which starts again at every restart), and its last chat chunk carries the
    stop_reason a whole response does."""
    stops = list(range(edge.engine.arch.vocab_size))  # the first token ends it: its id is the stop_reason
    body = {"prompt": [5, 6, 7, 5, 6, 7], "max_tokens": 12, "temperature": 0, "stop_token_ids": stops}
    chat = {**CHAT, "max_tokens": 12, "temperature": 0, "stop_token_ids": stops}
    for path, req in (("/v1/completions", body), ("/v1/chat/completions", chat)):
        whole = _post(edge, path, req).json()
        ref = whole["choices"][0]
        assert isinstance(ref["stop_reason"], int) and ref["finish_reason"] == "stop", ref
        with httpx.stream("POST", edge.base_url + path, content=json.dumps({**req, "stream": True}).encode(),
                          headers={"content-type": "application/json", **AUTH}, timeout=60) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        ids = {e["id"] for e in events}
        assert len(ids) == 1 and re.fullmatch(r"(chatcmpl|cmpl)-[0-9a-f]{24}", ids.pop()), ids
        assert re.fullmatch(r"(chatcmpl|cmpl)-[0-9a-f]{24}", whole["id"]), whole["id"]
        last = [c for e in events for c in e["choices"] if c.get("finish_reason")][-1]
        assert (last["finish_reason"], last["stop_reason"]) == ("stop", ref["stop_reason"]), last
    _assert_clean(edge)


@pytest.mark.parametrize("form", ["ids", "lists of ids", "text"])
@pytest.mark.parametrize("logprobs", [None, 1])
def test_an_echoed_prompt_streams_as_it_answers_whole(edge, form, logprobs):
    """echo with a token-id prompt: the stream echoed nothing where the whole answer echoed the
    prompt's text."""
    ids = edge.engine.tokenizer.encode("hello world, hello")
    prompt = {"ids": ids, "lists of ids": [ids, ids[:3]], "text": "hello world, hello"}[form]
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": logprobs}
    whole = {c["index"]: c["text"] for c in _post(edge, "/v1/completions", body).json()["choices"]}
    streamed: dict[int, str] = {}
    with httpx.stream("POST", edge.base_url + "/v1/completions", content=json.dumps({**body, "stream": True}).encode(),
                      headers={"content-type": "application/json", **AUTH}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed[c["index"]] = streamed.get(c["index"], "") + c["text"]
    assert streamed == whole and all(whole.values())
    _assert_clean(edge)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_model_step_that_fails_is_a_500_naming_the_error_and_the_server_goes_on(edge, monkeypatch, stream, path):
    """A step whose forward raises fails the requests in it (the others go on): their clients get
    a 500 with the exception, or a stream's error event, not a 200 with finish_reason 'error'."""
    runner = edge.engine.runner
    real, failed = runner.execute, []

    def once(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        if not failed:
            failed.append(1)
            raise RuntimeError("the kernel fell over")
        return real(*args, **kw)

    monkeypatch.setattr(runner, "execute", once)
    body = {"max_tokens": 4, "temperature": 0, "stream": stream,
            **({"prompt": "hello hello"} if path == "/v1/completions" else {"messages": CHAT["messages"]})}
    r = _post(edge, path, {**body, "stream_options": {"include_usage": True}} if stream else body)
    if stream:
        events = [json.loads(line[6:]) for line in r.text.split("\n") if line.startswith("data: {")]
        assert "the kernel fell over" in events[-1]["error"]["message"] and r.text.endswith("[DONE]\n\n")
        assert not [c for e in events[:-1] for c in e.get("choices", []) if c.get("finish_reason")]
    else:
        assert r.status_code == 500 and "the kernel fell over" in r.json()["error"]["message"], r.text
    assert _post(edge, path, {**body, "stream": False}).status_code == 200  # the next one is served
    _assert_clean(edge)


def test_logprobs_of_masked_tokens_are_sent_as_finite_numbers(edge, tiny_tok_checkpoint):
    """With --logprobs-mode processed, a grammar that leaves fewer tokens than top_logprobs asks
    for gives the rest logprob -inf, which JSON cannot carry; they are sent as -9999 (vLLM's value),
    not a 500. The default (raw) reports the model's own distribution: every value finite."""
    choice = {"guided_choice": ["yes", "no"], "max_tokens": 4}

    def values(live):  # noqa: ANN001, ANN202
        r = _post(live, "/v1/chat/completions", {**CHAT, **choice, "logprobs": True, "top_logprobs": 20})
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["logprobs"]["content"]
        chat = [t["logprob"] for t in content] + [a["logprob"] for t in content for a in t["top_logprobs"]]
        r = _post(live, "/v1/completions", {"prompt": "x", **choice, "logprobs": 20})
        assert r.status_code == 200, r.text
        return chat, [v for top in r.json()["choices"][0]["logprobs"]["top_logprobs"] for v in top.values()]

    chat, completion = values(edge)
    assert all(-9999.0 < v <= 0 for v in chat + completion), chat + completion
    _assert_clean(edge)
    llm = LLM("tiny", dtype="float32", checkpoint=tiny_tok_checkpoint, max_model_len=256, kv_cache_gib=0.01,
              logprobs_mode="processed", profile_spec_costs=False)
    with serve(llm, "tiny") as live:
        chat, completion = values(live)
    assert -9999.0 in chat and all(-9999.0 <= v <= 0 for v in chat), chat
    assert min(completion) == -9999.0


def test_tokenizer_endpoints_are_behind_the_api_key(edge):
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5, 6]})):
        r = httpx.post(edge.base_url + path, json=body, timeout=30)
        assert r.status_code == 401, r.text
        r = _post(edge, path, body)
        assert r.status_code == 200, r.text


def test_fields_sent_at_their_defaults_are_accepted(edge):
    defaults = {
        "tools": [],
        "tool_choice": "none",
        "parallel_tool_calls": True,
        "store": False,
        "metadata": {},
        "frobnicate": None,
        "functions": None,
        "logit_bias": {},
        "presence_penalty": 0,
        "stream_options": None,
        "service_tier": "auto",
        "repetition_penalty": 1.0,
    }
    r = _post(edge, "/v1/chat/completions", {**CHAT, **defaults})
    assert r.status_code == 200, r.text
    r = _post(edge, "/v1/chat/completions", {**CHAT, "top_logprobs": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"



def test_declared_fields_sent_as_null_take_their_defaults(edge):
    """OpenAI documents n, stream, echo and chat logprobs as nullable; clients that serialise every
    field send null for what they leave unset. Null means the default; a required field stays required."""
    nulls = {"n": None, "stream": None, "logprobs": None, "ignore_eos": None, "min_tokens": None,
             "priority": None, "request_class": None, "add_generation_prompt": None}
    r = _post(edge, "/v1/chat/completions", {**CHAT, **nulls})
    assert r.status_code == 200, r.text
    body = r.json()  # stream null: one JSON body, not an event stream
    assert len(body["choices"]) == 1 and body["choices"][0]["logprobs"] is None
    texts = []
    for echo in (None, False):  # greedy: the same text, without the prompt echoed
        r = _post(edge, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 0, "echo": echo,
                                            "n": None, "stream": None})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 1
        texts.append(r.json()["choices"][0]["text"])
    assert texts[0] == texts[1]
    for path, body, param in (("/v1/chat/completions", {"messages": None}, "messages"),
                              ("/v1/completions", {"prompt": None, "max_tokens": 2}, "prompt")):
        r = _post(edge, path, body)
        assert r.status_code == 400 and param in r.json()["error"]["param"], r.text

# ---------------------------------------------------------------------- 6. draining
def test_drain_answers_503_with_the_listener_open_and_ends_streams_properly(tiny_tok_checkpoint):
    llm = LLM(
        "tiny",
        dtype="float32",
        checkpoint=tiny_tok_checkpoint,
        max_model_len=4096,
        max_num_seqs=4,
        profile_spec_costs=False,
    )
    with serve(llm, "tiny", drain_timeout_s=0.5) as live:
        body = {"prompt": "Once", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        lines: list[str] = []
        with httpx.stream("POST", live.base_url + "/v1/completions", json=body, timeout=60) as resp:
            it = resp.iter_lines()
            lines.append(next(line for line in it if line.startswith("data: ")))
            live.uv.handle_exit(signal.SIGTERM, None)  # what the signal handler does
            deadline = time.time() + 5
            while not live.server.draining:
                assert time.time() < deadline
                time.sleep(0.01)
            late = httpx.post(
                live.base_url + "/v1/completions",
                json={"prompt": "hi", "max_tokens": 2},
                timeout=10,
            )
            assert late.status_code == 503, late.text
            assert late.headers["retry-after"] and late.json()["error"]["code"] == "draining"
            assert httpx.get(live.base_url + "/health", timeout=10).json()["status"] == "draining"
            lines += [line for line in it if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        events = [json.loads(line[6:]) for line in lines[:-1]]
        assert events[-1]["error"]["code"] == "draining"
        assert events[-2]["choices"][0]["finish_reason"] == "abort"
        live.thread.join(timeout=30)
        assert not live.thread.is_alive()
        assert llm.engine.check_integrity()
        assert all(b.ref_cnt == 0 for b in llm.engine.kv_manager.pool.blocks)


# ---------------------------------------------------------------------- 7. secrets
@pytest.mark.parametrize(
    "path", ["/metrics", "/stats", "/docs", "/openapi.json", "/redoc", "/v1/models"]
)
def test_protect_metrics_puts_metrics_and_docs_behind_the_key(edge, path):
    assert httpx.get(edge.base_url + path).status_code == 401
    assert (
        httpx.get(edge.base_url + path, headers={"Authorization": "Bearer wrong"}).status_code
        == 401
    )
    assert httpx.get(edge.base_url + path, headers=AUTH).status_code == 200
    assert httpx.get(edge.base_url + "/health").status_code == 200  # load balancers need no key


def test_api_key_from_env_file_or_flag(tmp_path, monkeypatch):
    def parse(*extra: str):  # noqa: ANN202
        return build_parser().parse_args(["serve", "--model", "m", *extra])

    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    assert resolve_api_key(parse()) is None
    monkeypatch.setenv("SPECSERVE_API_KEY", "from-env")
    assert resolve_api_key(parse()) == "from-env"
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert resolve_api_key(parse("--api-key-file", str(key_file))) == "from-file"
    assert resolve_api_key(parse("--api-key", "from-flag")) == "from-flag"
    with pytest.raises(ConfigError, match="not both"):
        resolve_api_key(parse("--api-key", "a", "--api-key-file", str(key_file)))
    key_file.write_text("  \n")
    with pytest.raises(ConfigError, match="empty"):
        resolve_api_key(parse("--api-key-file", str(key_file)))
    with pytest.raises(ConfigError, match="cannot read"):
        resolve_api_key(parse("--api-key-file", str(tmp_path / "missing")))


def test_logprobs_mode_takes_vllms_names_and_the_short_ones():
    """--logprobs-mode as vLLM spells it (and raw / processed), each to the engine's canonical name."""
    from specserve.cli import engine_kwargs
    from specserve.config import ModelConfig

    for flag, mode in (("raw_logprobs", "raw_logprobs"), ("processed_logprobs", "processed_logprobs"),
                       ("raw_logits", "raw_logits"), ("processed_logits", "processed_logits"),
                       ("raw", "raw_logprobs"), ("processed", "processed_logprobs")):
        kw = engine_kwargs(build_parser().parse_args(["serve", "--model", "m", "--logprobs-mode", flag]))
        assert ModelConfig("m", logprobs_mode=kw["logprobs_mode"]).logprobs_mode == mode
    assert engine_kwargs(build_parser().parse_args(["serve", "--model", "m"]))["logprobs_mode"] == "raw_logprobs"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "m", "--logprobs-mode", "logits"])
    with pytest.raises(ConfigError, match="logprobs_mode"):
        ModelConfig("m", logprobs_mode="logits")


def test_the_model_as_vllms_positional_argument_and_vllms_flag_spellings(monkeypatch, capsys):
    """`specserve serve MODEL` as `vllm serve MODEL` (or --model, not both, not neither), and
    vLLM's --no-enable-prefix-caching / --enable-chunked-prefill spellings of our flags."""
    from specserve.cli import engine_kwargs

    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    assert main(["serve", "no-such-model", "--port", "0"]) == 1
    assert "Model 'no-such-model' is neither a bundled model" in capsys.readouterr().err
    for argv, match in ((["serve", "a", "--model", "b"], "given twice"), (["serve", "--port", "0"], "needs a model")):
        with pytest.raises(SystemExit):
            main(argv)
        assert match in capsys.readouterr().err
    kw = engine_kwargs(build_parser().parse_args(["serve", "m", "--no-enable-prefix-caching", "--no-enable-chunked-prefill"]))
    assert kw["enable_prefix_caching"] is False and kw["enable_chunked_prefill"] is False
    kw = engine_kwargs(build_parser().parse_args(["serve", "m", "--enable-prefix-caching", "--enable-chunked-prefill"]))
    assert kw["enable_prefix_caching"] is True and kw["enable_chunked_prefill"] is True


def test_protect_metrics_without_a_key_is_refused_before_loading(monkeypatch, capsys):
    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    assert main(["serve", "--model", "no-such-model", "--protect-metrics"]) == 1
    assert "--protect-metrics needs an API key" in capsys.readouterr().err


def test_a_port_the_server_cannot_listen_on_is_refused_before_loading(monkeypatch, capsys):
    """A port in use, out of range, or a host that does not resolve: refused at once (the model
    named here does not exist, so reaching the load would give another error)."""
    import socket

    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--model", "no-such-model", "--port", str(port)]) == 1
        assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    assert main(["serve", "--model", "no-such-model", "--host", "no.such.host.invalid"]) == 1
    assert "does not resolve" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "m", "--port", "99999"])
