"""Where a batch-1 decode step's time goes: native kernels, the rest of the forward, the engine.

Runs the engine on one request (greedy, ignore_eos) and times, per decode step:
  - engine step: everything `LLMEngine.step()` does (scheduling, input preparation, forward,
    sampling, detokenization, output bookkeeping);
  - forward: the model's forward + LM head (ModelRunner.last_forward_time_s);
  - linear kernels: the quantized matrix products alone, timed by replaying the same step's
    products (same shapes, same weights) back to back without Python in between.
The gaps are the overheads: forward - kernels is the per-layer Python/torch glue, engine step -
forward is the scheduler/sampler/detokenizer. Where the model runs through the one-call native
DecoderStack, decode steps alternate between it and the layer-by-layer module path, so the two
are compared side by side (module_path_forward_ms, stack_speedup).

With --flame it also records a py-spy flame graph of the decode loop (py-spy must be installed;
`--native` frames show the C++ kernels).

    python bench/profile_decode.py                       # Qwen2.5-Coder-1.5B, --quantization auto
    python bench/profile_decode.py --quantization none --flame

Writes bench/results/profile_decode.json (and decode_flame_<quantization>.svg with --flame).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, machine_info, product_calls, time_products, write_json  # noqa: E402

PROMPT = "Write a Python function that parses an ISO 8601 date string and returns a datetime."


def linear_kernel_time(model, repeats: int = 20) -> tuple[float, int]:
    """Seconds for one batch-1 pass over every quantized product of the model, and their count."""
    calls = product_calls(model, 1)
    return time_products(calls, repeats, warmup=3), len(calls)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--module-path", action="store_true",
                    help="run the decoder layer by layer through the nn.Modules instead of the one-call native stack")
    ap.add_argument("--flame", action="store_true", help="record a py-spy flame graph of the decode loop")
    ap.add_argument("--_flame-child", dest="flame_child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.flame and not args.flame_child:
        exe = shutil.which("py-spy")
        if exe is None:
            print("py-spy is not installed (pip install py-spy)", file=sys.stderr)
            return 1
        svg = RESULTS_DIR / f"decode_flame_{args.quantization}.svg"
        cmd = [exe, "record", "--native", "--rate", "200", "-o", str(svg), "--", sys.executable, __file__,
               "--model", args.model, "--quantization", args.quantization, "--tokens", str(args.tokens),
               "--_flame-child"] + (["--module-path"] if args.module_path else [])
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, env=os.environ | {"SPECSERVE_PROFILE_CHILD": "1"})
        print(f"wrote {svg}")
        return 0

    from specserve import LLM, SamplingParams

    llm = LLM(args.model, quantization=args.quantization, spec_method="none", kv_cache_gib=0.5)
    eng = llm.engine
    runner = eng.runner
    if args.module_path:
        runner.model.model.native_stack = None
    llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)  # warm-up
    eng.add_request(PROMPT, SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True))
    eng.step()  # prefill
    # With the one-call native stack, alternate it with the module path step by step (the two are
    # bit-identical, so the token stream is the same): this VM's speed drifts over minutes, and
    # only measurements taken side by side compare.
    stack = runner.model.model.native_stack
    steps, fwd, mod_steps, mod_fwd = [], [], [], []
    i = 0
    while eng.has_unfinished_requests():
        use_stack = stack is None or args.flame_child or i % 2 == 0
        runner.model.model.native_stack = stack if use_stack else None
        t0 = time.perf_counter()
        eng.step()
        (steps if use_stack else mod_steps).append(time.perf_counter() - t0)
        (fwd if use_stack else mod_fwd).append(runner.last_forward_time_s)
        i += 1
    runner.model.model.native_stack = stack
    if args.flame_child:
        return 0
    kern, n_calls = linear_kernel_time(runner.model) if args.quantization in ("auto", "int4") else (float("nan"), 0)
    steps.sort()
    fwd.sort()
    med = lambda v: v[len(v) // 2]  # noqa: E731
    row = {
        "model": args.model, "quantization": args.quantization, "native_stack": runner.model.model.native_stack is not None,
        "decode_steps": len(steps),
        "engine_step_ms": 1e3 * med(steps), "forward_ms": 1e3 * med(fwd),
        "linear_kernels_ms": 1e3 * kern, "linear_kernel_calls": n_calls,
        "weight_bytes_per_step": runner.weight_bytes_per_step(),
    }
    if mod_fwd:
        mod_steps.sort()
        mod_fwd.sort()
        row.update(module_path_engine_step_ms=1e3 * med(mod_steps), module_path_forward_ms=1e3 * med(mod_fwd))
        row["stack_speedup"] = row["module_path_forward_ms"] / row["forward_ms"]
    row["glue_ms"] = row["forward_ms"] - row["linear_kernels_ms"]
    row["engine_overhead_ms"] = row["engine_step_ms"] - row["forward_ms"]
    row["kernel_bandwidth_gbs"] = row["weight_bytes_per_step"] / kern / 1e9
    for k, v in row.items():
        print(f"{k:24s} {v:.2f}" if isinstance(v, float) else f"{k:24s} {v}")
    path = RESULTS_DIR / "profile_decode.json"
    old = {}
    if path.exists():
        import json

        old = {f"{r['model']}|{r['quantization']}|{r.get('native_stack', False)}": r for r in json.loads(path.read_text()).get("results", [])}
    old[f"{args.model}|{args.quantization}|{row['native_stack']}"] = row
    write_json("profile_decode.json", {"benchmark": "decode step breakdown (batch 1)", "machine": machine_info(),
                                       "results": list(old.values())})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
