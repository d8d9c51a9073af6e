"""The operator's formulas (`specserve calc`): speculative speedup, acceptance, KV size, transfer,
latency and the decode roofline.

Every formula is a pure function of numbers; the `*_report` functions bundle a formula's answer
with its inputs into a `Report` the command line prints as text or JSON. Units: bytes, seconds
inside, milliseconds and GB (10^9 bytes; GiB printed beside) at the edges, as the flags say.
Symbols as in the design brief:

- alpha: expected tokens a request gains per target step (1..K+1);
- b (beta): the chance one draft token is accepted given every earlier one was;
- K: draft tokens per step; c: the cost of one draft pass over one target step (T_draft / T_target).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from specserve.errors import SpecServeError
from specserve.models.arch import ArchConfig


class CalcInputError(SpecServeError, ValueError):
    """A calculator input is out of its range; the message says which and why."""


# ---------------------------------------------------------------------- speculation
EXACT_SUM_K = 4096  # expected_tokens sums the series exactly up to this K, past it uses the closed form
MAX_TABLE_K = 1024  # the longest best-K table
MAX_WEIGHTS = 1e16  # a model's weights, ten thousand times the largest published (beyond: a typo, and overflow)
MAX_RATE = 1e9  # GB/s or TFLOP/s: a million times any published chip's (beyond: a typo, and times that underflow to 0)


def _check_k(k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise CalcInputError(f"K (draft tokens per step) must be a whole number >= 0, got {k!r}.")


def _check_alpha(alpha: float, k: int) -> None:
    _check_k(k)
    # A step yields at least the target's own token and at most K drafts plus the bonus token.
    if not (1.0 <= alpha <= k + 1):
        raise CalcInputError(
            f"alpha (expected tokens per step) must lie between 1 and K + 1 = {k + 1} for K = {k}, got {alpha}."
        )


def _check_cost_ratio(cost_ratio: float) -> None:
    if not (cost_ratio >= 0.0 and math.isfinite(cost_ratio)):
        raise CalcInputError(f"the cost ratio T_draft / T_target must be >= 0, got {cost_ratio}.")


def _check_acceptance(b: float) -> None:
    if not (0.0 <= b <= 1.0):
        raise CalcInputError(f"the per-token acceptance must lie in [0, 1], got {b}.")


# A step that also computes prompt tokens verifies drafts that add at most this share to its time:
# a prompt's first token waits for its whole step (spec.policy.SpecPolicy.cap_for_prompts; the
# planner's simulator cuts its drafts alike). SmolLM2 with prompt lookup on a 2-vCPU Xeon, a short
# chat ask arriving while another request copied its answer in 12-node trees: the ask's step took
# 22 ms against 7 without the drafts, its time to first token 29 against 18 ms through the server.
PROMPT_DRAFT_SHARE = 0.1


def draft_rows_beside_prompt(step_s: Callable[[int], float], drafted: int) -> int:
    """The most of `drafted` draft rows a step that carries prompt tokens may verify: its time
    with r rows, step_s(r), at most PROMPT_DRAFT_SHARE above step_s(0) (step_s rises with r)."""
    limit = (1 + PROMPT_DRAFT_SHARE) * step_s(0)
    lo, hi = 0, drafted
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if step_s(mid) <= limit else (lo, mid - 1)
    return lo


def cut_largest_first(sizes: Sequence[int], total: int) -> list[int]:
    """`sizes` cut to `total` in all, the largest first: each ends at min(size, L) or L + 1 for one
    level L (of those above it, the last ones keep the + 1). Unchanged when they fit."""
    if total >= sum(sizes):
        return list(sizes)
    if total <= 0:
        return [0] * len(sizes)
    lo, hi = 0, max(sizes)
    while lo < hi:  # the highest level L with sum(min(size, L)) <= total
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if sum(min(x, mid) for x in sizes) <= total else (lo, mid - 1)
    out = [min(x, lo) for x in sizes]
    extra = total - sum(out)
    for i in reversed(range(len(out))):
        if extra <= 0:
            break
        if sizes[i] > lo:
            out[i], extra = out[i] + 1, extra - 1
    return out


def speedup(alpha: float, k: int, cost_ratio: float) -> float:
    """Low-batch speedup over plain decoding: S = alpha / (1 + K * c)."""
    # Decode is memory-bound: verifying K + 1 tokens in one target pass costs about one plain
    # step, so a step costs T_target + K * T_draft and yields alpha tokens; plain yields 1 per T_target.
    _check_alpha(alpha, k)
    _check_cost_ratio(cost_ratio)
    return alpha / (1.0 + k * cost_ratio)


def speedup_high_batch(alpha: float, k: int, cost_ratio: float) -> float:
    """High-batch speedup: S = alpha / ((K + 1) + K * c), the verify pass being compute-bound."""
    # Past the roofline's ridge a step's cost grows with the tokens it carries: verifying K + 1
    # tokens per request costs K + 1 plain steps' worth, the drafts K * c more. S <= 1 then, as
    # alpha <= K + 1: at high batch speculation only loses, and the policy must switch it off.
    _check_alpha(alpha, k)
    _check_cost_ratio(cost_ratio)
    return alpha / ((k + 1) + k * cost_ratio)


def expected_tokens(acceptance: float, k: int) -> float:
    """alpha from per-token acceptance b: (1 - b^(K+1)) / (1 - b), which is K + 1 at b = 1."""
    # Token i of the draft survives with probability b^i (every earlier one accepted); the step
    # also yields one target token. The sum 1 + b + ... + b^K is the closed form above, and it
    # stays exact as b -> 1 where the closed form divides zero by zero.
    _check_k(k)
    _check_acceptance(acceptance)
    if acceptance in (0.0, 1.0):
        return 1.0 + k * acceptance
    if k <= EXACT_SUM_K:
        return math.fsum(acceptance**i for i in range(k + 1))
    # Large K: the closed form, with expm1 so that b near 1 keeps its digits (the sum would take
    # K steps: `--k 100000000000` ran for minutes).
    return -math.expm1((k + 1) * math.log(acceptance)) / (1.0 - acceptance)


def acceptance_for(alpha: float, k: int, *, tol: float = 1e-12) -> float:
    """The per-token acceptance b that yields alpha tokens per step at K (inverse of expected_tokens)."""
    _check_alpha(alpha, k)
    if k == 0:
        raise CalcInputError(
            "with K = 0 a step yields one token whatever the acceptance; give K >= 1."
        )
    # expected_tokens(b, K) rises monotonically from 1 (b = 0) to K + 1 (b = 1): bisect.
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        if expected_tokens(mid, k) < alpha:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


class KChoice(NamedTuple):
    """One row of the best-K table."""

    k: int
    alpha: float
    speedup: float
    speedup_high_batch: float


def k_table(acceptance: float, cost_ratio: float, max_k: int) -> list[KChoice]:
    """alpha and S for K = 0..max_k at per-token acceptance b and cost ratio c."""
    _check_k(max_k)
    if max_k > MAX_TABLE_K:
        raise CalcInputError(f"--max-k is at most {MAX_TABLE_K} (one table row per K; speculation past a few "
                             f"dozen drafts a step never pays), got {max_k}.")
    _check_cost_ratio(cost_ratio)
    rows = []
    for k in range(max_k + 1):
        a = expected_tokens(acceptance, k)
        rows.append(KChoice(k, a, speedup(a, k, cost_ratio), speedup_high_batch(a, k, cost_ratio)))
    return rows


def best_k(acceptance: float, cost_ratio: float, max_k: int = 16) -> KChoice:
    """The K in 0..max_k with the highest low-batch speedup (the smallest such K on ties)."""
    # S(K) = (1 - b^(K+1)) / ((1 - b)(1 + K c)): each extra draft adds b^K tokens and costs c.
    return max(k_table(acceptance, cost_ratio, max_k), key=lambda row: (row.speedup, -row.k))


# ---------------------------------------------------------------------- KV cache
# Bytes per stored element of each KV dtype. fp8 keeps one scale per tensor (negligible); int8
# is specserve's `--kv-cache-dtype int8`, which also stores per-(token, head) float32 scales.
KV_DTYPE_BYTES: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}
INT8_SCALE_BYTES = 4  # one float32 scale per (token, kv head) for K and one for V


@dataclass(frozen=True)
class KVDims:
    """The dimensions that size a KV cache."""

    layers: int
    kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CalcInputError(
                    f"--{name.replace('_', '-')} must be a whole number >= 1, got {value!r}."
                )

    @classmethod
    def from_arch(cls, arch: ArchConfig) -> KVDims:
        """The KV dimensions of a loaded model's architecture."""
        return cls(arch.num_layers, arch.num_kv_heads, arch.head_dim)


def kv_bytes_per_token(dims: KVDims, dtype: str) -> int:
    """KV bytes one token occupies: 2 * layers * kv_heads * head_dim * bytes_per_element (+ int8 scales)."""
    if dtype not in KV_DTYPE_BYTES:
        raise CalcInputError(
            f"unknown KV dtype {dtype!r}; use one of: {', '.join(KV_DTYPE_BYTES)}."
        )
    # 2: a key and a value vector per layer and kv head.
    total = 2 * dims.layers * dims.kv_heads * dims.head_dim * KV_DTYPE_BYTES[dtype]
    if (
        dtype == "int8"
    ):  # as engine.runner.kv_bytes_per_token: + a float32 scale per (token, head), K and V
        total += 2 * dims.layers * dims.kv_heads * INT8_SCALE_BYTES
    return total


# ---------------------------------------------------------------------- KV transfer
class TransferTime(NamedTuple):
    """How long a KV transfer takes and how much of it layer pipelining hides (seconds)."""

    total_s: float  # bytes / bandwidth
    per_layer_s: float  # total / layers
    exposed_s: (
        float  # with layer pipelining: after the last layer's compute, until the KV is complete
    )
    hidden_fraction: float  # 1 - exposed / total


def transfer_time(
    num_bytes: float,
    bandwidth_gb_s: float,
    layers: int = 1,
    compute_s_per_layer: float | None = None,
) -> TransferTime:
    """Time to move num_bytes over a link, and the part layer-by-layer streaming hides.

    Model: the prefill computes layer i in c seconds and its KV (t = total / layers seconds)
    goes out as soon as the layer is done, one layer at a time over the link. Layer i's send
    starts at max((i + 1) c, end of send i - 1), so after the last layer's compute the decode
    side still waits

        exposed = t + (layers - 1) * max(0, t - c)

    one layer's transfer when compute keeps ahead of the link (t <= c), and the backlog the link
    builds up when it does not. Without pipelining the whole transfer is exposed. With c unknown
    (None) the best case is reported: compute at least as slow as the link, exposed = t.
    """
    if not (num_bytes >= 0 and math.isfinite(num_bytes)):
        raise CalcInputError(f"bytes to transfer must be >= 0, got {num_bytes}.")
    if not (0 < bandwidth_gb_s <= MAX_RATE):
        raise CalcInputError(f"bandwidth must be in (0, {MAX_RATE:.0e}] GB/s, got {bandwidth_gb_s}.")
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise CalcInputError(f"layers must be a whole number >= 1, got {layers!r}.")
    if compute_s_per_layer is not None and not (
        compute_s_per_layer >= 0 and math.isfinite(compute_s_per_layer)
    ):
        raise CalcInputError(f"compute time per layer must be >= 0, got {compute_s_per_layer}.")
    total = _finite(num_bytes / (bandwidth_gb_s * 1e9), "transfer time")
    t = total / layers
    c = t if compute_s_per_layer is None else compute_s_per_layer
    exposed = t + (layers - 1) * max(0.0, t - c)
    return TransferTime(total, t, exposed, 1.0 - exposed / total if total > 0 else 0.0)


# ---------------------------------------------------------------------- latency
def _check_times(ttft: float, tpot: float, names: str = "TTFT and TPOT") -> None:
    if not (0 <= ttft < math.inf and 0 <= tpot < math.inf):
        raise CalcInputError(f"{names} must be >= 0 and finite, got {ttft} and {tpot}.")


def _finite(value: float, what: str) -> float:
    """value, or a CalcInputError where finite inputs overflowed (an answer of 'never' would be wrong)."""
    if not math.isfinite(value):
        raise CalcInputError(f"the {what} overflows for these inputs; check their magnitudes.")
    return value


def request_latency(ttft_s: float, tpot_s: float, num_tokens: int) -> float:
    """End-to-end latency of a request: TTFT + (N - 1) * TPOT."""
    _check_times(ttft_s, tpot_s)
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise CalcInputError(
            f"the number of output tokens must be a whole number >= 1, got {num_tokens!r}."
        )
    # The first token arrives at TTFT; each of the other N - 1 costs one TPOT.
    return _finite(ttft_s + (num_tokens - 1) * tpot_s, "latency")


# ---------------------------------------------------------------------- roofline
def weights_read_per_token(arch: ArchConfig) -> int:
    """Weights a decode step reads (and multiplies) per layer stack and LM head, counted in elements."""
    h, q, kv, inter = arch.hidden_size, arch.q_size, arch.kv_size, arch.intermediate_size
    per_layer = (
        2 * h * q + 2 * h * kv + 3 * h * inter + 2 * h
    )  # q,o + k,v + gate,up,down + two norms
    # The embedding is a row lookup (not read in full); the LM head (tied or not) is read whole.
    return arch.num_layers * per_layer + h + arch.vocab_size * h


def attention_flops_per_context_token(arch: ArchConfig) -> int:
    """Decode attention FLOPs per token per context token: 4 * layers * heads * head_dim."""
    # q.k over head_dim and the weighted sum of v over head_dim, a multiply-add each, every head.
    return 4 * arch.num_layers * arch.q_size


# Published dimensions of models specserve does not ship, for planning on paper (`--model NAME`
# in `specserve calc` and `specserve plan`): the models' config.json files on the Hugging Face hub.
MODEL_PRESETS: dict[str, ArchConfig] = {
    arch.name: arch
    for arch in (
        ArchConfig("llama", vocab_size=128_256, hidden_size=8192, intermediate_size=28_672, num_layers=80,
                   num_heads=64, num_kv_heads=8, head_dim=128, rope_theta=500_000.0, rms_norm_eps=1e-5,
                   max_position_embeddings=8192, tie_word_embeddings=False, name="llama-3-70b"),
        ArchConfig("llama", vocab_size=128_256, hidden_size=4096, intermediate_size=14_336, num_layers=32,
                   num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500_000.0, rms_norm_eps=1e-5,
                   max_position_embeddings=8192, tie_word_embeddings=False, name="llama-3-8b"),
        ArchConfig("llama", vocab_size=128_256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                   num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500_000.0, rms_norm_eps=1e-5,
                   max_position_embeddings=131_072, tie_word_embeddings=True, name="llama-3.2-1b"),
    )
}


def load_arch(model: str) -> ArchConfig:
    """A model's architecture (a preset name, bundled name, GGUF file or HF directory) without reading its weights."""
    preset = MODEL_PRESETS.get(model.lower())
    if preset is not None:
        return preset
    from specserve.models.bundled import resolve_model
    from specserve.models.loader import load_model_metadata

    arch, _ = load_model_metadata(resolve_model(model))
    return arch


class Roofline(NamedTuple):
    """Bounds of one decode step of `batch` requests (bytes, FLOPs, seconds)."""

    bytes_per_step: float  # weights once + every request's KV context
    flops_per_step: float
    memory_s: float  # bytes / bandwidth
    compute_s: float  # FLOPs / peak
    tokens_per_s: float  # batch / max(memory_s, compute_s): the ceiling
    bound: str  # "memory" or "compute"
    intensity: float  # FLOPs per byte of this step
    ridge_intensity: float  # the hardware's peak FLOP/s over its bandwidth
    ridge_batch: float  # batch where compute starts to bound the step (inf: never)


def roofline(
    num_weights: float,
    weight_bits: float,
    batch: int,
    bandwidth_gb_s: float,
    tflops: float,
    *,
    context_tokens: int = 0,
    kv_bytes_token: int = 0,
    attn_flops_per_context_token: float = 0.0,
) -> Roofline:
    """Memory and compute bounds of a decode step, and the batch where the bound switches.

    A step reads every weight once, W = N * bits / 8 bytes, plus each request's KV context,
    B * ctx * kv_bytes; it does B * (2 N + a * ctx) FLOPs (a multiply-add per weight per token,
    attention a FLOPs per context token). Time = max(bytes / bandwidth, FLOPs / peak). Setting
    the two equal gives the ridge batch

        B* = (W / BW) / ((2 N + a * ctx) / P - ctx * kv_bytes / BW)

    and no ridge (inf) when the denominator is <= 0: each request then adds KV bytes as fast as
    FLOPs, so the step stays memory-bound at any batch.
    """
    if not (0 < num_weights <= MAX_WEIGHTS and 0 < weight_bits <= 64):
        raise CalcInputError(
            f"the weight count must be in (0, {MAX_WEIGHTS:.0e}] and --weight-bits in (0, 64], got {num_weights} "
            f"and {weight_bits}."
        )
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise CalcInputError(f"batch must be a whole number >= 1, got {batch!r}.")
    if not (0 < bandwidth_gb_s <= MAX_RATE and 0 < tflops <= MAX_RATE):
        raise CalcInputError(
            f"bandwidth (GB/s) and TFLOP/s must be in (0, {MAX_RATE:.0e}], got {bandwidth_gb_s} and {tflops}."
        )
    if context_tokens < 0:
        raise CalcInputError(f"context tokens must be >= 0, got {context_tokens}.")
    bw, peak = bandwidth_gb_s * 1e9, tflops * 1e12
    weight_bytes = num_weights * weight_bits / 8
    kv_per_request = context_tokens * kv_bytes_token
    flops_per_token = 2 * num_weights + attn_flops_per_context_token * context_tokens
    nbytes = weight_bytes + batch * kv_per_request
    flops = batch * flops_per_token
    mem_s, comp_s = _finite(nbytes / bw, "memory time"), _finite(flops / peak, "compute time")
    denom = flops_per_token / peak - kv_per_request / bw
    ridge = (weight_bytes / bw) / denom if denom > 0 else math.inf
    return Roofline(
        nbytes,
        flops,
        mem_s,
        comp_s,
        batch / max(mem_s, comp_s),
        "compute" if comp_s > mem_s else "memory",
        flops / nbytes,
        peak / bw,
        ridge,
    )


# ---------------------------------------------------------------------- reports
@dataclass(frozen=True)
class Figure:
    """One named result: its JSON key, a label, the value, its unit, the formula it comes from."""

    key: str
    label: str
    value: float | int | str | None
    unit: str = ""
    formula: str = ""
    fmt: str = ".4g"  # format spec of the value in text output

    def value_text(self) -> str:
        """The value formatted for text output."""
        if self.value is None:
            return "-"
        if isinstance(self.value, str):
            return self.value
        if isinstance(self.value, float) and math.isinf(self.value):
            return "never"
        return format(self.value, self.fmt)


@dataclass(frozen=True)
class Report:
    """A calculation's inputs, figures and optional table, printable as text or JSON."""

    title: str
    inputs: Mapping[str, Any]
    figures: tuple[Figure, ...]
    table: tuple[Mapping[str, Any], ...] = ()
    notes: tuple[str, ...] = ()

    def __getitem__(self, key: str) -> float | int | str | None:
        """A figure's value by key."""
        for f in self.figures:
            if f.key == key:
                return f.value
        raise KeyError(key)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: inputs, every figure by key, the table and notes when present."""
        d: dict[str, Any] = {"calc": self.title, "inputs": dict(self.inputs)}
        d.update(
            {
                f.key: (None if isinstance(f.value, float) and math.isinf(f.value) else f.value)
                for f in self.figures
            }
        )
        if self.table:
            d["table"] = [dict(row) for row in self.table]
        if self.notes:
            d["notes"] = list(self.notes)
        return d

    def to_text(self) -> str:
        """Aligned lines: label, value and unit, formula; then the table and the notes."""
        given = ", ".join(
            f"{_INPUT_LABELS.get(k, k.replace('_', ' '))} {_cell(v, '.4g')}"
            for k, v in self.inputs.items()
            if v is not None
        )
        lines = [f"{self.title} ({given})" if given else self.title]
        w_label = max((len(f.label) for f in self.figures), default=0)
        w_value = max((len(f.value_text()) for f in self.figures), default=0)
        w_unit = max((len(f.unit) for f in self.figures), default=0)
        for f in self.figures:
            row = f"  {f.label:<{w_label}}  {f.value_text():>{w_value}} {f.unit:<{w_unit}}"
            lines.append(f"{row}  {f.formula}".rstrip() if f.formula else row.rstrip())
        if self.table:
            cols = list(self.table[0])
            cells = [[_cell(row[c]) for c in cols] for row in self.table]
            widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
            lines.append("")
            lines.append("  " + "  ".join(c.rjust(w) for c, w in zip(cols, widths)))
            lines.extend("  " + "  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in cells)
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


# Text labels of input keys whose JSON name does not read well with spaces for underscores.
_INPUT_LABELS = {
    "bandwidth_gb_s": "GB/s",
    "tflops": "TFLOP/s",
    "ttft_ms": "TTFT ms",
    "tpot_ms": "TPOT ms",
    "compute_ms_per_layer": "compute ms/layer",
}


def _cell(v: Any, fmt: str = ".3f") -> str:
    return format(v, fmt) if isinstance(v, float) else str(v)


GB, GIB = 1e9, float(1 << 30)


def speedup_report(alpha: float, k: int, cost_ratio: float) -> Report:
    """`calc speedup`: S at low and high batch."""
    low, high = speedup(alpha, k, cost_ratio), speedup_high_batch(alpha, k, cost_ratio)
    return Report(
        "speedup",
        {"alpha": alpha, "k": k, "cost_ratio": cost_ratio},
        (
            Figure(
                "speedup",
                "low batch",
                low,
                "x",
                "S = alpha / (1 + K*c)  (verify pass memory-bound)",
                ".2f",
            ),
            Figure(
                "speedup_high_batch",
                "high batch",
                high,
                "x",
                "S = alpha / ((K+1) + K*c)  (verify pass compute-bound)",
                ".2f",
            ),
        ),
    )


def alpha_report(k: int, acceptance: float | None = None, alpha: float | None = None) -> Report:
    """`calc alpha`: tokens per step from per-token acceptance, or the acceptance behind an alpha."""
    if (acceptance is None) == (alpha is None):
        raise CalcInputError(
            "give exactly one of --acceptance (per-token) or --alpha (tokens per step)."
        )
    if acceptance is not None:
        a = expected_tokens(acceptance, k)
        return Report(
            "alpha",
            {"acceptance": acceptance, "k": k},
            (
                Figure("alpha", "tokens per step", a, "", "alpha = (1 - b^(K+1)) / (1 - b)", ".4f"),
                Figure("acceptance", "per-token acceptance", acceptance, "", "b", ".4f"),
            ),
        )
    assert alpha is not None
    b = acceptance_for(alpha, k)
    return Report(
        "alpha",
        {"alpha": alpha, "k": k},
        (
            Figure("alpha", "tokens per step", alpha, "", "alpha", ".4f"),
            Figure(
                "acceptance",
                "per-token acceptance",
                b,
                "",
                "b solving (1 - b^(K+1)) / (1 - b) = alpha",
                ".4f",
            ),
        ),
    )


def best_k_report(acceptance: float, cost_ratio: float, max_k: int = 16) -> Report:
    """`calc best-k`: the K with the highest low-batch speedup, and S for every K up to max_k."""
    rows = k_table(acceptance, cost_ratio, max_k)
    best = best_k(acceptance, cost_ratio, max_k)
    return Report(
        "best-k",
        {"acceptance": acceptance, "cost_ratio": cost_ratio, "max_k": max_k},
        (
            Figure("best_k", "best K", best.k, "", "argmax_K alpha(K) / (1 + K*c)", "d"),
            Figure(
                "alpha", "tokens per step", best.alpha, "", "alpha = (1 - b^(K+1)) / (1 - b)", ".3f"
            ),
            Figure("speedup", "speedup", best.speedup, "x", "S = alpha / (1 + K*c)", ".2f"),
        ),
        table=tuple(
            {"K": r.k, "alpha": r.alpha, "S_low": r.speedup, "S_high": r.speedup_high_batch}
            for r in rows
        ),
        notes=("K = 0 is plain decoding (S = 1); at high batch (S_high) speculation never pays.",),
    )


def kv_report(
    dims: KVDims, dtype: str, tokens: int | None = None, model: str | None = None
) -> Report:
    """`calc kv`: KV bytes per token and per request."""
    if tokens is not None and (isinstance(tokens, bool) or tokens < 1):
        raise CalcInputError(f"--tokens must be >= 1, got {tokens}.")
    per_token = kv_bytes_per_token(dims, dtype)
    formula = f"2 * {dims.layers} layers * {dims.kv_heads} kv heads * {dims.head_dim} * {KV_DTYPE_BYTES[dtype]} B"
    if dtype == "int8":
        formula += f" + 2 * {dims.layers} * {dims.kv_heads} * {INT8_SCALE_BYTES} B scales"
    figures = [Figure("bytes_per_token", "per token", per_token, "B", formula, ",d")]
    if tokens is not None:
        total = per_token * tokens
        figures += [
            Figure(
                "bytes_per_request", "per request", total, "B", f"per token * {tokens} tokens", ",d"
            ),
            Figure("gb_per_request", "per request", total / GB, "GB", "10^9 bytes", ".3g"),
            Figure("gib_per_request", "per request", total / GIB, "GiB", "2^30 bytes", ".3g"),
        ]
    inputs = {
        "model": model,
        "layers": dims.layers,
        "kv_heads": dims.kv_heads,
        "head_dim": dims.head_dim,
        "dtype": dtype,
        "tokens": tokens,
    }
    return Report("kv", inputs, tuple(figures))


def transfer_report(
    num_bytes: float,
    bandwidth_gb_s: float,
    layers: int = 1,
    compute_ms_per_layer: float | None = None,
) -> Report:
    """`calc transfer`: transfer time, per layer, and what layer pipelining leaves exposed."""
    c = None if compute_ms_per_layer is None else compute_ms_per_layer / 1e3
    r = transfer_time(num_bytes, bandwidth_gb_s, layers, c)
    how = (
        "best case: compute per layer >= transfer per layer"
        if c is None
        else "per-layer t + (layers-1) * max(0, t - compute)"
    )
    return Report(
        "transfer",
        {
            "bytes": num_bytes,
            "bandwidth_gb_s": bandwidth_gb_s,
            "layers": layers,
            "compute_ms_per_layer": compute_ms_per_layer,
        },
        (
            Figure(
                "total_ms",
                "transfer",
                _finite(r.total_s * 1e3, "transfer time"),
                "ms",
                "bytes / bandwidth (all exposed without pipelining)",
                ".1f",
            ),
            Figure(
                "per_layer_ms", "per layer", _finite(r.per_layer_s * 1e3, "transfer time"), "ms", "transfer / layers", ".2f"
            ),
            Figure("exposed_ms", "exposed, pipelined", _finite(r.exposed_s * 1e3, "transfer time"), "ms", how, ".2f"),
            Figure(
                "hidden_fraction",
                "hidden, pipelined",
                r.hidden_fraction,
                "",
                "1 - exposed / transfer",
                ".3f",
            ),
        ),
    )


def latency_report(ttft_ms: float, tpot_ms: float, num_tokens: int) -> Report:
    """`calc latency`: end-to-end latency of an N-token answer."""
    _check_times(ttft_ms, tpot_ms, "--ttft-ms and --tpot-ms")  # in the units asked for
    total = request_latency(ttft_ms / 1e3, tpot_ms / 1e3, num_tokens)
    return Report(
        "latency",
        {"ttft_ms": ttft_ms, "tpot_ms": tpot_ms, "tokens": num_tokens},
        (
            Figure("latency_ms", "latency", _finite(total * 1e3, "latency"), "ms", "TTFT + (N - 1) * TPOT", ".1f"),
            Figure(
                "tokens_per_s",
                "decode rate",
                1e3 / tpot_ms if tpot_ms > 0 else math.inf,
                "tok/s",
                "1 / TPOT",
                ".1f",
            ),
        ),
    )


def roofline_report(
    num_weights: float,
    weight_bits: float,
    batch: int,
    bandwidth_gb_s: float,
    tflops: float,
    *,
    context_tokens: int = 0,
    kv_bytes_token: int = 0,
    attn_flops_per_context_token: float = 0.0,
    inputs: Mapping[str, Any] | None = None,
) -> Report:
    """`calc roofline`: bytes per step, the tokens/s ceiling and the ridge batch."""
    r = roofline(
        num_weights,
        weight_bits,
        batch,
        bandwidth_gb_s,
        tflops,
        context_tokens=context_tokens,
        kv_bytes_token=kv_bytes_token,
        attn_flops_per_context_token=attn_flops_per_context_token,
    )
    given = {
        **(inputs or {}),
        "weights": num_weights,
        "weight_bits": weight_bits,
        "batch": batch,
        "bandwidth_gb_s": bandwidth_gb_s,
        "tflops": tflops,
        "context_tokens": context_tokens or None,
    }
    return Report(
        "roofline",
        given,
        (
            Figure(
                "bytes_per_step",
                "bytes per step",
                r.bytes_per_step / GB,
                "GB",
                "weights * bits / 8 + batch * context * KV/token",
                ".3f",
            ),
            Figure("memory_ms", "memory time", _finite(r.memory_s * 1e3, "memory time"), "ms", "bytes / bandwidth", ".3f"),
            Figure(
                "compute_ms",
                "compute time",
                _finite(r.compute_s * 1e3, "compute time"),
                "ms",
                "batch * (2 * weights + attention) / peak",
                ".3f",
            ),
            Figure(
                "tokens_per_s",
                "ceiling",
                r.tokens_per_s,
                "tok/s",
                f"batch / max(memory, compute): {r.bound}-bound",
                ".1f",
            ),
            Figure("bound", "bound", r.bound, "", "", ""),
            Figure("intensity", "step intensity", r.intensity, "FLOP/B", "FLOPs / bytes", ".1f"),
            Figure(
                "ridge_intensity",
                "ridge intensity",
                r.ridge_intensity,
                "FLOP/B",
                "peak / bandwidth",
                ".1f",
            ),
            Figure(
                "ridge_batch",
                "ridge batch",
                r.ridge_batch,
                "",
                "batch where compute time = memory time",
                ".1f",
            ),
        ),
    )
