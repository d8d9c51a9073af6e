"""The verify-cost curve through the machine's memory phases, and how the policy's StepTimer follows it.

A shared VM's memory bandwidth moves between phases within minutes. This script times one
request appending n tokens (T(n), a 64-token context) for each --tokens size, back to back with
a read-bandwidth probe, for --minutes, and then replays the samples through the speculation
policy's cost model: a StepTimer calibrated on the first --reference samples (medians) that sees
only one-token steps afterwards (a run of decode steps at whatever phase the machine is in), its
prediction of every other size against what was measured in the same sample; beside it, one
factor for the whole curve (the StepTimer before 2026-11-30).

    python bench/phases.py                       # Qwen 1.5B auto, 10 minutes
    python bench/phases.py --model smollm2-135m-instruct --minutes 3

Writes bench/results/phases.json and phases.png (--out NAME).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, machine_info, measure_read_bandwidth, write_json  # noqa: E402

from specserve.config import CacheConfig, ModelConfig  # noqa: E402
from specserve.engine.runner import ModelRunner  # noqa: E402
from specserve.models.bundled import resolve_model  # noqa: E402
from specserve.models.loader import load_model_files  # noqa: E402
from specserve.progress import bar  # noqa: E402
from specserve.spec.policy import StepTimer  # noqa: E402

CONTEXT = 64
DECODE_STEPS = 50  # one-token steps the replayed timer sees per sample (it settles well within)


def sample(runner: ModelRunner, sizes: list[int], repeats: int) -> dict[str, float]:
    """One probe of the read bandwidth and T(n) for every size (ms), at one moment."""
    out = {"bandwidth_gbs": measure_read_bandwidth(gib=0.5, repeats=2) / 1e9}
    for n in sizes:
        out[str(n)] = 1e3 * runner.time_decode_step(1, tokens_per_req=n, repeats=repeats, context=CONTEXT)
    return out


def replay(samples: list[dict[str, float]], sizes: list[int], reference: int) -> dict[str, dict[str, float]]:
    """Median |predicted / measured - 1| per size over the samples after the reference ones: the
    StepTimer fed one-token steps only, and one factor for the whole curve."""
    ref = {n: statistics.median(s[str(n)] for s in samples[:reference]) for n in sizes}
    timer = StepTimer(ref)
    errors: dict[str, dict[int, list[float]]] = {"step_timer": {n: [] for n in sizes}, "one_factor": {n: [] for n in sizes}}
    one = sizes[0]
    for s in samples[reference:]:
        for _ in range(DECODE_STEPS):
            timer.observe_scaled(one, s[str(one)])
        for n in sizes:
            errors["step_timer"][n].append(abs(timer(n) / s[str(n)] - 1))
            errors["one_factor"][n].append(abs(ref[n] * s[str(one)] / ref[one] / s[str(n)] - 1))
    return {model: {str(n): statistics.median(e) for n, e in by_n.items() if e} for model, by_n in errors.items()}


def plot(payload: dict, path: Path) -> None:
    """Left: T(n) against T(1), one colour per size. Right: T(1) and the read bandwidth over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples, sizes = payload["samples"], payload["settings"]["tokens"]
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(13, 4.8))
    ones = [s[str(sizes[0])] for s in samples]
    for n in sizes[1:]:
        a0.scatter(ones, [s[str(n)] for s in samples], s=6, label=f"T({n})")
    lo, hi = min(ones), max(ones)
    a0.plot([lo, hi], [lo, hi], "k-", lw=0.8, label="T(1)")
    a0.set_xlabel(f"T({sizes[0]}) in the same sample (ms)")
    a0.set_ylabel("T(n) (ms)")
    err = payload["replay"]
    a0.set_title("median |error| after the reference: " + ", ".join(
        f"T({n}) {100 * err['step_timer'][str(n)]:.0f}% vs {100 * err['one_factor'][str(n)]:.0f}%" for n in sizes[1:]),
        fontsize=8)
    a0.legend(fontsize=8)
    t = [s["t_s"] for s in samples]
    a1.plot(t, ones, ".", ms=3, label=f"T({sizes[0]}) ms")
    a2 = a1.twinx()
    a2.plot(t, [s["bandwidth_gbs"] for s in samples], ".", ms=3, color="#c44e52", label="read GB/s")
    a1.set_xlabel("seconds")
    a1.set_ylabel("ms")
    a2.set_ylabel("GB/s")
    a1.legend(loc="upper left", fontsize=8)
    a2.legend(loc="upper right", fontsize=8)
    mi = payload["machine"]
    fig.suptitle(f"{payload['settings']['model']} {payload['settings']['quantization']} on {mi.get('cpu')}, commit "
                 f"{mi.get('commit')}: left, the policy's StepTimer vs one factor for the curve", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 5, 9, 17])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=3, help="forwards per T(n) in a sample (the best is kept)")
    ap.add_argument("--reference", type=int, default=5, help="first samples the replayed timer is calibrated on")
    ap.add_argument("--out", default="phases")
    args = ap.parse_args()
    sizes = sorted(set(args.tokens))
    if sizes[0] != 1 or len(sizes) < 2 or args.minutes <= 0 or args.repeats < 1 or args.reference < 1:
        ap.error("--tokens must include 1 and another size; --minutes, --repeats and --reference must be positive.")

    ckpt = load_model_files(resolve_model(args.model), keep_blocks=True)
    runner = ModelRunner(ckpt.arch, ckpt.weights, ModelConfig(model=args.model, quantization=args.quantization),
                         CacheConfig(kv_cache_gib=0.25), 1024, packed=ckpt.packed)
    for _ in range(3):  # warm-up: the first samples after loading ran 30-40% slow at every size (page faults)
        sample(runner, sizes, args.repeats)
    samples: list[dict[str, float]] = []
    t0 = time.perf_counter()
    end = t0 + 60 * args.minutes
    progress = bar(iter(lambda: time.perf_counter() < end, False), desc="sampling T(n) through memory phases",
                   unit="sample")
    for _ in progress:
        samples.append({"t_s": time.perf_counter() - t0, **sample(runner, sizes, args.repeats)})
    if len(samples) <= args.reference:
        raise SystemExit(f"only {len(samples)} samples in {args.minutes} minutes: give more --minutes.")
    payload = {"benchmark": "verify cost through memory phases", "machine": machine_info(),
               "settings": {"model": args.model, "quantization": args.quantization, "tokens": sizes,
                            "context": CONTEXT, "repeats": args.repeats, "reference": args.reference,
                            "decode_steps_per_sample": DECODE_STEPS},
               "replay": replay(samples, sizes, args.reference), "samples": samples}
    write_json(f"{args.out}.json", payload)
    plot(payload, RESULTS_DIR / f"{args.out}.png")
    for model, errs in payload["replay"].items():
        print(f"{model:>10}: median |error| " + ", ".join(f"T({n}) {100 * e:.1f}%" for n, e in errs.items()))
    print(f"wrote {RESULTS_DIR / args.out}.json and .png ({len(samples)} samples)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
