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
    code, plain, _ = _generate(capsys, "--stop", " two")
    assert code == 0 and plain[0]["finish_reason"] == "stop"
    code, held, _ = _generate(capsys, "--stop", " two", "--min-tokens", "6")
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
