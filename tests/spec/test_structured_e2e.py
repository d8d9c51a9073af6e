"""Structured output end to end on SmolLM2: constrained outputs parse and validate, and
speculation (every proposer) changes nothing about them."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from specserve import LLM, SamplingParams
from specserve.sampling_params import StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {"type": "array", "items": {"enum": ["python", "rust", "go", "c"]}, "maxItems": 3},
        "retired": {"type": "boolean"},
    },
    "required": ["name", "age", "languages", "retired"],
    "additionalProperties": False,
}
PROMPTS = [
    "Describe a software engineer as a JSON object.",
    "Give the profile of Ada, 36, who writes Rust and Go, as JSON.",
    "Return a JSON record for a retired programmer.",
    "JSON please: a person who only knows C.",
]


def chat(llm: LLM, text: str) -> str:
    return llm.engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def _llm(ckpt, method: str = "none", **kw) -> LLM:
    """ckpt None: the GGUF's own blocks (`auto`, native kernels); else float32 weights."""
    if method == "draft":
        kw.update(draft_checkpoint=ckpt, draft_num_layers=10, spec_tree="tree")
    if ckpt is not None:
        kw.update(dtype="float32", checkpoint=ckpt)
    return LLM("smollm2-135m-instruct", kv_cache_gib=0.5, spec_method=method,
               spec_policy="always" if method != "none" else "adaptive", num_spec_tokens=6,
               profile_spec_costs=False, max_num_seqs=128, **kw)


def _valid(text: str) -> dict:
    obj = json.loads(text)
    jsonschema.validate(obj, SCHEMA)
    return obj


@pytest.fixture(scope="module")
def plain(smollm_checkpoint) -> LLM:
    return _llm(smollm_checkpoint)


@pytest.mark.parametrize("method", ["ngram", "lookahead", pytest.param("draft", marks=pytest.mark.slow)])
def test_greedy_constrained_speculation_equals_constrained_plain(smollm_checkpoint, plain, method):
    prompts = [chat(plain, p) for p in PROMPTS]
    params = SamplingParams(max_tokens=96, temperature=0, structured_output=StructuredOutput.json(SCHEMA))
    base = plain.generate(prompts, params)
    for o in base:
        assert o.outputs[0].finish_reason == "stop"
        _valid(o.outputs[0].text)
    llm = _llm(smollm_checkpoint, method)
    batched = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in batched] == [o.outputs[0].token_ids for o in base]
    alone = llm.generate(prompts[1:2], params)
    assert alone[0].outputs[0].token_ids == base[1].outputs[0].token_ids
    eng = llm.engine
    assert eng.spec_counters["num_draft_tokens"] > 0, "nothing was speculated"
    assert eng.check_integrity() and eng.kv_manager.num_free_blocks == eng.kv_manager.num_blocks


@pytest.mark.slow
def test_hundred_seeded_schema_requests_parse_and_validate_with_and_without_speculation(plain):
    prompts = [chat(plain, PROMPTS[i % len(PROMPTS)]) for i in range(100)]
    params = [SamplingParams(max_tokens=128, temperature=0.9, top_p=0.95, seed=i,
                             structured_output=StructuredOutput.json(SCHEMA)) for i in range(100)]
    spec = _llm(None, "ngram")
    for llm in (_llm(None), spec):
        outs = llm.generate(prompts, params)
        objs = [_valid(o.outputs[0].text) for o in outs]
        assert all(o.outputs[0].finish_reason == "stop" for o in outs)
        assert len({json.dumps(o, sort_keys=True) for o in objs}) > 10  # sampled, not one answer
    assert spec.engine.spec_counters["num_accepted_tokens"] > 0
    assert spec.engine.check_integrity()


def test_regex_choice_and_grammar_constrain_the_text(plain):
    prompt = chat(plain, "Is the sky blue? Answer.")
    outs = plain.generate([prompt] * 3, [
        SamplingParams(max_tokens=16, temperature=0.7, seed=1, structured_output=StructuredOutput.choice(["yes", "no"])),
        SamplingParams(max_tokens=24, temperature=0.7, seed=2, structured_output=StructuredOutput.regex(r"[0-9]{3}-[a-z]{2}")),
        SamplingParams(max_tokens=24, temperature=0.7, seed=3,
                       structured_output=StructuredOutput.grammar('root ::= "color: " ("red" | "green" | "blue")')),
    ])
    texts = [o.outputs[0].text for o in outs]
    assert texts[0] in ("yes", "no")
    assert len(texts[1]) == 6 and texts[1][:3].isdigit() and texts[1][3] == "-"
    assert texts[2] in ("color: red", "color: green", "color: blue")
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


@pytest.mark.parametrize("method", ["none", "ngram"])
def test_min_tokens_under_a_grammar_holds_the_end_back_until_only_the_end_is_allowed(smollm_checkpoint, plain, method):
    """min_tokens with structured output (vLLM takes both): where the grammar lets the text go on,
    the end waits for min_tokens; where it allows nothing else (a finished choice), the output
    ends there rather than on a row with no token allowed. Greedy speculation changes nothing."""
    words = StructuredOutput.regex(r"[A-Za-z0-9 ,.]+")
    prompts = [chat(plain, "What is 2+2?"), chat(plain, "Is the sky blue? Answer.")]
    params = [SamplingParams(max_tokens=40, temperature=0, structured_output=words),
              SamplingParams(max_tokens=40, temperature=0, min_tokens=24, structured_output=words),
              SamplingParams(max_tokens=40, temperature=0, min_tokens=24, structured_output=StructuredOutput.choice(["yes", "no"]))]
    llm = plain if method == "none" else _llm(smollm_checkpoint, method)
    free, held, choice = (o.outputs[0] for o in llm.generate([prompts[0], prompts[0], prompts[1]], params))
    assert free.finish_reason == "stop" and len(free.token_ids) < 24  # the grammar alone ends early
    assert len(held.token_ids) >= 24 and re.fullmatch(r"[A-Za-z0-9 ,.]+", held.text), held.text
    assert held.token_ids[: len(free.token_ids) - 1] == free.token_ids[:-1]  # the same text until the end was due
    assert choice.text in ("yes", "no") and choice.finish_reason == "stop"
    # and its end is the output's end: before, a stop id the grammar took inside min_tokens was
    # emitted as hidden text and the output ran on to min_tokens
    assert len(choice.token_ids) <= 3 and choice.token_ids[-1] in llm.engine.eos_token_ids, choice.token_ids
    if method != "none":
        ref = [o.outputs[0].token_ids for o in plain.generate([prompts[0], prompts[0], prompts[1]], params)]
        assert [free.token_ids, held.token_ids, choice.token_ids] == ref
        assert llm.engine.spec_counters["num_draft_tokens"] > 0 and llm.engine.check_integrity()


def test_forced_text_drafts_change_nothing_but_the_number_of_steps(plain):
    """The text a schema forces (`{"name":"`, `","age":`) is drafted and verified in one pass; the
    greedy output equals decoding it token by token (speculative=False turns those drafts off)."""
    prompts = [chat(plain, p) for p in PROMPTS[:2]]
    so = StructuredOutput.json(SCHEMA)
    eng = plain.engine
    steps0, forced0 = eng.num_steps, eng.spec_counters["num_forced_tokens"]
    fast = plain.generate(prompts, SamplingParams(max_tokens=96, temperature=0, structured_output=so))
    fast_steps = eng.num_steps - steps0
    assert eng.spec_counters["num_forced_tokens"] - forced0 >= 10
    steps0 = eng.num_steps
    slow = plain.generate(prompts, SamplingParams(max_tokens=96, temperature=0, structured_output=so, speculative=False))
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in slow]
    assert fast_steps < eng.num_steps - steps0
    assert eng.check_integrity()
