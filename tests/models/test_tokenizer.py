"""Our GGUF tokenizers must agree with HF transformers' GGUF tokenizers, id for id."""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

import gguf
import pytest
from tokenizers import AddedToken

from specserve.errors import (
    InvalidRequestError,
    ModelPackageMissingError,
    UnsupportedModelError,
)
from specserve.models.bundled import ensure_bundled
from specserve.models.loader import open_gguf
from specserve.models.tokenizer import IncrementalDetokenizer, Tokenizer, _byte_level_pre_tokenizer
from specserve.testing import plain_memmap

MODELS = {"smollm2": "smollm2-135m-instruct", "qwen05": "qwen2.5-coder-0.5b-instruct"}

TEXTS = [
    "Hello world",
    "Hello, World! How are you?",
    "I'm here, you're there, they'll've gone, she'd, it's, we've",
    "I'M LOUD AND IT'S FINE'S",
    "12345 abc 2024",
    "x = 1000000;\n",
    " 1 22 333 4444 55555",
    "3.14159 + 2.71828 = 5.85987",
    "0000000000",
    "def f(x):\n    return x**2  # square\n",
    "```python\nprint('hi')\n```",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "  leading spaces",
    "trailing spaces   ",
    "tabs\t\tand\t\tspaces",
    "a\n\nb\r\n\tc",
    "   \n   \n",
    "I've   been\n\n\n\nthere",
    "\n",
    "日本語のテキストです。",
    "Ελληνικά Русский العربية עברית",
    "ünïcödé café naïve façade",
    "emoji 🎉🎉 👍🏽 🇫🇷 👨‍👩‍👧",
    "Ωmega ∑ ∫ √ ≠ ≤",
    "\u200b zero\u00a0width and nbsp",
    "$var @user #tag %percent ^caret",
    "...!!!???---___",
    "http://example.com/path?q=1&r=2#frag",
    "mixedCASE_snake_case camelCase PascalCase",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "a<|im_end|>b<|endoftext|>c",
    "<|im_start|><|im_start|>",
    '<tool_call>{"name": "f"}</tool_call>',
    "x" * 64,
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there 🎉"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?\nThanks."},
    ],
]


def _bundled_or_skip(name: str) -> Path:
    try:
        return ensure_bundled(name, progress=False)
    except ModelPackageMissingError as exc:
        pytest.skip(f"bundled model {name} is not installed: {exc}")


@functools.cache
def _ours(key: str) -> Tokenizer:
    return Tokenizer.from_gguf(open_gguf(_bundled_or_skip(MODELS[key])))


@pytest.fixture(scope="module", params=sorted(MODELS))
def pair(request):
    """(our tokenizer, HF's tokenizer built from the same GGUF) — built once per model."""
    path = _bundled_or_skip(MODELS[request.param])
    transformers = pytest.importorskip("transformers")
    ours = _ours(request.param)
    with plain_memmap():  # only speeds up gguf's reader
        hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return ours, hf


def test_encode_matches_hf(pair):
    ours, hf = pair
    mismatches = []
    for text in TEXTS:
        for special in (False, True):
            a = ours.encode(text, add_special_tokens=special)
            b = hf.encode(text, add_special_tokens=special)
            if a != b:
                mismatches.append((text, special, a, b))
    assert not mismatches


def test_decode_matches_hf_and_round_trips(pair):
    ours, hf = pair
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ours.decode(ids, skip_special_tokens=False) == text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            )


def test_special_tokens(pair):
    ours, hf = pair
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.eos_token_id == hf.eos_token_id
    assert ours.add_bos_token is False  # both files say so
    im_start = ours.token_to_id("<|im_start|>")
    assert ours.encode("<|im_start|>", add_special_tokens=False) == [im_start]
    assert im_start in ours.special_token_ids
    assert ours.id_to_token(im_start) == "<|im_start|>"
    assert ours.eos_token_id in ours.stop_token_ids
    assert ours.token_to_id("<|im_end|>") in ours.stop_token_ids
    assert ours.token_to_id("<|endoftext|>") in ours.stop_token_ids
    assert im_start not in ours.stop_token_ids
    assert ours.vocab_size >= hf.vocab_size


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["single", "multi"])
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_hf(pair, conversation, gen):
    ours, hf = pair
    expected = hf.apply_chat_template(conversation, add_generation_prompt=gen, tokenize=False)
    assert ours.apply_chat_template(conversation, add_generation_prompt=gen) == expected


def test_chat_template_errors(pair):
    ours, _ = pair
    strict = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok"
    )
    with pytest.raises(InvalidRequestError, match="user first"):
        ours.apply_chat_template([{"role": "assistant", "content": "x"}], chat_template=strict)
    assert (
        ours.apply_chat_template([{"role": "user", "content": "x"}], chat_template=strict) == "ok"
    )


def _stream(detok: IncrementalDetokenizer, ids: list[int], sizes: list[int]) -> list[str]:
    deltas, i = [], 0
    for n in sizes:
        deltas.append(detok.append(ids[i : i + n]))
        i += n
    deltas.append(detok.flush())
    return deltas


def test_incremental_detokenizer_matches_full_decode(pair):
    ours, _ = pair
    prompt = ours.encode("<|im_start|>assistant\n", add_special_tokens=False)
    rng = random.Random(0)
    held_back = False
    for text in TEXTS + ["".join(TEXTS)]:
        ids = ours.encode(text, add_special_tokens=False)
        for sizes in ([1] * len(ids), _random_sizes(rng, len(ids))):
            for skip in (True, False):
                detok = IncrementalDetokenizer(ours, prompt, skip_special_tokens=skip)
                deltas = _stream(detok, ids, sizes)
                assert "".join(deltas) == detok.text == ours.decode(ids, skip_special_tokens=skip)
                # Nothing emitted may contain a half character.
                assert not any("\ufffd" in d for d in deltas)
                held_back |= any(d == "" for d in deltas[:-1])
    assert held_back  # some multi-byte character was split across tokens and held back


def test_detokenizer_text_after_a_chunk_is_the_text_one_token_at_a_time(pair):
    """Fed several ids at once (a speculative step's), the detokenizer shows what fed one at a
    time it would after the same ids, also where the chunk ends inside a character: the text
    stop strings and min_tokens are measured on, and what a stream has sent."""
    ours, _ = pair
    rng = random.Random(1)
    texts = [t for t in TEXTS if any(ord(c) > 127 for c in t)] + ["🚀🚀 x 🚀" * 4, "日本語 🙂 café " * 3]
    for text in texts:
        ids = ours.encode(text, add_special_tokens=False)
        one = IncrementalDetokenizer(ours, [])
        seen = [one.text]
        for i in ids:
            one.append([i])
            seen.append(one.text)
        for _ in range(6):
            chunked, n = IncrementalDetokenizer(ours, []), 0
            for size in _random_sizes(rng, len(ids)):
                chunked.append(ids[n : n + size])
                n += size
                assert chunked.text == seen[n], (text, n)


def test_detokenizer_splits_multibyte_characters(pair):
    ours, _ = pair
    # A rare character without a token of its own is spelled with several partial-byte tokens.
    char = next(c for c in "🎉𝔘ꙮ🫠" if len(ours.encode(c, add_special_tokens=False)) > 1)
    ids = ours.encode(char, add_special_tokens=False)
    detok = IncrementalDetokenizer(ours, [])
    outputs = [detok.append([i]) for i in ids]
    assert outputs[:-1] == [""] * (len(ids) - 1)
    assert outputs[-1] == char


def test_token_bytes_are_the_bytes_each_token_stands_for(pair):
    """token_bytes: joined over a text's tokens, its UTF-8 bytes (characters split over tokens
    included, whose text alone is U+FFFD); for every id, the bytes its decoded text is where that
    text is whole; an added token is its spelling."""
    ours, _ = pair
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert b"".join(ours.token_bytes(i) for i in ids) == text.encode("utf-8"), text
    split = [i for i in ours.encode("🎉𝔘ꙮ🫠", add_special_tokens=False) if ours.decode([i]) == "\ufffd"]
    assert split and all(0 < len(ours.token_bytes(i)) < 4 for i in split)
    for i in range(ours.vocab_size):
        text = ours.decode([i], skip_special_tokens=False)
        if "\ufffd" not in text:
            assert ours.token_bytes(i) == text.encode("utf-8"), i
    assert ours.token_bytes(ours.vocab_size + 10) == b""


def test_detokenizer_window_stays_small(pair):
    ours, _ = pair
    detok = IncrementalDetokenizer(ours, [])
    ids = ours.encode("word " * 400, add_special_tokens=False)
    for i in ids:
        detok.append([i])
    assert detok.text == "word " * 400
    assert len(detok._window) <= 2  # old ids are dropped, so each step decodes a few tokens


def _random_sizes(rng: random.Random, total: int) -> list[int]:
    sizes = []
    while total > 0:
        sizes.append(min(total, rng.randint(1, 4)))
        total -= sizes[-1]
    return sizes


def test_fingerprint_identifies_vocabulary(pair):
    ours, _ = pair
    fp = ours.fingerprint()
    assert len(fp) == 64 and fp == ours.fingerprint()
    other = Tokenizer(
        ours.backend,
        merges=ours._merges[:-1],
        bos_token_id=ours.bos_token_id,
        eos_token_id=ours.eos_token_id,
        add_bos_token=False,
        chat_template=None,
    )
    assert other.fingerprint() != fp


def test_fingerprints_differ_between_models():
    fps = {_ours(key).fingerprint() for key in MODELS}
    assert len(fps) == len(MODELS)


def test_from_dir_round_trip(pair, tmp_path):
    ours, _ = pair
    ours.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": ours.id_to_token(ours.bos_token_id),
                "eos_token": {"content": ours.id_to_token(ours.eos_token_id)},
                "add_bos_token": False,
                "chat_template": ours.chat_template,
            }
        )
    )
    loaded = Tokenizer.from_dir(tmp_path)
    assert loaded.fingerprint() == ours.fingerprint()
    assert (loaded.bos_token_id, loaded.eos_token_id) == (ours.bos_token_id, ours.eos_token_id)
    assert loaded.stop_token_ids == ours.stop_token_ids
    assert loaded.special_token_ids == ours.special_token_ids
    for text in TEXTS:
        assert loaded.encode(text) == ours.encode(text)
    conv = CONVERSATIONS[1]
    assert loaded.apply_chat_template(conv) == ours.apply_chat_template(conv)


def test_from_dir_bos_and_generation_config(pair, tmp_path):
    ours, _ = pair
    ours.backend.save(str(tmp_path / "tokenizer.json"))
    bos = ours.bos_token_id
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": ours.id_to_token(bos), "add_bos_token": True})
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [bos, 7]}))
    loaded = Tokenizer.from_dir(tmp_path)
    assert loaded.encode("hi") == [bos] + ours.encode("hi")
    assert loaded.encode("hi", add_special_tokens=False) == ours.encode("hi")
    assert {bos, 7} <= loaded.stop_token_ids
    assert loaded.chat_template is None
    with pytest.raises(InvalidRequestError, match="no chat template"):
        loaded.apply_chat_template([{"role": "user", "content": "hi"}])


def _write_tiny_vocab_gguf(
    path: Path, model: str, pre: str = "default", add_bos: bool | None = None
) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    tokens = ["<s>", "</s>", "a", "b", "ab", "Ġ", "Ġa"]
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 1, 1, 1, 1, 1])
    writer.add_token_merges(["a b", "Ġ a"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_sentencepiece_gguf_is_unsupported(tmp_path):
    path = tmp_path / "spm.gguf"
    _write_tiny_vocab_gguf(path, "llama")
    with pytest.raises(UnsupportedModelError, match="SentencePiece"):
        Tokenizer.from_gguf(gguf.GGUFReader(path))


def test_tiny_gguf_bos_flag(tmp_path):
    path = tmp_path / "plain.gguf"
    _write_tiny_vocab_gguf(path, "gpt2")
    assert not Tokenizer.from_gguf(gguf.GGUFReader(path)).add_bos_token  # absent flag: no BOS

    path = tmp_path / "bos.gguf"
    _write_tiny_vocab_gguf(path, "gpt2", add_bos=True)
    tok = Tokenizer.from_gguf(gguf.GGUFReader(path))
    assert tok.add_bos_token
    assert tok.encode("ab a") == [0, 4, 6]
    assert tok.encode("<s>ab a") == [0, 4, 6]  # a BOS already in the text is not doubled
    assert tok.encode("ab a", add_special_tokens=False) == [4, 6]
    assert tok.decode([0, 4, 6]) == "ab a"
    assert tok.decode([0, 4, 6], skip_special_tokens=False) == "<s>ab a"
    assert tok.stop_token_ids == frozenset({1})


@pytest.mark.parametrize(
    ("pre", "text", "pieces"),
    [
        ("qwen2", "x 12345", ["x", "Ġ", "1", "2", "3", "4", "5"]),
        ("llama-bpe", "x 12345", ["x", "Ġ", "123", "45"]),
        ("smollm", "x 12345", ["x", "Ġ", "1", "2", "3", "4", "5"]),
        ("gpt-2", "x 12345", ["x", "Ġ12345"]),
        ("qwen2", "I'M here\n\n  ok", ["I", "'M", "Ġhere", "ĊĊ", "Ġ", "Ġok"]),
    ],
)
def test_pre_tokenizer_splits(pre, text, pieces):
    pre_tokenizer, _ = _byte_level_pre_tokenizer(pre)
    assert [p for p, _ in pre_tokenizer.pre_tokenize_str(text)] == pieces


def test_user_defined_tokens_are_not_special():
    # Qwen2.5's vocabulary marks <tool_call> as a user-defined (non-special) added token.
    ours = _ours("qwen05")
    tool = ours.token_to_id("<tool_call>")
    assert tool is not None
    assert ours.encode("<tool_call>", add_special_tokens=False) == [tool]
    assert tool not in ours.special_token_ids
    assert ours.decode([tool]) == "<tool_call>"
    assert isinstance(ours.backend.get_added_tokens_decoder()[tool], AddedToken)


TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
]


def test_tools_reach_a_template_that_reads_them_as_transformers_passes_them(pair):
    """models.chat.render_chat with tools, an assistant's call (arguments sent as JSON text) and a
    tool result: for Qwen2.5's template, the prompt transformers renders from the same conversation
    (its arguments as an object, as vLLM hands them over); SmolLM2's template reads no tools, so
    they are written into the messages instead of dropped."""
    import json

    from specserve.models.chat import render_chat
    from specserve.models.tools import check_tools

    ours, hf = pair
    prompt = render_chat(ours, TOOL_CONVERSATION, tools=check_tools([TOOL], "auto"))
    if "tools" in (ours.chat_template or ""):
        as_hf = [dict(m) for m in TOOL_CONVERSATION]
        as_hf[1] = {**as_hf[1], "tool_calls": [{**as_hf[1]["tool_calls"][0], "function": {
            "name": "get_weather", "arguments": json.loads(as_hf[1]["tool_calls"][0]["function"]["arguments"])}}]}
        assert prompt == hf.apply_chat_template(as_hf, tools=[TOOL], add_generation_prompt=True, tokenize=False)
        assert "<tools>" in prompt and '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    else:
        assert json.dumps(check_tools([TOOL], "auto")[0]) in prompt and "<tool_response>\n18 C\n</tool_response>" in prompt
