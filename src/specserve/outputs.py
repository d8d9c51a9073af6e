"""What the engine hands back: text, token ids, finish reason and per-request metrics."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from specserve.request import Request


@dataclass
class RequestMetrics:
    """Latency and token counts of one request (seconds; None where not applicable yet)."""

    ttft_s: float | None = None  # arrival -> first output token
    tpot_s: float | None = None  # mean time per output token after the first
    e2e_s: float | None = None  # arrival -> finished
    queue_s: float | None = None  # arrival -> first scheduled
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. speculation counters

    @classmethod
    def from_request(cls, req: Request) -> RequestMetrics:
        """Read the metrics off a request's timestamps and counters."""
        t = req.times
        n_gen = req.num_output_tokens
        ttft = t.first_token - t.arrival if t.first_token is not None else None
        tpot = None
        if t.first_token is not None and t.last_token is not None and n_gen > 1:
            tpot = (t.last_token - t.first_token) / (n_gen - 1)
        return cls(
            ttft_s=ttft,
            tpot_s=tpot,
            e2e_s=t.finished - t.arrival if t.finished is not None else None,
            queue_s=t.first_scheduled - t.arrival if t.first_scheduled is not None else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_generated_tokens=n_gen,
            num_cached_prompt_tokens=max(req.num_cached_tokens, 0),
            num_preemptions=req.num_preemptions,
            extra=spec_metrics(req),
        )

    def to_dict(self) -> dict[str, Any]:
        """Flat JSON-ready dict (extra counters merged in)."""
        d = asdict(self)
        extra = d.pop("extra")
        d.update(extra)
        return d


def spec_metrics(req: Request) -> dict[str, Any]:
    """Speculation counters of one request (zeros when it never speculated)."""
    drafted, accepted = req.drafted_per_position, req.accepted_per_position
    n_out = req.num_output_tokens
    return {
        "num_target_steps": req.num_target_steps,
        "num_spec_steps": req.num_spec_steps,
        "num_draft_tokens": req.num_draft_tokens,
        "num_accepted_tokens": req.num_accepted_tokens,
        "acceptance_rate": req.num_accepted_tokens / req.num_draft_tokens if req.num_draft_tokens else None,
        # Acceptance by depth: of the steps whose draft reached depth j + 1 and tested it, the
        # share that accepted a node there (a chain's position j + 1).
        "acceptance_per_position": [a / d if d else None for a, d in zip(accepted, drafted)],
        "mean_accepted_len": (req.num_accepted_tokens / req.num_spec_steps) if req.num_spec_steps else None,
        "draft_nodes_per_step": (req.num_draft_tokens / req.num_spec_steps) if req.num_spec_steps else None,
        "accepted_length_histogram": dict(sorted(Counter(req.accepted_lengths).items())),  # counted in C
        "accepted_lengths": list(req.accepted_lengths),
        "target_forwards_per_token": req.num_target_steps / n_out if n_out else None,
    }


@dataclass
class CompletionOutput:
    """One generated sequence."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: list[float] | None = None
    delta_text: str = ""  # new text since the previous output of this request (streaming)
    delta_token_ids: list[int] = field(default_factory=list)
    # With SamplingParams.top_logprobs: per token, the most likely (token id, logprob) pairs.
    top_logprobs: list[list[tuple[int, float]]] | None = None

    @property
    def finished(self) -> bool:
        """True once a finish reason is set."""
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        """vLLM's: the sum of the generated tokens' logprobs (None unless logprobs were asked for)."""
        return None if self.logprobs is None else float(sum(self.logprobs))


@dataclass
class RequestOutput:
    """A prompt and its completions (one per sample when n > 1)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None
    # The error is the deployment's, not the request's (a disaggregated router that has no decode
    # worker left, or whose workers kept failing it): the same request may succeed later (503).
    retryable: bool = False
    # prompt_logprobs: per prompt token, its logprob under the model given the tokens before it
    # (None for the first), and the likeliest (id, logprob) pairs at that position.
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None

    @property
    def text(self) -> str:
        """Text of the first completion."""
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        """Token ids of the first completion."""
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        """Finish reason of the first completion."""
        return self.outputs[0].finish_reason

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary used by `specserve generate --json`."""
        d: dict[str, Any] = {
            "request_id": self.request_id,
            "prompt": self.prompt,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "metrics": self.metrics.to_dict(),
        }
        if self.prompt_logprobs is not None:
            d["prompt_token_ids"] = self.prompt_token_ids
            d["prompt_logprobs"] = self.prompt_logprobs
            if any(self.prompt_top_logprobs or ()):
                d["prompt_top_logprobs"] = [None if t is None else [[i, v] for i, v in t]
                                            for t in self.prompt_top_logprobs or ()]
        if len(self.outputs) > 1:
            d["outputs"] = [
                {"index": o.index, "text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason}
                for o in self.outputs
            ]
        return d
