"""`specserve generate` passes its sampling flags through (penalties, min-p, min-tokens) and refuses bad ones."""

from __future__ import annotations

import json

from specserve.cli import main


def _generate(capsys, *flags: str) -> tuple[int, list[dict], str]:
    code = main(["generate", "--model", "smollm2-135m-instruct", "--prompt", "one two one two one two one two",
                 "--max-tokens", "16", "--ignore-eos", "--json", *flags])
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines() if line.startswith("{")], err


def test_generate_applies_penalties_and_refuses_out_of_range_ones(capsys):
    code, plain, _ = _generate(capsys)
    assert code == 0 and len(plain) == 1
    code, penalized, _ = _generate(capsys, "--repetition-penalty", "1.8", "--frequency-penalty", "1.0")
    assert code == 0
    plain_ids = plain[0]["token_ids"]
    penalized_ids = penalized[0]["token_ids"]
    assert len(penalized_ids) == len(plain_ids) == 16
    assert len(set(penalized_ids)) > len(set(plain_ids))  # the plain answer repeats the pattern
    code, _, err = _generate(capsys, "--presence-penalty", "5")
    assert code == 1 and "presence_penalty must be a number in [-2, 2]" in err
    code, _, err = _generate(capsys, "--min-p", "2")
    assert code == 1 and "min_p must be in [0, 1]" in err


def test_generate_min_tokens_holds_back_stop_strings(capsys):
    # "two", not " two": after a few tokens the greedy text may go on as "-two-two" (float16 KV).
    code, plain, _ = _generate(capsys, "--stop", "two")
    assert code == 0 and plain[0]["finish_reason"] == "stop"
    code, held, _ = _generate(capsys, "--stop", "two", "--min-tokens", "6")
    assert code == 0 and held[0]["finish_reason"] == "stop"
    assert len(held[0]["token_ids"]) >= 6 > len(plain[0]["token_ids"])
    code, _, err = _generate(capsys, "--min-tokens", "17")
    assert code == 1 and "min_tokens must be an integer in [0, max_tokens=16]" in err


def test_generate_prompt_logprobs_in_json(capsys):
    code, outs, _ = _generate(capsys, "--prompt-logprobs", "2")
    assert code == 0
    d = outs[0]
    n = len(d["prompt_token_ids"])
    assert len(d["prompt_logprobs"]) == len(d["prompt_top_logprobs"]) == n > 1
    assert d["prompt_logprobs"][0] is None and all(v <= 0 for v in d["prompt_logprobs"][1:])
    assert all(len(t) == 2 and t[0][1] >= t[1][1] for t in d["prompt_top_logprobs"][1:])
    code, _, err = _generate(capsys, "--prompt-logprobs", "30")
    assert code == 1 and "prompt_logprobs" in err


def test_speculative_config_in_vllms_form(capsys):
    """--speculative-config / LLM(speculative_config=) take vLLM's dict: the n-gram run below is the
    plain run token for token and reports speculation metrics; keys and methods specserve has no
    counterpart for are refused by name, before a model loads."""
    from specserve.config import spec_kwargs_from_vllm
    from specserve.errors import ConfigError

    assert spec_kwargs_from_vllm({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}) == {
        "spec_method": "ngram", "num_spec_tokens": 5, "ngram_max": 3}
    assert spec_kwargs_from_vllm('{"model": "d", "num_speculative_tokens": 4, "disable_by_batch_size": 4}') == {
        "spec_method": "draft", "draft_model": "d", "num_spec_tokens": 4, "spec_off_batch": 4, "spec_on_batch": 4}
    assert spec_kwargs_from_vllm({"method": "eagle3", "model": "h.safetensors"})["spec_method"] == "eagle"
    assert spec_kwargs_from_vllm({"method": "glm4_moe_mtp"})["spec_method"] == "mtp"
    assert spec_kwargs_from_vllm({"method": "ngram", "prompt_lookup_min": 6}) == {
        "spec_method": "ngram", "ngram_min": 6, "ngram_max": 6}
    for bad, match in (({"method": "mlp_speculator"}, "not one specserve has"), ({"num_speculative_tokens": 3}, "needs a method"),
                       ({"method": "ngram", "acceptance_method": "x"}, r"\['acceptance_method'\] have no counterpart"),
                       ({"method": "ngram", "draft_tensor_parallel_size": 2}, "not supported"),
                       ({"method": "ngram", "num_speculative_tokens": "5"}, "must be an integer"),
                       ("{not json", "not valid JSON"), ([1], "must be a dict")):
        try:
            spec_kwargs_from_vllm(bad)
        except ConfigError as e:
            assert __import__("re").search(match, str(e)), (bad, str(e))
        else:
            raise AssertionError(f"accepted {bad!r}")
    code, plain, _ = _generate(capsys)
    code2, spec, _ = _generate(capsys, "--speculative-config",
                               '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}',
                               "--spec-policy", "always")
    assert code == code2 == 0 and spec[0]["token_ids"] == plain[0]["token_ids"]
    assert spec[0]["metrics"]["num_draft_tokens"] > 0 and plain[0]["metrics"]["num_draft_tokens"] == 0
    code, _, err = _generate(capsys, "--speculative-config", '{"method": "ngram"}', "--spec-method", "ngram")
    assert code == 1 and "not both" in err
    code, _, err = _generate(capsys, "--speculative-config", '{"method": "typo"}')
    assert code == 1 and "'typo' is not one specserve has" in err


def test_generate_refuses_unreadable_files_and_bad_engine_values_in_one_line(capsys, tmp_path):
    """Before: a missing --prompt-file or --reference-file, --kv-cache-gib nan or --threads -1
    ended in a Python traceback."""
    binary = tmp_path / "b.bin"
    binary.write_bytes(b"\xff\xfe\x00bad")
    for flags, message in ((["--prompt-file", str(tmp_path / "missing.txt")], "--prompt-file"),
                           (["--prompt-file", str(binary)], "cannot read it as UTF-8 text"),
                           (["--spec-method", "reference", "--reference-file", str(tmp_path / "nope")], "--reference-file"),
                           (["--kv-cache-gib", "nan"], "kv_cache_gib must be a finite number"),
                           (["--threads", "-1"], "num_threads must be >= 1")):
        code, _, err = _generate(capsys, *flags)
        assert code == 1 and message in err and "Traceback" not in err, (flags, err)
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n")
    assert main(["generate", "--model", "smollm2-135m-instruct", "--prompt-file", str(blank)]) == 2
    assert f"--prompt-file {blank} holds no prompt" in capsys.readouterr().err  # it said none was given
    undecodable = b"abc\xffdef".decode("utf-8", "surrogateescape")  # what argv holds for bytes that are not UTF-8
    assert main(["generate", "--model", "smollm2-135m-instruct", "--prompt", undecodable]) == 2
    err = capsys.readouterr().err
    assert "--prompt 1 is not valid UTF-8" in err and "Traceback" not in err


def test_generate_takes_a_positional_prompt_beside_model(capsys, tmp_path):
    """`generate --model M "text"` (llama-cli's habit) reads the positional as a prompt, ahead of any
    --prompt; a positional that names a model (a bundled name or an existing path) beside a different
    --model is still refused as the model given twice."""
    code, outs, _ = _generate(capsys)
    assert code == 0
    code = main(["generate", "--model", "smollm2-135m-instruct", "one two one two one two one two", "--prompt", "Hi",
                 "--max-tokens", "16", "--ignore-eos", "--json"])
    out, _ = capsys.readouterr()
    both = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert code == 0 and len(both) == 2
    assert both[0]["prompt"] == outs[0]["prompt"] and both[1]["prompt"] == "Hi"
    assert both[0]["token_ids"] == outs[0]["token_ids"]
    for model_like in ("Qwen2.5-Coder-0.5B-Instruct", str(tmp_path)):
        try:
            main(["generate", "--model", "smollm2-135m-instruct", model_like, "--max-tokens", "1"])
        except SystemExit as e:
            assert e.code == 2
        else:
            raise AssertionError(f"{model_like!r} beside --model was not refused")
        assert "the model is given twice" in capsys.readouterr().err
