"""End-to-end engine behaviour on the bundled SmolLM2 (fp32, CPU)."""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.errors import (
    ConfigError,
    InvalidRequestError,
    PromptTooLongError,
    RequestTooLongError,
)

PROMPTS = [
    "Hi",
    "The capital of France is",
    "def add(a, b):",
    "Write a haiku about the sea.\n",
    "List three prime numbers:",
    "import numpy as np\n\nx = np.arange(10)\n# compute the mean of x\n",
    "Once upon a time, in a land far away, there lived a dragon who loved to read books. One day",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n" * 3,
]


def _greedy(n=24):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_batched_equals_alone(smollm_llm: LLM):
    batched = smollm_llm.generate(PROMPTS, _greedy(), use_tqdm=False)
    for prompt, out in zip(PROMPTS, batched):
        alone = smollm_llm.generate(prompt, _greedy())[0]
        assert out.token_ids == alone.token_ids, prompt
        assert out.text == alone.text
        assert len(out.token_ids) == 24 and out.finish_reason == "length"
    assert smollm_llm.engine.check_integrity()


def test_chunked_prefill_equals_unchunked(smollm_checkpoint):
    long_prompt = PROMPTS[-1] * 3
    whole = LLM("smollm2", dtype="float32", checkpoint=smollm_checkpoint, max_num_batched_tokens=2048,
                enable_prefix_caching=False)
    chunked = LLM("smollm2", dtype="float32", checkpoint=smollm_checkpoint, max_num_batched_tokens=32,
                  enable_prefix_caching=False)
    a = whole.generate([long_prompt, PROMPTS[2]], _greedy(16))
    b = chunked.generate([long_prompt, PROMPTS[2]], _greedy(16))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_seeded_sampling_batched_and_alone(smollm_llm: LLM):
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    batched = smollm_llm.generate(PROMPTS[:4], params)
    for prompt, out in zip(PROMPTS[:4], batched):
        alone = smollm_llm.generate(prompt, params)[0]
        assert out.token_ids == alone.token_ids
    again = smollm_llm.generate(PROMPTS[0], params)[0]
    assert again.token_ids == batched[0].token_ids
    other_seed = smollm_llm.generate(PROMPTS[0], SamplingParams(**{**params.__dict__, "seed": 99}))[0]
    assert other_seed.token_ids != batched[0].token_ids


def test_prefix_cache_skips_shared_prefix(smollm_checkpoint):
    llm = LLM("smollm2", dtype="float32", checkpoint=smollm_checkpoint, max_num_batched_tokens=1024)
    tok = llm.tokenizer
    shared = ("The following is a long technical document about distributed systems. " * 60)
    assert len(tok.encode(shared)) >= 512
    p1, p2 = shared + "Question: what is consensus?", shared + "Question: what is a quorum?"
    first = llm.generate(p1, _greedy(12))[0]
    second = llm.generate(p2, _greedy(12))[0]
    n_shared = len(tok.encode(shared))
    assert first.metrics.num_cached_prompt_tokens == 0
    assert second.metrics.num_cached_prompt_tokens >= (n_shared // 16 - 1) * 16 >= 512
    # Same output as a cold engine without prefix caching.
    cold = LLM("smollm2", dtype="float32", checkpoint=smollm_checkpoint, enable_prefix_caching=False,
               max_num_batched_tokens=1024)
    assert cold.generate(p2, _greedy(12))[0].token_ids == second.token_ids
    assert llm.engine.check_integrity()


def test_preemption_with_tiny_kv_budget(smollm_checkpoint, smollm_llm: LLM):
    # 12 blocks of 16 tokens = 192 slots for 6 requests of ~20 prompt + 40 output tokens.
    small = LLM("smollm2", dtype="float32", checkpoint=smollm_checkpoint, num_kv_blocks=12,
                enable_prefix_caching=False)
    prompts = [p for p in PROMPTS[:6]]
    outs = small.generate(prompts, _greedy(40))
    ref = smollm_llm.generate(prompts, _greedy(40))
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.check_integrity()
    assert small.engine.kv_manager.num_free_blocks == small.engine.kv_manager.num_blocks


def test_stop_strings_and_stop_tokens(smollm_llm: LLM):
    base = smollm_llm.generate("def add(a, b):", _greedy(30))[0]
    assert "\n" in base.text
    stopped = smollm_llm.generate("def add(a, b):", SamplingParams(max_tokens=30, temperature=0, stop=["\n"]))[0]
    assert stopped.finish_reason == "stop" and "\n" not in stopped.text
    assert base.text.startswith(stopped.text)
    tok_stop = smollm_llm.generate(
        "def add(a, b):", SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[base.token_ids[2]])
    )[0]
    assert tok_stop.token_ids == base.token_ids[:3] and tok_stop.finish_reason == "stop"


def test_logprobs_are_returned(smollm_llm: LLM):
    out = smollm_llm.generate("Hello", SamplingParams(max_tokens=5, temperature=0, logprobs=True))[0]
    lps = out.outputs[0].logprobs
    assert lps is not None and len(lps) == len(out.token_ids)
    assert all(lp <= 0 for lp in lps)


def test_logprobs_as_an_integer_means_vllms_top_k(smollm_llm: LLM):
    """vLLM's SamplingParams(logprobs=k) returns the sampled token's logprob and the k likeliest;
    an integer used to pass as True and silently return no alternatives."""
    want = smollm_llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0, logprobs=True, top_logprobs=3))[0]
    got = smollm_llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0, logprobs=3))[0].outputs[0]
    assert got.top_logprobs == want.outputs[0].top_logprobs and len(got.top_logprobs[0]) == 3
    assert got.logprobs == want.outputs[0].logprobs
    assert got.cumulative_logprob == pytest.approx(sum(got.logprobs)) and got.cumulative_logprob < 0
    assert smollm_llm.generate("Hello", _greedy(2))[0].outputs[0].cumulative_logprob is None
    zero = SamplingParams(logprobs=0)
    assert zero.logprobs is True and zero.top_logprobs == 0
    assert SamplingParams(logprobs=None).logprobs is False
    for bad, match in ((dict(logprobs=-1), r"integer in \[0, "), (dict(logprobs=3, top_logprobs=2), "disagrees"),
                       (dict(logprobs="yes"), "True / False")):
        with pytest.raises(InvalidRequestError, match=match):
            SamplingParams(**bad)


@pytest.mark.parametrize(
    "kwargs",
    [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(max_tokens=0), dict(top_k=-5), dict(stop=[""]),
     dict(n=2**40), dict(ignore_eos="no"), dict(skip_special_tokens=None), dict(include_stop_str_in_output="no"),
     dict(speculative="no"), dict(stop=["a\udcffb"]), dict(reference_text="a\ud800"), dict(stop_token_ids=5),
     dict(reference_token_ids=5)],
)
def test_invalid_sampling_params(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


def test_sampling_params_take_vllms_none_for_stop_token_ids_and_refuse_a_string_of_choices():
    from specserve.sampling_params import StructuredOutput

    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    with pytest.raises(InvalidRequestError, match="got the string 'yes'"):  # its letters became the choices
        StructuredOutput.choice("yes")


def test_bad_requests_change_nothing(smollm_checkpoint):
    with pytest.raises(ConfigError, match="exceeds the model's context length 8192"):  # configuration, not a request
        LLM("smollm2", dtype="float32", checkpoint=smollm_checkpoint, max_model_len=10**9)
    llm = LLM("smollm2", dtype="float32", checkpoint=smollm_checkpoint, max_model_len=64)
    eng = llm.engine
    free = eng.kv_manager.num_free_blocks
    with pytest.raises(PromptTooLongError, match="max_model_len"):
        eng.add_request("word " * 200)
    with pytest.raises(InvalidRequestError, match="empty"):
        eng.add_request([])
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        eng.add_request([1, 2, 10**9])
    # Prompt + max_tokens beyond the context window: refused before any work, not cut short
    # with finish_reason 'length' (the server answers the same with a 400).
    with pytest.raises(RequestTooLongError, match=r"10 prompt \+ 60 max_tokens = 70 tokens.*at most 54"):
        eng.add_request(list(range(1, 11)), SamplingParams(max_tokens=60))
    with pytest.raises(InvalidRequestError, match="reference_token_ids"):  # would index past the embedding
        eng.add_request("Hi", SamplingParams(reference_token_ids=[1, 10**9]))
    with pytest.raises(RequestTooLongError):  # one bad request in a batch: none of them runs
        llm.generate([[1, 2, 3], list(range(1, 11))], [SamplingParams(max_tokens=8), SamplingParams(max_tokens=60)])
    # A priority that is no integer failed in the scheduler's queue after the request was registered
    # (one leaked per call); text with a lone surrogate failed in the tokenizer without naming it.
    for priority in ([None, 1], ["x", 1], [float("nan"), 0], [True, 0]):
        with pytest.raises(InvalidRequestError, match="priority must be an integer"):
            llm.generate(["a", "b"], SamplingParams(max_tokens=2), priority=priority)
    with pytest.raises(InvalidRequestError, match="not valid Unicode"):
        llm.generate("a\ud800b", SamplingParams(max_tokens=2))
    with pytest.raises(TypeError, match="got bytes"):  # read as the token ids of its byte values before
        llm.generate(b"hello", SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="bytes"):
        eng.add_request(bytearray(b"hi"))
    with pytest.raises(InvalidRequestError, match="token ids must be integers"):  # named the bool, not 'prompt 0'
        llm.generate([1, True], SamplingParams(max_tokens=2))
    assert not eng.has_unfinished_requests() and not eng._states and eng.kv_manager.num_free_blocks == free
    # Ctrl-C while a long generate() is still submitting: what it queued is dropped, not run by the next call.
    real, calls = eng.add_request, []

    def add_then_interrupt(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    eng.add_request = add_then_interrupt
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["Hi"] * 20, SamplingParams(max_tokens=2))
    finally:
        del eng.add_request
    assert not eng.has_unfinished_requests() and not eng._states and eng.kv_manager.num_free_blocks == free
    # A good request afterwards still works, and aborting mid-way frees its blocks.
    rid = eng.add_request("Hello there", SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.kv_manager.num_free_blocks < free
    (out,) = eng.abort_request(rid)
    assert out.finish_reason == "abort"
    assert eng.kv_manager.num_free_blocks == free and eng.check_integrity()



def test_max_tokens_none_generates_as_many_as_fit(smollm_checkpoint):
    """vLLM's convention: max_tokens=None runs to the end of the request's room (here the
    64-token context window), finish_reason 'length' there; a min_tokens beyond it is refused."""
    llm = LLM("smollm2", dtype="float32", checkpoint=smollm_checkpoint, max_model_len=64)
    prompt = list(range(1, 11))
    out = llm.generate(prompt, SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 64 - 10 and out.finish_reason == "length"
    eos = llm.generate(prompt, SamplingParams(max_tokens=None, temperature=0))[0].outputs[0]
    assert eos.token_ids == out.token_ids[: len(eos.token_ids)]  # the same greedy text, stopped at EOS if it came
    with pytest.raises(RequestTooLongError, match=r"10 prompt \+ 60 max_tokens"):
        llm.generate(prompt, SamplingParams(max_tokens=None, min_tokens=60))
    eng = llm.engine
    assert not eng.has_unfinished_requests() and eng.kv_manager.num_free_blocks == eng.kv_manager.num_blocks


def test_prompt_forms_and_bad_prompt_types(smollm_llm: LLM):
    """Text, token ids, and vLLM's {"prompt": ...} / {"prompt_token_ids": ...} dicts give the same
    tokens; anything else is a TypeError that says what a prompt may be (a dict was read as its keys)."""
    ids = smollm_llm.tokenizer.encode("The capital of France is")
    want = smollm_llm.generate("The capital of France is", _greedy(8))[0].token_ids
    for form in (ids, {"prompt_token_ids": ids}, {"prompt": "The capital of France is"}, [{"prompt_token_ids": ids}]):
        assert smollm_llm.generate(form, _greedy(8))[0].token_ids == want, form
    for bad, named in ((None, "NoneType"), (5, "int"), ({"text": "hi"}, "'text'"), ([None], "prompt 0")):
        with pytest.raises(TypeError, match=named):
            smollm_llm.generate(bad, _greedy(8))
    eng = smollm_llm.engine
    assert not eng.has_unfinished_requests() and eng.kv_manager.num_free_blocks == eng.kv_manager.num_blocks

def test_chat_checks_messages_as_the_server_does(smollm_llm: LLM):
    """LLM.chat takes vLLM's arguments and OpenAI's message forms (text parts, developer as
    system, continue_final_message); a bad message raises ChatError naming the field before
    anything is scheduled, where the template used to render an unknown role as given."""
    from specserve.models.chat import ChatError

    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    want = smollm_llm.chat(conv, _greedy(8))[0]
    text = smollm_llm.get_tokenizer().apply_chat_template(conv)
    assert want.prompt_token_ids == smollm_llm.get_tokenizer().encode(text)
    parts = [{"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
             {"role": "user", "content": "Name a colour.", "name": None}]
    got = smollm_llm.chat(parts, sampling_params=_greedy(8), use_tqdm=False)[0]
    assert got.prompt_token_ids == want.prompt_token_ids and got.token_ids == want.token_ids
    two = smollm_llm.chat([conv, conv], params=_greedy(8))  # (params=: the earlier name)
    assert [o.token_ids for o in two] == [want.token_ids] * 2
    cont = smollm_llm.chat(conv + [{"role": "assistant", "content": "My favourite is"}], _greedy(4),
                           add_generation_prompt=False, continue_final_message=True)[0]
    assert smollm_llm.tokenizer.decode(cont.prompt_token_ids).endswith("My favourite is")
    bad = [
        ([{"role": "wizard", "content": "hi"}], r"messages\[0\]\.role is 'wizard'"),
        ([{"role": "user", "content": "hi"}, {"role": "user", "content": 5}], r"messages\[1\]\.content must be"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], r"'image_url' part"),
        ([{"role": "user", "content": [{"type": "text"}]}], r"content\[0\]\.text must be a string"),
        ([{"role": "user", "content": "hi", "name": 3}], r"name must be a string"),
        (["hi"], r"messages\[0\] must be a dict"),
        ([], "non-empty list"),
    ]
    for messages, match in bad:
        with pytest.raises(ChatError, match=match):
            smollm_llm.chat(messages, _greedy(8))
    with pytest.raises(ChatError, match="add_generation_prompt false"):
        smollm_llm.chat(conv, _greedy(8), continue_final_message=True)
    with pytest.raises(ChatError, match="chat_template_kwargs must map"):  # 'int' object is not iterable
        smollm_llm.chat(conv, _greedy(8), chat_template_kwargs=5)
    with pytest.raises(ChatError, match="may not set"):
        smollm_llm.chat(conv, _greedy(8), chat_template_kwargs={"messages": []})
    with pytest.raises(ValueError, match="2 prompts but 1 priorities"):
        smollm_llm.generate(["a", "b"], _greedy(8), priority=[0])
    assert smollm_llm.generate(["a", "b"], sampling_params=_greedy(4), priority=[1, 0])[0].token_ids == \
        smollm_llm.generate("a", _greedy(4))[0].token_ids == \
        smollm_llm.generate(["a", "b"], params=_greedy(4), priorities=[1, 0])[0].token_ids  # the earlier names
    with pytest.raises(TypeError, match="both sampling_params= and its older name params="):
        smollm_llm.generate("a", sampling_params=_greedy(4), params=_greedy(4))
    eng = smollm_llm.engine
    assert not eng.has_unfinished_requests() and eng.kv_manager.num_free_blocks == eng.kv_manager.num_blocks


def test_reference_text_is_tokenized_when_prepared(smollm_llm: LLM):
    """The reference proposer's text is tokenized by prepare_request (on the caller's thread:
    the server's tokenizer pool), never on the engine thread."""
    text = "def add(a, b):\n    return a + b\n"
    prepared = smollm_llm.engine.prepare_request("Hi", SamplingParams(reference_text=text))
    params = prepared.request.sampling_params
    assert params.reference_token_ids == smollm_llm.tokenizer.encode(text, add_special_tokens=False)
    assert params.reference_text == text


def test_metrics_fields(smollm_llm: LLM):
    out = smollm_llm.generate("Hello", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    m = out.metrics
    assert m.num_generated_tokens == 6 and m.num_prompt_tokens == len(out.prompt_token_ids)
    assert m.ttft_s is not None and m.ttft_s > 0 and m.tpot_s is not None and m.e2e_s >= m.ttft_s
    d = out.to_dict()
    for key in ("ttft_s", "tpot_s", "e2e_s", "num_prompt_tokens", "num_generated_tokens", "num_cached_prompt_tokens"):
        assert key in d["metrics"]
