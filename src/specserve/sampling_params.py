"""User-facing sampling knobs, validated when constructed."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from specserve.errors import InvalidRequestError

# Below this temperature sampling is treated as greedy (argmax), as vLLM and llama.cpp do.
GREEDY_EPS = 1e-5
MAX_TOP_K = 1 << 30  # larger values would overflow the int64 tensors; any k >= vocab means "off"
MAX_SEED = (1 << 63) - 1
MAX_N = 4096  # samples of one prompt in one call (each is a request: n = 2**40 queued until memory ran out)
MAX_TOP_LOGPROBS = 20  # as OpenAI's chat API
MAX_LOGIT_BIAS = 100.0  # as OpenAI: -100 bans a token, +100 all but forces it


StructuredKind = Literal["json_object", "json_schema", "regex", "grammar", "choice"]
MAX_GRAMMAR_CHARS = 1 << 20  # a schema, regex or grammar longer than this is refused before compiling
MIN_REPETITION_PENALTY = 0.01


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the whole output: any JSON object, a JSON schema, a regex, an EBNF
    grammar or one of a few strings. Compiled per request by specserve.sampling.grammar."""

    kind: StructuredKind
    spec: str = ""  # the schema as JSON text, the regex, the EBNF grammar, or the choices as a JSON list
    # The request field it came from, named by the error where it does not compile (None: the
    # field that carries its kind, `response_format` or a guided_* one; "tools" for the calls'
    # schema of tool_choice required or named). Not part of the constraint.
    param: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in ("json_object", "json_schema", "regex", "grammar", "choice"):
            raise InvalidRequestError(
                f"structured output kind must be json_object, json_schema, regex, grammar or choice; got {self.kind!r}."
            )
        if not isinstance(self.spec, str):
            raise InvalidRequestError("a structured output spec must be a string.")
        if len(self.spec) > MAX_GRAMMAR_CHARS:
            raise InvalidRequestError(f"the {self.kind} is longer than {MAX_GRAMMAR_CHARS} characters; simplify it.")
        if self.kind != "json_object" and not self.spec:
            raise InvalidRequestError(f"a {self.kind} constraint needs a non-empty spec.")

    @classmethod
    def json(cls, schema: dict[str, Any] | str | None = None) -> StructuredOutput:
        """JSON that validates against `schema` (a dict or JSON text); any JSON object without one."""
        if schema is None:
            return cls("json_object")
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}.") from None
            except RecursionError:  # valid JSON, but Python's parser stops at ~1,000 levels: a 500 before
                raise InvalidRequestError("the JSON schema nests deeper than the parser allows.") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError("a JSON schema must be a JSON object.")
        return cls("json_schema", json.dumps(schema))

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        """Text that matches `pattern` in full."""
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, ebnf: str) -> StructuredOutput:
        """Text derived from an EBNF grammar (GBNF / xgrammar syntax, start symbol `root`)."""
        return cls("grammar", ebnf)

    @classmethod
    def choice(cls, options: Sequence[str]) -> StructuredOutput:
        """Exactly one of `options`."""
        if isinstance(options, str):  # its characters would each become a choice
            raise InvalidRequestError(f"choice takes a list of strings, got the string {options!r}; write [{options!r}].")
        opts = list(options)
        if not opts or not all(isinstance(o, str) and o for o in opts):
            raise InvalidRequestError("choice needs a non-empty list of non-empty strings.")
        return cls("choice", json.dumps(opts))


def structured_output_from_openai(
    response_format: dict[str, Any] | None = None,
    *,
    guided_json: dict[str, Any] | str | None = None,
    guided_regex: str | None = None,
    guided_grammar: str | None = None,
    guided_choice: list[str] | None = None,
) -> StructuredOutput | None:
    """The constraint an OpenAI-style request asks for: `response_format` ({"type": "text" |
    "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}) or one of vLLM's
    extras (guided_json / guided_regex / guided_grammar / guided_choice); at most one."""
    asked: list[tuple[str, StructuredOutput]] = []
    if response_format is not None:
        if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
            raise InvalidRequestError('response_format must be an object with a "type".', param="response_format")
        kind = response_format["type"]
        extra = sorted(set(response_format) - {"type", "json_schema"})
        if extra:
            raise InvalidRequestError(f"response_format has unsupported fields {extra}.", param="response_format")
        if kind == "json_object":
            asked.append(("response_format", StructuredOutput.json()))
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise InvalidRequestError('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}.',
                                          param="response_format")
            unknown = sorted(set(spec) - {"name", "description", "schema", "strict"})
            if unknown:
                raise InvalidRequestError(f"response_format.json_schema has unsupported fields {unknown}.",
                                          param="response_format")
            try:
                asked.append(("response_format", replace(StructuredOutput.json(spec["schema"]), param="response_format")))
            except InvalidRequestError as e:  # (a schema given as text that does not parse)
                raise InvalidRequestError(f"response_format.json_schema.schema: {e}", param="response_format") from None
        elif kind != "text":
            raise InvalidRequestError(
                f"response_format type {kind!r} is not supported; use text, json_object or json_schema "
                "(or the guided_regex / guided_grammar / guided_choice extras).", param="response_format"
            )
    for name, value, build in (("guided_json", guided_json, StructuredOutput.json),
                               ("guided_regex", guided_regex, StructuredOutput.regex),
                               ("guided_grammar", guided_grammar, StructuredOutput.grammar),
                               ("guided_choice", guided_choice, StructuredOutput.choice)):
        if value is not None:
            try:
                asked.append((name, replace(build(value), param=name)))  # (compile errors name it too)
            except InvalidRequestError as e:
                raise InvalidRequestError(str(e), param=name) from None
    if len(asked) > 1:
        raise InvalidRequestError(f"ask for one output constraint at a time, not {[name for name, _ in asked]}.",
                                  param=asked[1][0])
    return asked[0][1] if asked else None


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, for one request."""

    max_tokens: int | None = 16  # None: as many as fit (context window or KV cache), as vLLM
    # vLLM's: EOS and stop_token_ids are masked, and stop strings not matched, until this many
    # tokens were generated. At most max_tokens.
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    min_p: float = 0.0  # keep tokens at least min_p times as likely as the likeliest (after temperature); 0: off
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # True: each output token's logprob. vLLM's spelling works too: an integer k is True with
    # top_logprobs k (0: the sampled token's alone), None is False.
    logprobs: bool | int | None = False
    top_logprobs: int = 0  # with logprobs: also this many most likely tokens at each position
    # vLLM's: the logprob of every prompt token after the first under the model (raw logits), and
    # this many most likely tokens at each of those positions; None: off. The prompt is computed
    # in full (no prefix-cache hits) while they are missing.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = 1
    reference_text: str | None = None  # text the output tracks (the file being edited): prompt lookup and the reference copier draft from it
    reference_token_ids: list[int] | None = None  # the same, already tokenized
    speculative: bool | None = None  # per-request override: False never speculates
    structured_output: StructuredOutput | None = None  # constrain the output (JSON, schema, regex, grammar)
    # Added to the model's logits (token id -> bias in [-100, 100]) before temperature, top-k and
    # top-p, in every row the request samples or verifies from, as OpenAI's and vLLM's logit_bias.
    # Logprobs are of the biased logits (as they are of the grammar-masked ones).
    logit_bias: dict[int, float] | None = None
    # OpenAI's penalties, over the tokens generated so far (not the prompt, as vLLM): a token's
    # logit falls by frequency_penalty * its count + presence_penalty if it occurred. In [-2, 2].
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # HF's and vLLM's: the logit of a token seen in the prompt or the output is divided by it where
    # positive and multiplied by it where negative (> 1 discourages repeats). In [0.01, 2]; 1 is off
    # (a smaller one is no use and its quotients leave float32's range: 1e-300 rounds to 0).
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        elif not isinstance(self.stop, (list, tuple)):
            raise InvalidRequestError(f"stop must be a string or a list of strings, got {self.stop!r}.", param="stop")
        self.stop = list(self.stop)
        if self.stop_token_ids is None:  # vLLM's spelling of none
            self.stop_token_ids = []
        elif not isinstance(self.stop_token_ids, (list, tuple)):
            raise InvalidRequestError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}.",
                                      param="stop_token_ids")
        self.stop_token_ids = list(self.stop_token_ids)
        self._logprobs_as_vllm()
        self._validate()

    def _logprobs_as_vllm(self) -> None:
        """vLLM's logprobs=k (an integer: the sampled token's logprob and the k likeliest) as
        logprobs=True, top_logprobs=k; None as False."""
        k = self.logprobs
        if k is None:
            self.logprobs = False
        elif isinstance(k, int) and not isinstance(k, bool):
            if not 0 <= k <= MAX_TOP_LOGPROBS:
                raise InvalidRequestError(f"logprobs must be True / False or, as vLLM's, an integer in "
                                          f"[0, {MAX_TOP_LOGPROBS}] (the likeliest tokens to return), got {k!r}.")
            if self.top_logprobs not in (0, k):
                raise InvalidRequestError(f"logprobs={k} already asks for the {k} likeliest tokens; "
                                          f"top_logprobs={self.top_logprobs!r} disagrees.")
            self.logprobs, self.top_logprobs = True, k
        elif not isinstance(k, bool):
            raise InvalidRequestError(f"logprobs must be True / False or an integer (vLLM's), got {k!r}.")

    def _validate(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            """The error, naming the field its message starts with."""
            field = msg.split(" ", 1)[0]
            return InvalidRequestError(msg, param=field if field in _FIELDS else None)

        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool)
                                            or self.max_tokens < 1):
            raise bad(f"max_tokens must be an integer >= 1 (or None: as many as fit), got {self.max_tokens!r}.")
        if (not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0
                or (self.max_tokens is not None and self.min_tokens > self.max_tokens)):
            raise bad(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}.")
        if not _is_number(self.temperature) or not 0 <= self.temperature < math.inf:  # (NaN fails both)
            raise bad(f"temperature must be a finite number >= 0 (0 means greedy), got {self.temperature!r}.")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}.")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1] (0 is off), got {self.min_p!r}.")
        if (not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1
                or self.top_k > MAX_TOP_K):
            raise bad(f"top_k must be an integer in [1, {MAX_TOP_K}], or 0 / -1 to disable it; got {self.top_k!r}.")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or abs(self.seed) > MAX_SEED
        ):
            raise bad(f"seed must be an integer of at most 63 bits, got {self.seed!r}.")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            raise bad(f"n must be an integer in [1, {MAX_N}], got {self.n!r}.")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):  # "no" is truthy: it would turn the flag on
                raise bad(f"{name} must be True or False, got {getattr(self, name)!r}.")
        if self.speculative is not None and not isinstance(self.speculative, bool):
            raise bad(f"speculative must be True, False or None (the server's policy), got {self.speculative!r}.")
        for s in self.stop:  # type: ignore[union-attr]
            if not isinstance(s, str) or not s:
                raise bad(f"stop strings must be non-empty strings, got {s!r}.")
            if not is_unicode(s):
                raise bad(f"stop strings must be valid Unicode, got {s!r} (a lone surrogate: undecodable bytes?).")
        if self.reference_text is not None and not isinstance(self.reference_text, str):
            raise bad("reference_text must be a string.")
        if self.reference_text is not None and not is_unicode(self.reference_text):
            raise bad("reference_text must be valid Unicode text; it holds a lone surrogate (undecodable bytes?).")
        if self.reference_token_ids is not None and not isinstance(self.reference_token_ids, (list, tuple)):
            raise bad(f"reference_token_ids must be a list of token ids, got {self.reference_token_ids!r}.")
        if self.reference_token_ids is not None and not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.reference_token_ids
        ):
            raise bad("reference_token_ids must be non-negative integers.")
        if (not isinstance(self.top_logprobs, int) or isinstance(self.top_logprobs, bool)
                or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            raise bad(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}.")
        if self.prompt_logprobs is not None and (
                not isinstance(self.prompt_logprobs, int) or isinstance(self.prompt_logprobs, bool)
                or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
            raise bad(f"prompt_logprobs must be None or an integer in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs!r}.")
        if self.top_logprobs and not self.logprobs:
            raise bad("top_logprobs needs logprobs=True.")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise bad(f"stop_token_ids must be non-negative integers, got {t!r}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise bad(f"{name} must be a number in [-2, 2], got {value!r}.")
        if not _is_number(self.repetition_penalty) or not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 2.0:
            raise bad(f"repetition_penalty must be a number in [{MIN_REPETITION_PENALTY}, 2] (1 is off), "
                      f"got {self.repetition_penalty!r}.")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias must map token ids to biases, e.g. {50256: -100}.")
            for t, b in self.logit_bias.items():
                if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                    raise bad(f"logit_bias keys must be token ids (integers >= 0), got {t!r}.")
                if not _is_number(b) or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
                    raise bad(f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                              f"got {b!r} for token {t}.")
        if self.structured_output is not None:
            if not isinstance(self.structured_output, StructuredOutput):
                raise bad("structured_output must be a StructuredOutput (e.g. StructuredOutput.json(schema)).")
            if self.ignore_eos:
                raise bad("ignore_eos cannot be combined with structured output: the grammar ends the output.")

    @property
    def has_penalties(self) -> bool:
        """True when presence, frequency or repetition penalties change the logits."""
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1.0

    @property
    def is_greedy(self) -> bool:
        """True when the request picks the argmax token at every step."""
        return self.temperature < GREEDY_EPS

    @property
    def effective_top_k(self) -> int:
        """top_k with the 'disabled' spellings normalised to 0."""
        return max(0, self.top_k)


_FIELDS = frozenset(f.name for f in fields(SamplingParams))  # what an error's `param` may name


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def is_unicode(text: str) -> bool:
    """False where `text` holds a lone surrogate (Python's stand-in for bytes that were not UTF-8,
    or a JSON "\\ud800" escape): no tokenizer can encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
