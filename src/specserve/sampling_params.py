"""User-facing sampling knobs, validated when constructed."""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.errors import InvalidRequestError

# Below this temperature sampling is treated as greedy (argmax), as vLLM and llama.cpp do.
GREEDY_EPS = 1e-5
MAX_TOP_K = 1 << 30  # larger values would overflow the int64 tensors; any k >= vocab means "off"
MAX_SEED = (1 << 63) - 1


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, for one request."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = 1
    reference_text: str | None = None  # for the `reference` proposer: text the output tracks
    reference_token_ids: list[int] | None = None  # the same, already tokenized
    speculative: bool | None = None  # per-request override: False never speculates

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self._validate()

    def _validate(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(msg)

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}.")
        if not _is_number(self.temperature) or self.temperature < 0 or self.temperature != self.temperature:
            raise bad(f"temperature must be a number >= 0 (0 means greedy), got {self.temperature!r}.")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}.")
        if (not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1
                or self.top_k > MAX_TOP_K):
            raise bad(f"top_k must be an integer in [1, {MAX_TOP_K}], or 0 / -1 to disable it; got {self.top_k!r}.")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or abs(self.seed) > MAX_SEED
        ):
            raise bad(f"seed must be an integer of at most 63 bits, got {self.seed!r}.")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise bad(f"n must be an integer >= 1, got {self.n!r}.")
        for s in self.stop:  # type: ignore[union-attr]
            if not isinstance(s, str) or not s:
                raise bad(f"stop strings must be non-empty strings, got {s!r}.")
        if self.reference_text is not None and not isinstance(self.reference_text, str):
            raise bad("reference_text must be a string.")
        if self.reference_token_ids is not None and not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.reference_token_ids
        ):
            raise bad("reference_token_ids must be non-negative integers.")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise bad(f"stop_token_ids must be non-negative integers, got {t!r}.")

    @property
    def is_greedy(self) -> bool:
        """True when the request picks the argmax token at every step."""
        return self.temperature < GREEDY_EPS

    @property
    def effective_top_k(self) -> int:
        """top_k with the 'disabled' spellings normalised to 0."""
        return max(0, self.top_k)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
