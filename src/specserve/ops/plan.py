"""`specserve plan`: the deployment with the most goodput within the SLO for a workload mix.

The workload file (YAML) gives a request rate and classes:

    rate: 4.0                  # requests per second, Poisson arrivals
    requests: 600              # optional: how many to simulate
    slo: {ttft: 2.0, tpot: 0.1}   # optional: seconds; --slo overrides it
    classes:
      - name: chat
        share: 0.5             # fraction of the requests (the shares add up to 1)
        prompt_tokens: 512     # or [lo, hi]: drawn uniformly
        output_tokens: 256
        acceptance: 0.6        # optional: per-token acceptance of its drafts (default 0: no speculation)
        draft_share: 0.5       # optional: share of its decode steps with a draft (prompt lookup: where
                               # its text matches; default 1, a model drafter drafts every step)
        slo: {ttft: 1.0}       # optional: overrides the global targets for this class

For N devices the planner tries every worker size that fits the model (tensor parallel
degrees with a roofline cost model; one profiled worker each with a measured profile),
co-located engines and every prefill:decode split, speculation off and on at a few K and
speedup thresholds; simulates the same requests through each (`ops/simulate.py`) and ranks
them by goodput: requests per second that met their class's SLO.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from specserve.errors import SpecServeError
from specserve.files import output_file
from specserve.ops.costmodel import CostModel, MeasuredCostModel, ProfileError, RooflineCostModel
from specserve.ops.simulate import (
    SLO,
    Deployment,
    RequestClass,
    SimulationError,
    SpecSetting,
    Summary,
    TokenRange,
    Workload,
    simulate,
    summarize,
)

SPEC_KS = (2, 4, 8)
SPEC_THRESHOLDS = (1.0, 1.3)
MIN_REQUESTS, MAX_REQUESTS, SIMULATED_SECONDS = 200, 1000, 120.0
# The most requests a plan simulates (per configuration searched): more than enough for p99s, and
# a typo of 10**8 would otherwise run for hours.
MAX_SIMULATED_REQUESTS = 20_000
LONGEST_REQUESTS_PER_WORKER = 4  # a worker size must hold this many of the longest requests' KV
CLASS_FIELDS = ("name", "share", "prompt_tokens", "output_tokens", "acceptance", "draft_share", "slo")
TOP_FIELDS = ("rate", "requests", "slo", "classes")


class WorkloadError(SpecServeError, ValueError):
    """The workload file or --slo is malformed; the message names the field."""


# ---------------------------------------------------------------------- inputs
class PlanInput(NamedTuple):
    """A parsed workload file: the mix (each class with its SLO) and how many requests to simulate."""

    workload: Workload
    requests: int

    @property
    def slos(self) -> dict[str, SLO]:
        """Each class's SLO by name."""
        return {c.name: c.slo for c in self.workload.classes if c.slo is not None}


def parse_slo(text: str, where: str = "--slo") -> dict[str, float]:
    """'ttft=2.0,tpot=0.1' (seconds) -> {'ttft': 2.0, 'tpot': 0.1}; either key may be left out."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        out.update(_slo_fields({key.strip(): value.strip() if sep else None}, where))
    if not out:
        raise WorkloadError(f"{where} is empty; give e.g. ttft=2.0,tpot=0.1 (seconds).")
    return out


def _slo_fields(data: Any, where: str) -> dict[str, float]:
    if not isinstance(data, Mapping):
        raise WorkloadError(f"{where} must be a mapping like {{ttft: 2.0, tpot: 0.1}} (seconds), got {data!r}.")
    out = {}
    for key, value in data.items():
        if key not in ("ttft", "tpot"):
            raise WorkloadError(f"{where}: unknown target {key!r}; use ttft and/or tpot (seconds).")
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if isinstance(value, bool) or not (number > 0 and math.isfinite(number)):
            raise WorkloadError(f"{where}.{key} must be a number of seconds > 0, got {value!r}.")
        out[key] = number
    return out


def _tokens(data: Any, where: str) -> TokenRange:
    def whole(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1

    if whole(data):
        return TokenRange(data, data)
    if isinstance(data, list) and len(data) == 2 and all(whole(v) for v in data) and data[0] <= data[1]:
        return TokenRange(data[0], data[1])
    raise WorkloadError(f"{where} must be a whole number >= 1 or a range [lo, hi] with 1 <= lo <= hi, got {data!r}.")


def _number(data: Any, where: str, lo: float, hi: float = math.inf, lo_open: bool = True) -> float:
    if isinstance(data, str) and re.fullmatch(r"\s*[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+\s*", data):
        data = float(data)  # YAML 1.1 reads 1e9 (no dot) as a string
    ok = isinstance(data, (int, float)) and not isinstance(data, bool) and math.isfinite(data) and \
        (data > lo if lo_open else data >= lo) and data <= hi
    if not ok:
        bound = f"{'>' if lo_open else '>='} {lo:g}" + (f" and <= {hi:g}" if math.isfinite(hi) else "")
        raise WorkloadError(f"{where} must be a number {bound}, got {data!r}.")
    return float(data)


def parse_workload(data: Any, slo: Mapping[str, float] | None = None, source: str = "the workload") -> PlanInput:
    """Validate a loaded workload document; `slo` (from --slo) overrides the file's global targets."""
    if not isinstance(data, Mapping):
        raise WorkloadError(f"{source} must be a YAML mapping with `rate` and `classes`, got {type(data).__name__}.")
    unknown = [k for k in data if k not in TOP_FIELDS]
    if unknown:
        raise WorkloadError(f"{source}: unknown field {unknown[0]!r}; the fields are {', '.join(TOP_FIELDS)}.")
    for key in ("rate", "classes"):
        if key not in data:
            raise WorkloadError(f"{source} has no `{key}`.")
    rate = _number(data["rate"], "rate (requests per second)", 0)
    base = _slo_fields(data["slo"], "slo") if "slo" in data else {}
    base.update(slo or {})
    raw = data["classes"]
    if not isinstance(raw, list) or not raw:
        raise WorkloadError("classes must be a non-empty list of request classes.")
    classes: list[RequestClass] = []
    for i, c in enumerate(raw):
        where = f"classes[{i}]"
        if not isinstance(c, Mapping):
            raise WorkloadError(f"{where} must be a mapping with name, share, prompt_tokens and output_tokens.")
        unknown = [k for k in c if k not in CLASS_FIELDS]
        if unknown:
            raise WorkloadError(f"{where}: unknown field {unknown[0]!r}; the fields are {', '.join(CLASS_FIELDS)}.")
        for key in ("name", "share", "prompt_tokens", "output_tokens"):
            if key not in c:
                raise WorkloadError(f"{where} has no `{key}`.")
        name = c["name"]
        if not isinstance(name, str) or not name.strip():
            raise WorkloadError(f"{where}.name must be a non-empty string, got {name!r}.")
        if any(known.name == name for known in classes):
            raise WorkloadError(f"{where}.name {name!r} is used twice; class names must be unique.")
        # The class's own fields first: a missing SLO (often given later, with --slo) should not
        # hide a mistake in them.
        share = _number(c["share"], f"{where}.share", 0, 1)
        prompt_tokens = _tokens(c["prompt_tokens"], f"{where}.prompt_tokens")
        output_tokens = _tokens(c["output_tokens"], f"{where}.output_tokens")
        acceptance = _number(c.get("acceptance", 0.0), f"{where}.acceptance", 0, 1, lo_open=False)
        draft_share = _number(c.get("draft_share", 1.0), f"{where}.draft_share", 0, 1)
        targets = dict(base)
        if "slo" in c:
            targets.update(_slo_fields(c["slo"], f"{where}.slo"))
        for key in ("ttft", "tpot"):
            if key not in targets:
                raise WorkloadError(f"class {name!r} has no {key} target: give --slo {key}=SECONDS, a global "
                                    f"`slo: {{{key}: ...}}` or `{where}.slo.{key}` in the workload file.")
        classes.append(RequestClass(name=name, share=share, prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                                    acceptance=acceptance, slo=SLO(targets["ttft"], targets["tpot"]),
                                    draft_share=draft_share))
    total = sum(c.share for c in classes)
    if abs(total - 1.0) > 1e-3:
        raise WorkloadError(f"the class shares must add up to 1; they add up to {total:g}.")
    if "requests" in data:
        requests = data["requests"]
        if isinstance(requests, bool) or not isinstance(requests, int) or not 1 <= requests <= MAX_SIMULATED_REQUESTS:
            raise WorkloadError(f"requests must be a whole number in [1, {MAX_SIMULATED_REQUESTS:,}], got {requests!r}.")
    else:  # about two minutes of traffic, within bounds
        requests = int(min(MAX_REQUESTS, max(MIN_REQUESTS, rate * SIMULATED_SECONDS)))
    return PlanInput(Workload(rate, tuple(classes)), requests)


def yaml_problem(e: Exception) -> str:
    """A YAML parser's error in one line: where (1-based line and column) and what."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark is not None else problem


def load_workload(path: str | Path, slo: Mapping[str, float] | None = None) -> PlanInput:
    """Read and validate a workload YAML file."""
    import yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise WorkloadError(f"cannot read the workload file {path}: {e.strerror or e}.") from None
    except UnicodeDecodeError:
        raise WorkloadError(f"the workload file {path} is not UTF-8 text (a YAML file is).") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise WorkloadError(f"{path} is not valid YAML: {yaml_problem(e)}.") from None
    try:
        return parse_workload(data, slo, source=str(path))
    except WorkloadError as e:
        raise WorkloadError(f"{path}: {e}") from None


# ---------------------------------------------------------------------- workers
class WorkerOption(NamedTuple):
    """One worker size: its devices and step costs."""

    label: str  # "TP4" (4 devices, tensor parallel) or "profiled"
    devices: int
    cost: CostModel


def roofline_workers(
    hardware: Any, arch: Any, devices: int, longest_request: int, *, weight_bits: float = 16.0,
    draft_arch: Any = None,
) -> tuple[list[WorkerOption], list[str]]:
    """Tensor-parallel sizes (powers of two dividing `devices`) whose memory holds the weights and
    LONGEST_REQUESTS_PER_WORKER of the longest requests' KV; and a note for each size left out."""
    options, notes = [], []
    tp = 1
    while tp <= devices:
        if devices % tp == 0:
            cost = RooflineCostModel(hardware, arch, tp=tp, weight_bits=weight_bits, draft_arch=draft_arch)
            need = LONGEST_REQUESTS_PER_WORKER * longest_request
            if cost.kv_capacity_tokens >= need:
                options.append(WorkerOption(f"TP{tp}", tp, cost))
            else:
                notes.append(f"TP{tp} left out: {tp} x {hardware.memory_gb:g} GB leaves KV room for "
                             f"{cost.kv_capacity_tokens:,} tokens, under {LONGEST_REQUESTS_PER_WORKER} of the "
                             f"longest requests ({need:,}).")
        tp *= 2
    return options, notes


# ---------------------------------------------------------------------- the search
class PlanRow(NamedTuple):
    """One simulated configuration and how it did."""

    worker: str  # worker size label
    workers: int
    deployment: Deployment
    summary: Summary

    @property
    def layout(self) -> str:
        """'2 co-located' or '1P:1D'."""
        return self.deployment.label

    def key(self) -> tuple[float, float, float]:
        """Ranking: most goodput, then most requests within the SLO, then the lowest TTFT p99."""
        s = self.summary
        return (-s.goodput_req_s, -s.slo_attainment, s.overall.ttft_p99 or math.inf)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        d = self.deployment
        return {"worker": self.worker, "workers": self.workers, "layout": self.layout,
                "colocated": d.colocated, "prefill": d.prefill, "decode": d.decode,
                "speculation": {"k": d.spec.k, "threshold": d.spec.threshold},
                "max_num_batched_tokens": d.max_num_batched_tokens, "max_num_seqs": d.max_num_seqs,
                **self.summary.to_dict()}


def deployments(workers: int, link_known: bool, specs: Sequence[SpecSetting], max_num_batched_tokens: int,
                max_num_seqs: int) -> list[Deployment]:
    """Co-located and every prefill:decode split of `workers`, each with every speculation setting."""
    layouts = [(workers, 0, 0)] + ([(0, p, workers - p) for p in range(1, workers)] if link_known else [])
    return [Deployment(colocated=c, prefill=p, decode=d, max_num_batched_tokens=max_num_batched_tokens,
                       max_num_seqs=max_num_seqs, spec=s) for c, p, d in layouts for s in specs]


def spec_settings(workload: Workload, ks: Sequence[int] = SPEC_KS,
                  thresholds: Sequence[float] = SPEC_THRESHOLDS) -> list[SpecSetting]:
    """Speculation off, and on at each K and threshold when some class drafts with acceptance > 0."""
    if not any(c.acceptance > 0 for c in workload.classes):
        return [SpecSetting()]
    return [SpecSetting()] + [SpecSetting(k, th) for k in ks for th in thresholds]


def search(plan: PlanInput, options: Sequence[WorkerOption], devices: int, specs: Sequence[SpecSetting], *,
           max_num_batched_tokens: int, max_num_seqs: int, seed: int = 0) -> list[PlanRow]:
    """Simulate the same requests through every configuration; rows ranked best first."""
    from specserve.progress import bar

    trace = plan.workload.trace(plan.requests, seed)
    runs = [(opt, n, dep) for opt in options for n in [devices // opt.devices]
            for dep in deployments(n, opt.cost.link_gb_s is not None, specs, max_num_batched_tokens, max_num_seqs)]
    rows = []
    for opt, n, dep in bar(runs, desc=f"simulating {len(trace)} requests", unit="config"):  # (minutes on long answers)
        result = simulate(trace, dep, opt.cost, seed=seed)
        rows.append(PlanRow(opt.label, n, dep, summarize(result, plan.slos)))
    return sorted(rows, key=PlanRow.key)


# ---------------------------------------------------------------------- output
def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def format_table(rows: Sequence[PlanRow]) -> str:
    """The ranked configurations as an aligned text table."""
    head = ("#", "workers", "layout", "speculation", "goodput req/s", "in SLO", "TTFT p50 s", "TTFT p99 s",
            "TPOT p50 ms", "TPOT p99 ms", "tokens/s")
    cells = [head] + [
        (str(i), f"{r.workers} x {r.worker}", r.layout, r.deployment.spec.label, f"{r.summary.goodput_req_s:.2f}",
         f"{100 * r.summary.slo_attainment:.0f}%", _s(r.summary.overall.ttft_p50), _s(r.summary.overall.ttft_p99),
         _ms(r.summary.overall.tpot_p50), _ms(r.summary.overall.tpot_p99), f"{r.summary.output_tokens_per_s:.0f}")
        for i, r in enumerate(rows, 1)
    ]
    widths = [max(len(row[j]) for row in cells) for j in range(len(head))]
    left = {1, 2, 3}
    return "\n".join("  ".join(c.ljust(w) if j in left else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths)))
                     for row in cells)


def format_classes(row: PlanRow, slos: Mapping[str, SLO]) -> str:
    """Per-class latencies of one configuration against each class's SLO."""
    lines = [f"  {'class':<12} {'in SLO':>7} {'TTFT p50/p99 s':>15} {'(SLO)':>7} {'TPOT p50/p99 ms':>16} {'(SLO)':>7}"]
    for name, c in row.summary.by_class.items():
        slo = slos[name]
        lines.append(f"  {name:<12} {100 * c.within_slo / max(c.requests, 1):>6.0f}% "
                     f"{_s(c.ttft_p50) + '/' + _s(c.ttft_p99):>15} {slo.ttft_s:>7g} "
                     f"{_ms(c.tpot_p50) + '/' + _ms(c.tpot_p99):>16} {slo.tpot_s * 1e3:>7g}")
    return "\n".join(lines)


def best_sentence(row: PlanRow, rate: float) -> str:
    """The winning configuration in one sentence."""
    d, s = row.deployment, row.summary
    layout = (f"{d.colocated} co-located {row.worker} engine{'s' if d.colocated > 1 else ''}" if not d.disaggregated
              else f"{d.prefill} prefill + {d.decode} decode {row.worker} workers")
    spec = ("without speculation" if d.spec.k == 0
            else f"speculating up to K = {d.spec.k} when a step's expected speedup exceeds {d.spec.threshold:g}x")
    return (f"Best: {layout}, {spec}: {s.goodput_req_s:.2f} req/s within the SLO at {rate:g} req/s offered "
            f"({100 * s.slo_attainment:.0f}% of requests), TTFT p99 {_s(s.overall.ttft_p99)} s, "
            f"TPOT p99 {_ms(s.overall.tpot_p99)} ms.")


def plot(rows: Sequence[PlanRow], path: str | Path, title: str, limit: int = 30) -> Path:
    """Goodput, TTFT p99 and TPOT p99 per configuration (best first) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = list(rows[:limit])
    labels = [f"{r.workers}x{r.worker} {r.layout}, {r.deployment.spec.label}" for r in shown]
    fig, axes = plt.subplots(1, 3, figsize=(16, 0.32 * len(shown) + 1.8), sharey=True)
    y = list(range(len(shown)))
    panels = [("goodput (req/s within SLO)", [r.summary.goodput_req_s for r in shown]),
              ("TTFT p99 (s)", [r.summary.overall.ttft_p99 or 0.0 for r in shown]),
              ("TPOT p99 (ms)", [1e3 * (r.summary.overall.tpot_p99 or 0.0) for r in shown])]
    for ax, (name, values) in zip(axes, panels):
        ax.barh(y, values, color=["tab:green" if i == 0 else "tab:blue" for i in y])
        ax.set_title(name, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(y, labels, fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


# ---------------------------------------------------------------------- command line
def add_arguments(p: argparse.ArgumentParser) -> None:
    """`specserve plan`'s flags."""
    from specserve.ops.hardware import HARDWARE

    p.add_argument("--workload", required=True, help="workload YAML: rate and classes (see deploy/workloads/)")
    p.add_argument("--slo", default=None, help="targets in seconds, e.g. ttft=2.0,tpot=0.1 (classes may override)")
    src = p.add_argument_group("step costs (one of)")
    src.add_argument("--profile", default=None, help="a profile JSON from `specserve profile` (this machine)")
    src.add_argument("--hardware", default=None,
                     help=f"published figures of {', '.join(sorted(HARDWARE))} (a roofline), with --model")
    src.add_argument("--model", default=None,
                     help="with --hardware: a preset (llama-3-70b, llama-3-8b, llama-3.2-1b) or a loadable model")
    src.add_argument("--draft-model", default=None,
                     help="with --hardware: a draft model on the same devices (default: a model-free drafter)")
    src.add_argument("--weight-bits", type=float, default=16.0, help="with --hardware: bits per weight")
    p.add_argument("--gpus", type=int, default=1,
                   help="devices to plan for (with --profile: workers like the profiled one)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget per step (default: the profile's, else specserve's 512)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="requests per engine (default: the profile's, else 64)")
    p.add_argument("--requests", type=int, default=None,
                   help="requests to simulate (default: the file's, else about two minutes of traffic)")
    p.add_argument("--seed", type=int, default=0, help="seed of arrivals, token counts and draft acceptance")
    p.add_argument("--png", default=None, help="write goodput / TTFT p99 / TPOT p99 per configuration here")
    p.add_argument("--json", action="store_true", help="print the ranked configurations as JSON")


def run(args: argparse.Namespace) -> int:
    """specserve plan: exit 0 with a ranked table, 2 on bad input."""
    try:
        slo = parse_slo(args.slo) if args.slo is not None else None
        plan = load_workload(args.workload, slo)
        if args.requests is not None:
            if not 1 <= args.requests <= MAX_SIMULATED_REQUESTS:
                raise WorkloadError(f"--requests must be in [1, {MAX_SIMULATED_REQUESTS:,}], got {args.requests}.")
            plan = plan._replace(requests=args.requests)
        if args.gpus < 1:
            raise WorkloadError(f"--gpus must be >= 1, got {args.gpus}.")
        if args.png:  # before the search: a plan that cannot be drawn is found out now
            from matplotlib.figure import Figure

            args.png = str(output_file(args.png, "--png", (f".{e}" for e in Figure().canvas.get_supported_filetypes())))
        if not 0 < args.weight_bits <= 32:
            raise WorkloadError(f"--weight-bits must be in (0, 32] (e.g. 4.5 for Q4_K, 16 for bf16), got {args.weight_bits}.")
        options, notes, budget, seqs, source = _workers(args, plan)
        budget = budget if args.max_num_batched_tokens is None else args.max_num_batched_tokens
        seqs = seqs if args.max_num_seqs is None else args.max_num_seqs
        if budget < 1 or seqs < 1:
            raise WorkloadError("--max-num-batched-tokens and --max-num-seqs must be >= 1.")
        rows = search(plan, options, args.gpus, spec_settings(plan.workload), max_num_batched_tokens=budget,
                      max_num_seqs=seqs, seed=args.seed)
    except SpecServeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    title = (f"{Path(args.workload).name} at {plan.workload.rate:g} req/s on {args.gpus} device(s): {source}; "
             f"{plan.requests} requests simulated")
    if args.json:
        print(json.dumps({"workload": args.workload, "rate": plan.workload.rate, "requests": plan.requests,
                          "devices": args.gpus, "source": source, "notes": notes,
                          "slo": {k: v._asdict() for k, v in plan.slos.items()},
                          "rows": [r.to_dict() for r in rows]}, indent=2))
    else:
        print(title)
        for n in notes:
            print(f"note: {n}")
        print(format_table(rows))
        print()
        print(best_sentence(rows[0], plan.workload.rate))
        print(format_classes(rows[0], plan.slos))
    if args.png:
        path = plot(rows, args.png, title)
        print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _workers(args: argparse.Namespace, plan: PlanInput) -> tuple[list[WorkerOption], list[str], int, int, str]:
    """(worker options, notes, default token budget, default max_num_seqs, description) from the flags."""
    if (args.profile is None) == (args.hardware is None):
        raise WorkloadError("give --profile P.json (a measured profile), or --hardware NAME with --model M.")
    if args.profile is not None:
        if args.model is not None or args.draft_model is not None:
            raise WorkloadError("--model and --draft-model go with --hardware; a profile names its own model.")
        try:
            data = json.loads(Path(args.profile).read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as e:  # (not UTF-8, not JSON, nested past the limit)
            raise ProfileError(f"cannot read the profile {args.profile}: {e}.") from None
        # Plan served engines: with the step overhead measured behind the OpenAI server where recorded.
        served = isinstance(data, dict) and "served" in data
        http = served and isinstance(data["served"], dict) and "ttft_s" in data["served"]
        cost = MeasuredCostModel.from_profile(data, served=served, http=http)
        _check_fits(cost, plan)
        notes = [] if served else ["the profile has no steps measured behind the server: engine overhead only."]
        return [WorkerOption("profiled", 1, cost)], notes, cost.max_num_batched_tokens, cost.max_num_seqs, \
            cost.description
    from specserve.ops.calc import load_arch
    from specserve.ops.hardware import get_hardware

    if args.model is None:
        raise WorkloadError("--hardware needs --model (e.g. llama-3-70b).")
    hw = get_hardware(args.hardware)
    arch = load_arch(args.model)
    draft = load_arch(args.draft_model) if args.draft_model else None
    longest = max(c.prompt_tokens.hi + c.output_tokens.hi for c in plan.workload.classes)
    options, notes = roofline_workers(hw, arch, args.gpus, longest, weight_bits=args.weight_bits, draft_arch=draft)
    if not options:
        raise SimulationError(f"{args.model} does not fit {args.gpus} x {hw.description} with room for the "
                              "workload's KV: " + " ".join(notes))
    if hw.link_gb_s is None:
        notes.append(f"{hw.name} publishes no link bandwidth: only co-located engines are planned.")
    drafter = f", drafts from {args.draft_model}" if draft else ", model-free drafts"
    return options, notes, 512, 64, f"roofline of {args.model} on {hw.name} ({args.weight_bits:g}-bit weights{drafter})"


def _check_fits(cost: CostModel, plan: PlanInput) -> None:
    longest = max(c.prompt_tokens.hi + c.output_tokens.hi for c in plan.workload.classes)
    if longest > cost.kv_capacity_tokens:
        raise SimulationError(f"the longest request ({longest} tokens) needs more KV than a profiled worker holds "
                              f"({cost.kv_capacity_tokens}); profile with a larger --kv-cache-gib.")
