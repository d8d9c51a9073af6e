"""How long an engine step takes, for the deployment simulator: from a measured profile or a roofline.

A step's cost depends only on its shape (`StepShape`): how many requests decode and with how
many draft tokens, over how much context, and which prompt chunks it prefills. Two models:

- `MeasuredCostModel` interpolates the tables `specserve profile` recorded on a machine
  (decode step by batch and context, verify step by tokens per request, prefill chunk by size
  and by the context before it, engine overhead per step, drafter passes, KV transfer bandwidth);
- `RooflineCostModel` bounds each step by published hardware figures (`HardwareSpec`) and a
  model's dimensions: max(bytes / bandwidth, FLOPs / peak), each at an efficiency, plus
  tensor-parallel all-reduces and a fixed overhead per step. It plans models this machine
  cannot run (a Llama-3-70B on H100s).

Pure Python (no torch): plans run anywhere.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from specserve.errors import SpecServeError
from specserve.models.arch import ArchConfig
from specserve.ops.calc import (
    KVDims,
    attention_flops_per_context_token,
    kv_bytes_per_token,
    weights_read_per_token,
)
from specserve.ops.hardware import HardwareSpec

PROFILE_FORMAT = "specserve-profile/1"
ACTIVATION_BYTES = 2  # bf16 / fp16 activations, what a tensor-parallel all-reduce moves per element


class ProfileError(SpecServeError, ValueError):
    """A profile file is not one `specserve profile` wrote, or lacks a table; the message names it."""


class StepShape(NamedTuple):
    """What one engine step carries; its cost depends on nothing else."""

    decode_seqs: int = 0  # requests decoding: one new token each, plus draft tokens
    decode_tokens: int = 0  # their tokens in the step: decode_seqs + verified draft tokens
    decode_context: int = 0  # KV tokens those requests attend to, summed over them
    decode_max_context: int = 0  # the longest of those contexts
    prefill: tuple[tuple[int, int], ...] = ()  # per prompt chunk: (its tokens, tokens before it)

    @property
    def num_seqs(self) -> int:
        """Requests in the step."""
        return self.decode_seqs + len(self.prefill)

    @property
    def num_tokens(self) -> int:
        """Tokens the forward pass computes."""
        return self.decode_tokens + sum(p for p, _ in self.prefill)


class CostModel(Protocol):
    """Step times and capacities of one worker (an engine on its devices)."""

    @property
    def description(self) -> str:
        """What the costs come from, for reports."""
        ...

    @property
    def num_layers(self) -> int:
        """Layers the KV streams through (layer-pipelined transfer)."""
        ...

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token, all layers."""
        ...

    @property
    def kv_capacity_tokens(self) -> int:
        """KV tokens one worker holds."""
        ...

    @property
    def link_gb_s(self) -> float | None:
        """KV transfer bandwidth between two workers in GB/s (None: unknown)."""
        ...

    def step_s(self, shape: StepShape, role: str = "colocated") -> float:
        """Seconds of one engine step of this shape (the forward pass and the engine's own work) on
        a worker in `role` ("colocated", "prefill" or "decode")."""
        ...

    def disagg_request_overhead_s(self, local_prefill: bool) -> float:
        """Seconds a request of a disaggregated deployment spends between the router and its workers
        outside their steps and the KV stream (calls to the workers, its first output's way back),
        prefilled on its decode worker (local_prefill) or through a prefill worker."""
        ...

    def draft_s(self, batch: int, k: int) -> float:
        """Seconds of the draft model's passes for k tokens for each of `batch` requests (0 when k == 0)."""
        ...

    def spec_step_s(self, batch: int) -> float:
        """Seconds speculation adds to every step of `batch` requests while it is switched on, drafting
        or not (the policy, a model-free proposer, verification outside the forward)."""
        ...

    def spec_verify_s(self, batch: int) -> float:
        """Seconds a step of `batch` requests that verifies drafts takes outside the forward beyond
        spec_step_s (a model-free proposer's proposals, the draft tree, the verification)."""
        ...

    def co_run_slowdown(self, role: str, batch: int = 1) -> float:
        """How many times longer a step of `batch` requests on a worker in `role` ("prefill" or
        "decode") takes while another worker of the deployment computes beside it (1.0: workers
        share nothing)."""
        ...

    @property
    def request_overhead_s(self) -> float:
        """Seconds a request spends in the front end outside engine steps (HTTP, tokenizing, the
        first chunk's way back), added to its time to first token."""
        ...

    @property
    def busy_request_overhead_s(self) -> float:
        """What of request_overhead_s a request still pays when it finds its engine at work: all
        of it behind HTTP (the server parses, templates and streams beside the engine's steps),
        none in-process (the lone requests it is measured from wake an engine at rest; a busy one
        takes a new request in at its next step)."""
        ...


# ---------------------------------------------------------------------- interpolation
def interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear y(x) through the points, extended linearly past both ends (xs ascending)."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1 = xs[i - 1], xs[i]
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - x0) / (x1 - x0)


def non_decreasing(ys: Sequence[float]) -> list[float]:
    """Each value replaced by the smallest at or after it: a cost table made monotone.

    A step never gets cheaper with more tokens, so a point above a later one was slowed by
    something else (on a shared machine, another process); noise only ever adds time.
    """
    out = list(ys)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return out


# ---------------------------------------------------------------------- measured
class Curve(NamedTuple):
    """y(x) through measured points (x ascending), piecewise linear."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]

    def __call__(self, x: float) -> float:
        return interp(self.xs, self.ys, x)


class Surface(NamedTuple):
    """z(row, col) through a measured grid, piecewise linear along both axes."""

    rows: tuple[float, ...]
    cols: tuple[float, ...]
    values: tuple[tuple[float, ...], ...]  # [row][col]

    def __call__(self, row: float, col: float) -> float:
        return interp(self.rows, [interp(self.cols, r, col) for r in self.values], row)


class _ProfileReader:
    """Typed access to a profile dict; every problem raises a ProfileError naming the field."""

    def __init__(self, profile: Mapping[str, Any]) -> None:
        if not isinstance(profile, Mapping) or profile.get("format") != PROFILE_FORMAT:
            raise ProfileError(f"not a specserve profile (its `format` must be {PROFILE_FORMAT!r}); "
                               "record one with `specserve profile --model M --out P.json`.")
        self.profile = profile

    def get(self, path: str) -> Any:
        node: Any = self.profile
        for key in path.split("."):
            if not isinstance(node, Mapping) or key not in node:
                raise ProfileError(f"the profile has no {path}; record it again with `specserve profile`.")
            node = node[key]
        return node

    def whole(self, path: str) -> int:
        value = self.get(path)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ProfileError(f"profile field {path} must be a whole number >= 1, got {value!r}.")
        return value

    def number(self, path: str) -> float:
        value = self.get(path)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
            raise ProfileError(f"profile field {path} must be a number > 0, got {value!r}.")
        return float(value)

    def numbers(self, path: str, *, length: int | None = None, ascending: bool = False,
                minimum: float = 0.0, strict: bool = True) -> tuple[float, ...]:
        values = self.get(path)
        ok = isinstance(values, list) and bool(values) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            and (v > minimum if strict else v >= minimum) for v in values)
        if not ok:
            bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
            raise ProfileError(f"profile field {path} must be a non-empty list of numbers {bound}, got {values!r}.")
        if length is not None and len(values) != length:
            raise ProfileError(f"profile field {path} must hold {length} values (one per point), got {len(values)}.")
        if ascending and any(b <= a for a, b in zip(values, values[1:])):
            raise ProfileError(f"profile field {path} must be strictly ascending, got {values}.")
        return tuple(float(v) for v in values)

    def curve(self, xs_path: str, ys_path: str, *, monotone: bool = True, strict: bool = True) -> Curve:
        xs = self.numbers(xs_path, ascending=True)
        ys = self.numbers(ys_path, length=len(xs), strict=strict)
        return Curve(xs, tuple(non_decreasing(ys)) if monotone else ys)

    def surface(self, rows_path: str, cols_path: str, values_path: str) -> Surface:
        rows = self.numbers(rows_path, ascending=True)
        cols = self.numbers(cols_path, ascending=True)
        grid = self.get(values_path)
        if not isinstance(grid, list) or len(grid) != len(rows):
            raise ProfileError(f"profile field {values_path} must hold {len(rows)} rows (one per {rows_path}).")
        values = []
        for i, row in enumerate(grid):
            if not isinstance(row, list) or len(row) != len(cols) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and math.isfinite(v) for v in row
            ):
                raise ProfileError(f"profile field {values_path}[{i}] must hold {len(cols)} numbers > 0 "
                                   f"(one per {cols_path}), got {row!r}.")
            values.append(tuple(non_decreasing([float(v) for v in row])))
        return Surface(rows, cols, tuple(values))


def _linear_in_context(decode: Surface) -> Surface:
    """The decode table [context][batch] with each batch's times on a line in the context: the
    time at the shortest context as timed, and the least-squares slope through that point over
    the longer ones (never negative: a longer context never makes a step cheaper).

    What a decode step adds per token of context is the KV it reads, linear in the context (the
    native attention shares a step's keys out among the threads by their count). The table
    times three contexts per batch; one point timed in a fast spell, interpolated piecewise, bent a whole
    range: on the Xeon recordings the batch-2 step at 1,024 tokens came out 0.4-0.6 ms per
    thousand keys where every other point read 1.1-1.5, and bench/disagg.py's long prompts, two
    requests decoding at a mean context of ~1,300, were predicted 22-30% under their TPOT. Over
    the 27 stored recordings: 771 of 912 p50s within 20% against 763 piecewise (the six Xeon
    ones 216 of 240 against 208; the Zen ones unchanged in sum)."""
    cs = decode.rows
    if len(cs) < 2:
        return decode
    span = sum((c - cs[0]) ** 2 for c in cs)
    by_batch = []
    for j in range(len(decode.cols)):
        vs = [row[j] for row in decode.values]
        slope = max(0.0, sum((c - cs[0]) * (v - vs[0]) for c, v in zip(cs, vs)) / span)
        by_batch.append([vs[0] + slope * (c - cs[0]) for c in cs])
    return decode._replace(values=tuple(tuple(non_decreasing([col[i] for col in by_batch])) for i in range(len(cs))))


def _served_steady_state(decode: Surface, r: _ProfileReader) -> Surface:
    """The decode table with what its steps cost beyond the profile's served forwards taken off.

    The table times each (context, batch) point alone, between points of other sizes; a server
    steps the same model back to back. Where the weights nearly fit the last-level cache, back to
    back is cheaper: on a Xeon with a 480 MiB L3, SmolLM2's batch-1 forward took 4.9 ms in the
    table and 3.7 ms in the profile's own served steps (`served.forward_s`, timed behind the
    server at a short context), and the table over-predicted bench/serve.py's chat TPOT by 26-31%.
    So at each served batch the table's excess over the served forward, at the served context, is
    a saving every context of that batch gets (the weights' part of a step; the KV's stays),
    interpolated between served batches and none beyond the largest. On the Zen VMs the two
    mostly agreed and little changes (over 21 stored recordings: 566 of 680 p50s within 20%,
    against 563 without)."""
    batches = r.numbers("served.batches", ascending=True)
    forwards = r.numbers("served.forward_s", length=len(batches))
    context = r.number("served.context")
    save = [max(0.0, decode(context, b) - f) for b, f in zip(batches, forwards)]

    def saving(batch: float) -> float:
        return 0.0 if batch > batches[-1] else interp(batches, save, max(batch, batches[0]))

    # Never below half the timed step: a served forward timed in a fast spell of a shared machine
    # does not make the table's long contexts free.
    return decode._replace(values=tuple(
        tuple(non_decreasing([max(v - saving(b), 0.5 * v) for b, v in zip(decode.cols, row)]))
        for row in decode.values))


@dataclass(frozen=True)
class MeasuredCostModel:
    """Step times interpolated from a `specserve profile` of one machine and model.

    A step of d decoding requests (n tokens each on average, context L, T = d * n token rows)
    and prompt chunks (p tokens after o others) costs

        overhead(d + chunks) + D(d, L) + [V(d, n) - V(d, 1)] + c * (T - d) * max(0, L - L_V)
            + [G(T + sum p) - G(T)] + c * sum (p (p + 1) / 2 + p * o)  (+ c * pad)

    D: the decode table by batch and context (a line in the context: _linear_in_context); V: the
    verify table by batch and tokens per request (its growth over n = 1 is what the drafts add),
    timed at context L_V; each draft row also attends over the L - L_V keys the context has
    beyond it (the decode table carries that for the one row a request always has); c: seconds
    per (query, key) pair of attention, fitted on chunks timed after a context. G(m) = P(m) - c * m (m + 1) / 2 is the
    prefill table P less its chunk's own causal attention: what a forward over m token rows
    costs in its matmuls. A step's rows go through one forward, so its chunks' rows cost what
    they add to the decodes' rows (G(T + sum p) - G(T)), not a forward of their own: the
    multi-row kernels read each weight once for every row of the step, and on a CPU the first
    16 or so rows cost little more than one (the profile times chunks from 2 tokens up, and
    P(1) is the one-token decode step). overhead(b) is the engine's own per-step work; for a
    served deployment (`served=True`) it is what the profile's steps behind the OpenAI server
    took beyond the decode table at their batch (HTTP streaming shares the CPU with the engine).

    Workers of one deployment on one machine (disaggregated prefill and decode workers on its
    cores) slow each other down: they share memory bandwidth, the last-level cache and, on a
    VM, perhaps the physical cores behind the vCPUs. The profile's `co_run` measures a decode
    step beside a prefill and a prefill chunk beside a decode, each beside a synthetic neighbour
    (torch matmuls); where `profile --disagg` timed decodes on a real decode worker while its
    prefill worker computed a long prompt (`relay.beside_prefill`, by decode batch: on a 2-vCPU
    Zen 5, x1.48 at batch 1 and x1.64 at batch 4, where the synthetic neighbour gave x1.47 at
    batch 4), that is the decode factor. `co_run_slowdown(role, batch)` is the factor (1.0 when
    the profile has none: it ran with no core to spare).

    Attention comes in two kinds (the profile's `engine.attention`): the native kernels attend
    each token to its own keys only ("per_token": L is the decodes' mean context), while torch's
    SDPA path pads every request of a step to its longest query run and context ("padded",
    specserve/attention.py: L is the longest context, and a step that mixes a prompt chunk with
    decodes also pays c for each padded (query, key) pair). Noise on a shared machine only adds
    time, so each table is made monotone by keeping, at every point, the smallest time at or
    after it.
    """

    description: str
    num_layers: int
    kv_bytes_per_token: int
    kv_capacity_tokens: int
    link_gb_s: float | None
    max_num_batched_tokens: int  # the profiled engine's scheduler settings (the plan's defaults)
    max_num_seqs: int
    decode: Surface  # [context][batch] seconds
    verify: Surface  # [batch][tokens per request] seconds, at one context
    verify_context: float  # L_V: the context the verify table was timed at
    prefill: Curve  # chunk tokens -> seconds, nothing before the chunk
    padded_attention: bool  # attention pads each request to the step's longest query and context
    pair_s: float  # c: seconds per (query, key) pair of multi-token attention
    overhead: Curve  # batch -> seconds per step outside the forward (the engine's, or served)
    drafter_pass: Curve | None  # a draft model: batch -> seconds of one drafting pass
    spec_step: Curve | None  # a model-free proposer: batch -> seconds speculation adds to each step
    co_run: Mapping[str, float] = field(default_factory=dict)  # role -> slowdown beside another worker
    spec_verify: Curve | None = None  # a model-free proposer: batch -> what a step verifying drafts adds
    decode_beside_prefill: Curve | None = None  # decode batch -> slowdown beside a real prefill worker
    request_overhead_s: float = 0.0  # the front end's time per request (http or in_process)
    busy_request_overhead_s: float = 0.0  # of that, what a request finding its engine at work pays
    relay_overhead: Curve | None = None  # batch -> a disaggregated decode worker's seconds per step outside the forward
    relay_request_s: tuple[float, float] = (0.0, 0.0)  # disaggregated requests' extra: (prefilled locally, through P)

    @classmethod
    def from_profile(cls, profile: Mapping[str, Any], *, served: bool = False, http: bool = False,
                     in_process: bool = False) -> MeasuredCostModel:
        """The model of a profile dict (as `specserve profile` writes it); ProfileError if malformed.

        served: steps pay the overhead measured behind the OpenAI server (HTTP clients streaming),
        else the engine's own (an engine driven in-process). http: requests also pay the front
        end's time measured there (the served time to first token of the median lone request less
        what its prefill step costs), as clients of an HTTP server do; in_process: the same for
        requests submitted in-process (`AsyncEngine`, the profile's `in_process`; nothing when
        the profile predates it), as an application embedding the engine submits them.
        """
        if http and in_process:
            raise ValueError("a front end is either HTTP or in-process, not both.")
        try:
            return cls._from_profile(_ProfileReader(profile), profile, served=served, http=http, in_process=in_process)
        except ProfileError:
            raise
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:  # a part of another kind than recorded
            raise ProfileError(f"not a profile `specserve profile` wrote ({type(e).__name__}: {e}); record one with "
                               "`specserve profile --model M --out P.json`.") from None

    @classmethod
    def _from_profile(cls, r: _ProfileReader, profile: Mapping[str, Any], *, served: bool, http: bool,
                      in_process: bool) -> MeasuredCostModel:
        decode = _linear_in_context(r.surface("decode.contexts", "decode.batches", "decode.step_s"))
        if (profile.get("served") or {}).get("forward_s") is not None:
            decode = _served_steady_state(decode, r)
        verify = r.surface("verify.batches", "verify.tokens", "verify.step_s")
        verify_context = r.number("verify.context")
        if verify.cols[0] == 1:  # one token per request is a decode step: the faster of the two timings
            verify = verify._replace(values=tuple(
                (min(row[0], decode(verify_context, b)), *row[1:]) for b, row in zip(verify.rows, verify.values)))
        one_token = decode(decode.rows[0], 1)  # a one-token prompt chunk is a decode step
        prefill = r.curve("prefill.chunks", "prefill.step_s")
        if prefill.xs[0] > 1:
            prefill = Curve((1.0, *prefill.xs), (min(one_token, prefill.ys[0]), *prefill.ys))

        chunk = r.number("prefill_context.chunk")
        offsets = r.numbers("prefill_context.offsets", ascending=True, strict=False)
        times = r.numbers("prefill_context.step_s", length=len(offsets))
        if offsets[0] != 0:
            raise ProfileError("profile field prefill_context.offsets must start at 0 (the chunk alone).")
        # Least squares through the origin: the extra seconds against chunk * offset (query, key) pairs.
        pairs = [(chunk * o, t - times[0]) for o, t in zip(offsets[1:], times[1:])]
        sxx = sum(x * x for x, _ in pairs)
        pair_s = max(0.0, sum(x * y for x, y in pairs) / sxx) if sxx else 0.0

        drafter_pass = spec_step = spec_verify = None
        if profile.get("drafter") is not None:
            drafter_cost = r.get("drafter.cost")
            if drafter_cost == "per_pass":
                drafter_pass = r.curve("drafter.batches", "drafter.pass_s")
            elif drafter_cost == "flat":
                spec_step = r.curve("drafter.batches", "drafter.step_s", monotone=False)
                if profile["drafter"].get("verify_step_s") is not None:
                    spec_verify = r.curve("drafter.batches", "drafter.verify_step_s", monotone=False)
            else:
                raise ProfileError(f"profile field drafter.cost must be 'per_pass' or 'flat', got {drafter_cost!r}.")
        attention = r.get("engine.attention")
        if attention not in ("padded", "per_token"):
            raise ProfileError(f"profile field engine.attention must be 'padded' or 'per_token', got {attention!r}.")
        link = r.get("kv_transfer.bandwidth_gb_s")
        overhead = r.curve("engine_overhead.batches", "engine_overhead.step_s", monotone=False, strict=False)
        if served:
            steps = r.curve("served.batches", "served.step_s", monotone=False)
            context = r.number("served.context")
            overhead = Curve(steps.xs, tuple(max(overhead(b), t - decode(context, b)) for b, t in zip(steps.xs, steps.ys)))
        request_overhead_s = 0.0
        front = "served" if http else "in_process" if in_process and profile.get("in_process") is not None else None
        if front is not None:
            # The median lone request (whatever idle time preceded it: the profile varies that, and
            # what waking an engine at rest costs varied more between runs than with the idle time).
            ttft = r.number(f"{front}.ttft_s")
            prompt = r.number(f"{front}.prompt_tokens")
            cached = min(float(profile[front].get("cached_tokens") or 0), prompt - 1)
            # The engine's part of that TTFT: one step prefilling what the prefix cache lacked.
            lone_step = max(prefill(prompt - cached), 1e-6) + pair_s * (prompt - cached) * cached + max(0.0, overhead(1))
            request_overhead_s = max(0.0, ttft - lone_step)
        # In-process, that time is waking an engine at rest: bench/disagg.py's co-located requests
        # arriving while others decoded (12 recordings, 144 requests) were over-predicted by a median
        # 25% with it charged and 4% without; behind HTTP the front end's work stays (charging it
        # only to an idle server too: 321 of 384 p50s within 20%, against 330).
        busy_request_overhead_s = request_overhead_s if front == "served" else 0.0
        co_run: dict[str, float] = {}
        if profile.get("co_run") is not None:
            co_run = {role: max(1.0, r.number(f"co_run.slowdown.{role}")) for role in ("decode", "prefill")}
        decode_beside_prefill = None
        if (profile.get("relay") or {}).get("beside_prefill") is not None:
            # Decodes timed on a real decode worker while its prefill worker computed a long prompt:
            # that neighbour, not co_run's synthetic one.
            if "batches" in profile["relay"]["beside_prefill"]:
                decode_beside_prefill = r.curve("relay.beside_prefill.batches", "relay.beside_prefill.slowdown",
                                                monotone=False)
            else:  # one batch (profiles of c6829cc)
                decode_beside_prefill = Curve((r.number("relay.beside_prefill.batch"),),
                                              (r.number("relay.beside_prefill.slowdown"),))
        relay_overhead, relay_request_s = None, (0.0, 0.0)
        if profile.get("relay") is not None:
            # A decode worker behind the router: its step less the forward at that batch and context.
            steps = r.curve("relay.batches", "relay.step_s", monotone=False)
            context = r.number("relay.context")
            relay_overhead = Curve(steps.xs, tuple(max(0.0, t - decode(context, b)) for b, t in zip(steps.xs, steps.ys)))
            one = relay_overhead(1)
            # A lone request's measured time to first token less what the simulator charges it:
            # through P, the prefill worker's step, the KV's way over the link and the decode
            # worker's step over the last prompt token; prefilled locally, the decode worker's step.
            p = r.number("relay.prompt_tokens")
            link_s = (p - 1) * r.whole("model.kv_bytes_per_token") / (r.number("kv_transfer.bandwidth_gb_s") * 1e9)
            through = r.number("relay.ttft_s") - (max(prefill(p - 1), 1e-6) + max(0.0, overhead(1)) + link_s
                                                   + decode(p, 1) + one)
            local = r.number("relay.local_ttft_s") - (max(prefill(r.number("relay.local_prompt_tokens")), 1e-6) + one)
            relay_request_s = (max(0.0, local), max(0.0, through))
        return cls(
            description=f"measured profile of {r.get('model.name')} on {r.get('machine.cpu')}",
            num_layers=r.whole("model.num_layers"),
            kv_bytes_per_token=r.whole("model.kv_bytes_per_token"),
            kv_capacity_tokens=r.whole("model.kv_capacity_tokens"),
            link_gb_s=None if link is None else r.number("kv_transfer.bandwidth_gb_s"),
            max_num_batched_tokens=r.whole("engine.max_num_batched_tokens"),
            max_num_seqs=r.whole("engine.max_num_seqs"),
            decode=decode,
            verify=verify,
            verify_context=verify_context,
            prefill=prefill,
            padded_attention=attention == "padded",
            pair_s=pair_s,
            overhead=overhead,
            drafter_pass=drafter_pass,
            spec_step=spec_step,
            spec_verify=spec_verify,
            co_run=co_run,
            decode_beside_prefill=decode_beside_prefill,
            request_overhead_s=request_overhead_s,
            busy_request_overhead_s=busy_request_overhead_s,
            relay_overhead=relay_overhead,
            relay_request_s=relay_request_s,
        )

    def _verify_extra_s(self, batch: float, tokens: float) -> float:
        """What n tokens per request cost over one, at this batch."""
        if tokens <= 1:
            return 0.0
        v = self.verify
        by_batch = [interp(v.cols, row, tokens) - interp(v.cols, row, 1) for row in v.values]
        return max(0.0, interp(v.rows, by_batch, batch))

    def _rows_s(self, rows: float) -> float:
        """G(rows): the prefill table less its chunk's own causal attention (0 for no rows)."""
        if rows <= 0:
            return 0.0
        return max(self.prefill(rows) - self.pair_s * rows * (rows + 1) / 2, 1e-6)

    def step_s(self, shape: StepShape, role: str = "colocated") -> float:
        """Seconds of one step (see the class docstring for the formula); a disaggregated decode
        worker's step pays the profile's relay overhead instead of the engine's."""
        d = shape.decode_seqs
        t, rows = 0.0, 0
        if d:
            context = shape.decode_max_context if self.padded_attention else shape.decode_context / d
            t += max(self.decode(context + 1, d), 1e-6)
            t += self._verify_extra_s(d, shape.decode_tokens / d)
            t += self.pair_s * (shape.decode_tokens - d) * max(0.0, context - self.verify_context)
            rows = shape.decode_tokens
        if shape.prefill:
            chunk_rows = sum(p for p, _ in shape.prefill)
            t += max(0.0, self._rows_s(rows + chunk_rows) - self._rows_s(rows))
            t += self.pair_s * sum(p * (p + 1) / 2 + p * o for p, o in shape.prefill)
        if self.padded_attention and len(shape.prefill) + (1 if d else 0) > 1:
            n = math.ceil(shape.decode_tokens / d) if d else 0
            query = max([n, *(p for p, _ in shape.prefill)])
            keys = max([shape.decode_max_context + n if d else 0, *(p + o for p, o in shape.prefill)])
            counted = shape.decode_tokens * (shape.decode_max_context + n) + sum(p * (p + o) for p, o in shape.prefill)
            t += self.pair_s * max(0, shape.num_seqs * query * keys - counted)
        overhead = self.relay_overhead if role == "decode" and self.relay_overhead is not None else self.overhead
        return t + max(0.0, overhead(shape.num_seqs))

    def draft_s(self, batch: int, k: int) -> float:
        """k passes of the draft model over `batch` requests (none for a model-free proposer)."""
        if k <= 0 or batch <= 0 or self.drafter_pass is None:
            return 0.0
        return k * max(0.0, self.drafter_pass(batch))

    def spec_step_s(self, batch: int) -> float:
        """What a model-free proposer's speculation adds to each step, as measured at this batch."""
        return 0.0 if self.spec_step is None else max(0.0, self.spec_step(batch))

    def spec_verify_s(self, batch: int) -> float:
        """What a step verifying a model-free proposer's drafts adds beyond that (0 if not measured)."""
        return 0.0 if self.spec_verify is None else max(0.0, self.spec_verify(batch))

    def co_run_slowdown(self, role: str, batch: int = 1) -> float:
        """The profile's slowdown of a `role` step of `batch` requests beside another worker (1.0 if
        not measured): a decode step's as timed beside a real prefill worker where the profile has
        that (read between its batches, held past them), else the synthetic neighbour's."""
        curve = self.decode_beside_prefill
        if role == "decode" and curve is not None:
            return max(1.0, curve(min(max(batch, curve.xs[0]), curve.xs[-1])))
        return self.co_run.get(role, 1.0)

    def disagg_request_overhead_s(self, local_prefill: bool) -> float:
        """The profile's `relay` lone requests' time to first token beyond their steps (0 if not measured)."""
        return self.relay_request_s[0 if local_prefill else 1]


# ---------------------------------------------------------------------- roofline
@dataclass(frozen=True)
class RooflineCostModel:
    """Step times bounded by published hardware figures, for models this machine cannot run.

    A worker is `tp` devices running the model tensor-parallel. A step reads every weight once
    and each request's KV context, and computes 2 FLOPs per weight per token plus attention;
    it takes max(bytes / (tp * bandwidth * memory_efficiency), FLOPs / (tp * peak *
    compute_efficiency)), the same bound as `calc.roofline` extended to steps that mix prompt
    chunks with decodes. With tp > 1 each layer adds two all-reduces of the step's activations
    (ring: 2 (tp - 1) / tp of the bytes each way over the link, plus a latency). The
    efficiencies and the per-step overhead are assumptions, not measurements: kernels reach
    some fraction of a datasheet's peaks, and an engine spends time outside the forward.
    """

    hardware: HardwareSpec
    arch: ArchConfig
    tp: int = 1
    weight_bits: float = 16.0
    kv_dtype: str = "fp16"
    draft_arch: ArchConfig | None = None  # a draft model on the same devices; None: a model-free drafter
    memory_efficiency: float = 0.8
    compute_efficiency: float = 0.6
    step_overhead_s: float = 0.002  # scheduling, sampling, launches: one step's work outside the forward
    allreduce_latency_s: float = 8e-6  # one small all-reduce over NVLink, order of magnitude
    memory_usable: float = 0.9  # share of device memory for weights and KV (the rest: activations, runtime)
    num_layers: int = field(init=False)
    kv_bytes_per_token: int = field(init=False)
    kv_capacity_tokens: int = field(init=False)
    link_gb_s: float | None = field(init=False)
    description: str = field(init=False)

    def __post_init__(self) -> None:
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tp (devices per worker) must be a whole number >= 1, got {self.tp!r}.")
        if not self.weight_bits > 0:
            raise ValueError(f"weight_bits must be > 0, got {self.weight_bits}.")
        for name in ("memory_efficiency", "compute_efficiency", "memory_usable"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must lie in (0, 1], got {getattr(self, name)}.")
        put = object.__setattr__
        put(self, "num_layers", self.arch.num_layers)
        put(self, "kv_bytes_per_token", kv_bytes_per_token(KVDims.from_arch(self.arch), self.kv_dtype))
        free = self.tp * self.hardware.memory_gb * 1e9 * self.memory_usable - self.weight_bytes
        if self.draft_arch is not None:
            free -= weights_read_per_token(self.draft_arch) * self.weight_bits / 8
        put(self, "kv_capacity_tokens", max(0, int(free // self.kv_bytes_per_token)))
        # Each of the tp devices sends its shard of the KV over its own link, one direction.
        link = self.hardware.link_gb_s
        put(self, "link_gb_s", None if link is None else link / 2 * self.tp)
        put(self, "description", f"roofline of {self.arch.name or self.arch.architecture} on "
                                 f"{self.tp} x {self.hardware.description}")

    @property
    def weight_bytes(self) -> float:
        """Bytes of the target's weights (all devices together)."""
        return weights_read_per_token(self.arch) * self.weight_bits / 8

    def _forward_s(self, arch: ArchConfig, tokens: int, kv_tokens_read: float, attention_pairs: float) -> float:
        weights = weights_read_per_token(arch)
        nbytes = weights * self.weight_bits / 8 + kv_tokens_read * kv_bytes_per_token(
            KVDims.from_arch(arch), self.kv_dtype)
        flops = 2 * weights * tokens + attention_flops_per_context_token(arch) * attention_pairs
        memory_s = nbytes / (self.tp * self.hardware.memory_gb_s * 1e9 * self.memory_efficiency)
        compute_s = flops / (self.tp * self.hardware.tflops * 1e12 * self.compute_efficiency)
        comm_s = 0.0
        if self.tp > 1:
            link = (self.hardware.link_gb_s or self.hardware.memory_gb_s) / 2 * 1e9  # one direction
            activation_bytes = tokens * arch.hidden_size * ACTIVATION_BYTES
            per_allreduce = self.allreduce_latency_s + 2 * (self.tp - 1) / self.tp * activation_bytes / link
            comm_s = 2 * arch.num_layers * per_allreduce
        return max(memory_s, compute_s) + comm_s

    def step_s(self, shape: StepShape, role: str = "colocated") -> float:
        """Seconds of one step: the bound above plus the fixed overhead (the same in every role)."""
        d = shape.decode_seqs
        # Each decode token attends to its request's context; a chunk of p tokens after o
        # attends to o + (its own causal half) p / 2 on average. Every context is read once.
        pairs = (shape.decode_tokens * shape.decode_context / d if d else 0.0) + sum(
            p * (o + p / 2) for p, o in shape.prefill)
        kv_read = shape.decode_context + sum(o + p for p, o in shape.prefill)
        return self._forward_s(self.arch, shape.num_tokens, kv_read, pairs) + self.step_overhead_s

    def draft_s(self, batch: int, k: int) -> float:
        """k passes of the draft model over `batch` tokens (a model-free drafter: free)."""
        if k <= 0 or batch <= 0 or self.draft_arch is None:
            return 0.0
        return k * self._forward_s(self.draft_arch, batch, 0.0, 0.0)

    def spec_step_s(self, batch: int) -> float:
        """The policy's own work per step: part of step_overhead_s on paper."""
        return 0.0

    def spec_verify_s(self, batch: int) -> float:
        """Verification's bookkeeping: part of step_overhead_s on paper."""
        return 0.0

    def co_run_slowdown(self, role: str, batch: int = 1) -> float:
        """Workers on separate devices: none (host-side contention is not modelled on paper)."""
        return 1.0

    @property
    def request_overhead_s(self) -> float:
        """The front end's time per request: part of step_overhead_s on paper."""
        return 0.0

    @property
    def busy_request_overhead_s(self) -> float:
        """None on paper either."""
        return 0.0

    def disagg_request_overhead_s(self, local_prefill: bool) -> float:
        """Calls between the router and the workers: part of step_overhead_s on paper."""
        return 0.0


# ---------------------------------------------------------------------- what if slower
@dataclass(frozen=True)
class ScaledCostModel:
    """Another cost model on a machine `factor` times slower (every time multiplied, the link's
    bandwidth divided): how much a prediction moves when the machine runs a few percent faster
    or slower than when it was profiled (a shared VM drifts by that much between two runs), or
    a plan with headroom. Capacities are unchanged."""

    base: CostModel
    factor: float

    def __post_init__(self) -> None:
        if not (self.factor > 0 and math.isfinite(self.factor)):
            raise ValueError(f"a cost model's scale must be a positive number, got {self.factor!r}.")

    @property
    def description(self) -> str:
        return f"{self.base.description}, times {self.factor:g}"

    @property
    def num_layers(self) -> int:
        return self.base.num_layers

    @property
    def kv_bytes_per_token(self) -> int:
        return self.base.kv_bytes_per_token

    @property
    def kv_capacity_tokens(self) -> int:
        return self.base.kv_capacity_tokens

    @property
    def link_gb_s(self) -> float | None:
        link = self.base.link_gb_s
        return None if link is None else link / self.factor

    @property
    def request_overhead_s(self) -> float:
        return self.base.request_overhead_s * self.factor

    @property
    def busy_request_overhead_s(self) -> float:
        return self.base.busy_request_overhead_s * self.factor

    def step_s(self, shape: StepShape, role: str = "colocated") -> float:
        return self.base.step_s(shape, role) * self.factor

    def disagg_request_overhead_s(self, local_prefill: bool) -> float:
        return self.base.disagg_request_overhead_s(local_prefill) * self.factor

    def draft_s(self, batch: int, k: int) -> float:
        return self.base.draft_s(batch, k) * self.factor

    def spec_step_s(self, batch: int) -> float:
        return self.base.spec_step_s(batch) * self.factor

    def spec_verify_s(self, batch: int) -> float:
        return self.base.spec_verify_s(batch) * self.factor

    def co_run_slowdown(self, role: str, batch: int = 1) -> float:
        return self.base.co_run_slowdown(role, batch)
