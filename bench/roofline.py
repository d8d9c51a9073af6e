"""Batch-1 decode against the memory roofline, per model and weight precision.

For each model and precision: the forward time of one token (batch 1, a 64-token context), the
weight bytes that forward reads, the bandwidth that implies and its fraction of the read
bandwidth measured in the same run; the cost of verifying n = 2, 3, 5, 9, 17, 33 tokens of one
request relative to one token (what speculation pays per step), beside the floor the CPU's int8
multiply-add peak puts under it (measured here: `int8_peak_gmacs`, u8 x s8 vpmaddubsw / vpdpbusd
throughput of all threads; a forward of n tokens needs n * MACs-per-token, so
T(n) >= max(T(1), n * MACs / peak)); and, where the engine accepts the precision for a target,
the full engine's decode step so the Python/scheduler overhead per step is visible.

Where the weights stay in their blocks (`auto`, `int4`), it also splits a forward's quantized
products (every matrix product of the n rows, LM head included) into what streaming them costs
and what computing them costs: `products_streamed_ms[n]` runs each product once, in forward
order, so the weights come from memory as in a forward; `products_hot_ms[n]` runs each product
several times in a row and keeps its fastest run, so its weights sit in cache and what remains is
the kernels' arithmetic and a call's fixed cost (a product larger than the last-level cache still
streams: there it is an upper bound). With memory traffic wholly hidden behind arithmetic, the
products of n tokens would cost max(streamed(1), hot(n)) (`products_overlap_floor_ratio`, as a
multiple of streamed(1)): where hot(n) exceeds streamed(1), only cheaper arithmetic flattens the
verify curve; below it, the gap between streamed(n) and that floor is memory traffic the kernels
fail to hide.

With `--contexts`, the verify curve is timed again with the request's context at each of those
lengths (`verify_cost_at_context`, a third panel): a draft row attends over the whole context, so
past a few thousand tokens a verify's attention, not its weights, sets what it costs.

    python bench/roofline.py
    python bench/roofline.py --models qwen2.5-coder-0.5b-instruct --precisions none int8
    python bench/roofline.py --models smollm2-135m-instruct --precisions auto --contexts 2048 8000

Writes bench/results/roofline.json and roofline.png.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RESULTS_DIR,
    machine_info,
    measure_read_bandwidth,
    product_calls,
    time_products,
    write_json,
)
from throughput import measure_decode

from specserve import LLM
from specserve.config import CacheConfig, ModelConfig, Quantization
from specserve.engine.runner import ModelRunner
from specserve.models.bundled import resolve_model
from specserve.models.loader import load_model_files

VERIFY_TOKENS = [1, 2, 3, 5, 9, 17, 33]
CONTEXT = 64


def forward_times(runner: ModelRunner, repeats: int, context: int = CONTEXT) -> dict[int, float]:
    """Seconds for one request appending n tokens after `context`, for each n: the best of
    `repeats` rounds in which the sizes take turns (two forwards each). A shared VM's memory speed
    moves by 20-30% within minutes; timing every repeat of one size before the next put whole sizes
    in different phases, and a ratio T(n) / T(1) then said as much about the phase as about n."""
    runner.time_decode_step(1, context=context)  # warm-up
    best = {n: float("inf") for n in VERIFY_TOKENS}
    for _ in range(repeats):
        for n in VERIFY_TOKENS:
            best[n] = min(best[n], runner.time_decode_step(1, tokens_per_req=n, repeats=2, context=context))
    return best


def macs_per_token(arch: object) -> float:
    """Multiply-adds of one token's forward through every projection and the LM head."""
    a = arch
    h, q, kv, inter = a.hidden_size, a.q_size, a.kv_size, a.intermediate_size
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter
    return float(a.num_layers * per_layer + h * a.vocab_size)


def product_times(model: object, repeats: int, hot_runs: int = 6) -> dict[str, dict[int, float]] | None:
    """Milliseconds of a forward's quantized products at each n, streamed and in cache, and the
    floor a perfect overlap of the two would give (see the module docstring); None where the
    model has no quantized products (a float precision)."""
    if not product_calls(model, 1):  # type: ignore[arg-type]
        return None
    streamed, hot = {}, {}
    for n in VERIFY_TOKENS:
        calls = product_calls(model, n)  # type: ignore[arg-type]
        streamed[n] = 1e3 * time_products(calls, repeats)
        # Each product alone: its untimed first run brings the weights in, the timed ones find them in cache.
        hot[n] = 1e3 * sum(time_products([call], hot_runs) for call in calls)
    floor = {n: max(streamed[1], hot[n]) / streamed[1] for n in VERIFY_TOKENS}
    return {"streamed_ms": streamed, "hot_ms": hot, "overlap_floor_ratio": floor}


def int8_peak_gmacs(seconds: float = 0.5) -> float:
    """u8 x s8 multiply-adds per second of all threads through the kernels' widest instruction
    (AVX2 vpmaddubsw: 32 per instruction; VNNI vpdpbusd likewise; 64 per 512-bit vpdpbusd where
    the multi-row passes run 512 bits wide), measured with a dense
    independent-chain loop (specserve.kernels.int8_peak)."""
    from specserve.kernels import kernels

    return kernels().int8_peak(seconds) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"])
    ap.add_argument("--precisions", nargs="+", default=["auto", "int4", "none"])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--skip-products", action="store_true",
                    help="skip timing the quantized products alone, streamed and cache-resident")
    ap.add_argument("--contexts", nargs="*", type=int, default=[],
                    help="also time the verify curve with the request's context at these lengths (tokens)")
    ap.add_argument("--out", default="roofline")
    args = ap.parse_args()
    if any(c < 1 for c in args.contexts):
        ap.error("--contexts: lengths of at least one token")
    longest = max(args.contexts, default=0) + max(VERIFY_TOKENS)

    bw = measure_read_bandwidth()
    peak = int8_peak_gmacs()
    print(f"measured read bandwidth: {bw / 1e9:.1f} GB/s; int8 multiply-add peak: {peak:.0f} GMAC/s", flush=True)
    rows = []
    for name in args.models:
        ckpt, ckpt_blocks = None, None
        for prec in args.precisions:
            # `auto` and `int4` start from the file's blocks, as the engine does (`auto` keeps
            # them, `int4` keeps the 4-bit ones and requantizes the rest); every other precision
            # starts from the float checkpoint. One in memory at a time.
            blocks = prec in ("auto", "int4")
            if blocks != ckpt_blocks:
                del ckpt
                gc.collect()
                ckpt_blocks = blocks
                ckpt = load_model_files(resolve_model(name), keep_blocks=blocks)
            gc.collect()
            cfg = ModelConfig(model=name, quantization=prec)
            packed = ckpt.packed if blocks else None
            # Room for the longest context asked for (and its tokens) in every layer's cache, at
            # up to 4 bytes a value (the cache's dtype is the runner's choice).
            kv_gib = max(0.25, 1.25 * ckpt.arch.kv_bytes_per_token(4) * longest / 2**30)
            runner = ModelRunner(ckpt.arch, ckpt.weights, cfg, CacheConfig(kv_cache_gib=kv_gib), max(1024, longest), packed=packed)
            # This VM's bandwidth drifts by tens of percent over minutes: probe again right
            # before each measurement and take the fraction against that.
            bw_here = measure_read_bandwidth(repeats=3)
            times = forward_times(runner, args.repeats)
            wbytes = runner.weight_bytes_per_step()
            kv = ckpt.arch.kv_bytes_per_token(runner.dtype.itemsize) * CONTEXT
            t1 = times[1]
            row = {
                "model": name, "precision": prec, "linear_backend": runner.linear_backend,
                "weight_bytes": wbytes, "bytes_per_step": wbytes + kv, "forward_ms": 1e3 * t1,
                "achieved_bandwidth_gbs": (wbytes + kv) / t1 / 1e9,
                "read_bandwidth_gbs_here": bw_here / 1e9,
                "roofline_fraction": (wbytes + kv) / t1 / bw_here,
                "roofline_tokens_per_s": bw_here / (wbytes + kv),
                "verify_cost_ratio": {n: times[n] / t1 for n in VERIFY_TOKENS},
                "macs_per_token": macs_per_token(ckpt.arch),
                "verify_floor_ratio": {n: max(1.0, n * macs_per_token(ckpt.arch) / (peak * 1e9) / t1) for n in VERIFY_TOKENS},
            }
            at_context = {c: forward_times(runner, args.repeats, c) for c in args.contexts}
            if at_context:
                row["forward_ms_at_context"] = {c: 1e3 * t[1] for c, t in at_context.items()}
                row["verify_cost_at_context"] = {c: {n: t[n] / t[1] for n in VERIFY_TOKENS} for c, t in at_context.items()}
            products = None if args.skip_products else product_times(runner.model, args.repeats)
            if products is not None:
                row.update({f"products_{key}": value for key, value in products.items()})
            del runner
            gc.collect()
            if not Quantization(prec).draft_only:
                llm = LLM(name, checkpoint=ckpt, quantization=prec, kv_cache_gib=0.5, spec_method="none")
                measure_decode(llm, 1, 4)  # warm-up
                # Best of three: one 32-token sample moved by this VM's memory drift alone (a SmolLM2
                # step read 5.9 ms once where back-to-back runs gave 3.6-4.4 ms).
                m = min((measure_decode(llm, 1, args.gen_tokens) for _ in range(3)), key=lambda r: r["step_ms"])
                row.update(engine_step_ms=m["step_ms"], engine_tokens_per_s=m["tokens_per_s"],
                           overhead_ms_per_step=m["step_ms"] - row["forward_ms"])
                del llm
            rows.append(row)
            ratios = " ".join(f"{n}:{r:.2f}" for n, r in row["verify_cost_ratio"].items())
            extra = (f" | engine {row['engine_step_ms']:.1f} ms/step (overhead {row['overhead_ms_per_step']:.1f} ms)"
                     if "engine_step_ms" in row else " | draft-only precision")
            print(f"{name:30s} {prec:5s}: forward {row['forward_ms']:7.1f} ms, {wbytes / 1e6:7.0f} MB, "
                  f"{row['achieved_bandwidth_gbs']:5.1f} GB/s = {100 * row['roofline_fraction']:.0f}% of {bw_here / 1e9:.1f} GB/s | "
                  f"verify cost n:{ratios}{extra}", flush=True)
            for c, ratio in row.get("verify_cost_at_context", {}).items():
                parts = " ".join(f"{n}:{r:.2f}" for n, r in ratio.items())
                print(f"{'':30s} {'':5s}  at a {c}-token context: forward {row['forward_ms_at_context'][c]:.1f} ms, "
                      f"verify cost n:{parts}", flush=True)
            if products is not None:
                parts = " ".join(f"{n}:{products['streamed_ms'][n]:.1f}/{products['hot_ms'][n]:.1f}" for n in VERIFY_TOKENS)
                print(f"{'':30s} {'':5s}  products ms streamed/in cache by n: {parts}", flush=True)
        del ckpt
    payload = {"benchmark": "batch-1 roofline", "machine": machine_info(), "read_bandwidth_gbs": bw / 1e9,
               "int8_peak_gmacs": peak,
               "settings": vars(args), "context_tokens": CONTEXT, "results": rows}
    path = write_json(f"{args.out}.json", payload)
    plot(payload, RESULTS_DIR / f"{args.out}.png")
    print(f"wrote {path}")
    return 0


def _short(model: str) -> str:
    """A model's name without the Qwen coder family's prefix and suffix, for plot labels."""
    return model.replace("qwen2.5-coder-", "").replace("-instruct", "")


def _curve(ax: Any, by_n: dict, style: str, **kw: Any) -> None:
    """One curve of values by token count n (JSON keys come back as strings)."""
    ys = {int(n): v for n, v in by_n.items()}
    ax.plot(sorted(ys), [ys[n] for n in sorted(ys)], style, **kw)


def _verify_axes(ax: Any, ylabel: str, title: str) -> None:
    """A verify-cost panel's frame: the linear (no reuse) line, log-log axes, labels, legend."""
    ax.plot(VERIFY_TOKENS, VERIFY_TOKENS, ":", color="gray", label="linear (no reuse)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("tokens verified in one forward (1 request)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)


def plot(payload: dict, path: Path) -> None:
    """Left: fraction of roofline per model/precision. Right: verify cost vs tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["results"]
    contexts = any("verify_cost_at_context" in r for r in rows)
    fig, axes = plt.subplots(1, 3 if contexts else 2, figsize=(19 if contexts else 13, 4.5))
    a0, a1 = axes[0], axes[1]
    labels = [f"{_short(r['model'])}\n{r['precision']}" for r in rows]
    a0.bar(range(len(rows)), [100 * r["roofline_fraction"] for r in rows], color="#4c72b0")
    for i, r in enumerate(rows):
        a0.annotate(f"{r['forward_ms']:.0f} ms\n{r['weight_bytes'] / 1e9:.2f} GB", (i, 100 * r["roofline_fraction"]),
                    ha="center", va="bottom", fontsize=7)
    a0.axhline(70, color="#c44e52", lw=0.8, ls="--", label="70% target")
    a0.set_xticks(range(len(rows)), labels, fontsize=8)
    a0.set_ylabel("% of measured read bandwidth (batch 1 forward)")
    a0.set_title("batch-1 decode vs memory roofline", fontsize=10)
    a0.legend(fontsize=8)
    for r in rows:
        _curve(a1, r["verify_cost_ratio"], "o-", label=f"{_short(r['model'])} {r['precision']}")
    for r in rows:
        if "products_overlap_floor_ratio" in r:
            _curve(a1, r["products_overlap_floor_ratio"], "x-.", alpha=0.7,
                   label=f"{_short(r['model'])} {r['precision']}: its products in cache (kernel arithmetic floor)")
    if rows and "verify_floor_ratio" in rows[0]:
        _curve(a1, rows[0]["verify_floor_ratio"], "--", color="#c44e52",
               label=f"int8 peak floor ({payload.get('int8_peak_gmacs', 0):.0f} GMAC/s), {_short(rows[0]['model'])}")
    _verify_axes(a1, "forward time / 1-token forward",
                 f"what a verify step costs ({payload.get('context_tokens', CONTEXT)}-token context)")
    if contexts:
        a2 = axes[2]
        for r in rows:
            t1 = r.get("forward_ms_at_context", {})
            for c, ratio in sorted(r.get("verify_cost_at_context", {}).items(), key=lambda item: int(item[0])):
                _curve(a2, ratio, "o-", label=f"{_short(r['model'])} {r['precision']}, {c} tokens (T(1) {t1[c]:.0f} ms)")
        _verify_axes(a2, "forward time / 1-token forward at that context", "a verify step after a long context")
    mi = payload["machine"]
    fig.suptitle(f"specserve roofline — {mi['cpu']}, {mi['torch_threads']} threads, "
                 f"{payload['read_bandwidth_gbs']:.1f} GB/s read at start (each bar vs a probe taken just before it), commit {mi['commit']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
