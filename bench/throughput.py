"""Decode throughput by batch size, prompt (prefill) tokens/s, and batch-1 decode against the
roofline; llama.cpp's batch-1 decode and prompt rates on the same GGUF in the same run.

Decode is memory-bound: one step reads every weight once (plus the KV of the context), so the
best batch-1 rate on a machine is  bandwidth / bytes_read_per_step.  The bandwidth is measured
in the same run (a full read of a 1 GiB tensor with the same thread count), so the fraction
compares like with like.

    python bench/throughput.py                       # Qwen2.5-Coder-1.5B (its default precision: auto)
    python bench/throughput.py --models smollm2-135m-instruct --batches 1 8 --no-llamacpp

Writes bench/results/throughput.json and throughput.png.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, machine_info, measure_read_bandwidth, write_json

from specserve import LLM, SamplingParams

BASE_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain how a hash map works in a few sentences.",
    "def quicksort(arr):",
    "The three most important ideas in distributed systems are",
    "Translate to French: The weather is nice today.",
    "SELECT name, COUNT(*) FROM orders GROUP BY",
    "Once upon a time there was a small robot who",
    "import torch\nimport torch.nn as nn\n\nclass MLP(nn.Module):",
]


def measure_decode(llm: LLM, batch: int, gen_tokens: int, temperature: float = 0.0, top_p: float = 1.0) -> dict:
    """Run `batch` requests to completion; time only the steps after every prefill is done
    (greedy by default; a temperature > 0 samples, seeded per request, with top_p)."""
    eng = llm.engine
    params = SamplingParams(max_tokens=gen_tokens, temperature=temperature, top_p=top_p, ignore_eos=True,
                            seed=0 if temperature > 0 else None)
    prompts = [BASE_PROMPTS[i % len(BASE_PROMPTS)] + f" (variant {i})" for i in range(batch)]
    ids = [eng.add_request(p, params) for p in prompts]
    started: set[str] = set()
    while len(started) < batch:
        for out in eng.step():
            started.add(out.request_id)
    n_tokens = 0
    n_steps = 0
    ctx = 0
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        outs = eng.step()
        n_steps += 1
        for out in outs:
            n_tokens += len(out.outputs[0].delta_token_ids)
            ctx = max(ctx, len(out.prompt_token_ids) + len(out.token_ids))
    elapsed = time.perf_counter() - t0
    assert not set(ids) & {r.request_id for r in eng.scheduler.running}
    return {
        "batch": batch,
        "decode_tokens": n_tokens,
        "decode_steps": n_steps,
        "elapsed_s": elapsed,
        "tokens_per_s": n_tokens / elapsed,
        "step_ms": 1e3 * elapsed / max(n_steps, 1),
        "max_context": ctx,
    }


def prompt_ids(tokenizer: object, n: int) -> list[int]:
    """n tokens of real text (specserve's own source), the same for every engine."""
    src = Path(__file__).resolve().parents[1] / "src" / "specserve"
    text = "".join(p.read_text() for p in sorted(src.rglob("*.py")))
    ids = tokenizer.encode(text)  # type: ignore[attr-defined]
    return ids[:n]


def measure_prefill(llm: LLM, ids: list[int]) -> dict:
    """Prompt tokens per second: one prompt, timed to its first token (chunked prefill)."""
    eng = llm.engine
    eng.kv_manager.reset_prefix_cache()
    eng.reset_suffix_cache()  # earlier runs' outputs would draft this one's
    llm.generate([ids[:32]], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)  # warm-up
    eng.kv_manager.reset_prefix_cache()
    eng.reset_suffix_cache()  # earlier runs' outputs would draft this one's
    t0 = time.perf_counter()
    llm.generate([ids], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    dt = time.perf_counter() - t0
    return {"prompt_tokens": len(ids), "prefill_s": dt, "prompt_tokens_per_s": len(ids) / dt}


def llamacpp_rates(path: Path, ids: list[int], gen_tokens: int, threads: int) -> dict | None:
    """llama.cpp (llama-cpp-python) on the same file: prompt tokens/s and batch-1 decode tok/s."""
    try:
        from llama_cpp import Llama
    except ImportError:
        print("llama-cpp-python is not installed: no llama.cpp rows (pip install llama-cpp-python)")
        return None
    llm = Llama(model_path=str(path), n_ctx=4096, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)
    llm.eval(ids[:32])
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    prefill = time.perf_counter() - t0
    llm.reset()
    llm.eval(ids[:64])
    t0 = time.perf_counter()
    for _ in range(gen_tokens):
        tok = llm.sample(top_k=1, temp=0.0)
        llm.eval([tok])
    decode = time.perf_counter() - t0
    del llm
    return {"prompt_tokens": len(ids), "prompt_tokens_per_s": len(ids) / prefill, "decode_tokens_per_s": gen_tokens / decode}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen2.5-coder-1.5b-instruct"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 16, 32, 48])
    ap.add_argument("--gen-tokens", type=int, default=48)
    ap.add_argument("--prompt-tokens", type=int, default=2048, help="prompt length for the prefill rate")
    ap.add_argument("--no-llamacpp", action="store_true", help="skip llama.cpp's rows")
    ap.add_argument("--quantization", default=None, help="default: the engine's (auto for a GGUF on the CPU)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=0.0, help="decode rows: 0 greedy (default), else sampled")
    ap.add_argument("--top-p", type=float, default=1.0, help="decode rows' top_p when sampling (e.g. 0.9, as chat clients send)")
    ap.add_argument("--out", default="throughput")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    bw = measure_read_bandwidth(device=args.device)
    print(f"measured read bandwidth: {bw / 1e9:.1f} GB/s")
    results, prefill, peer = [], [], []
    for name in args.models:
        t0 = time.perf_counter()
        llm = LLM(name, dtype=args.dtype, device=args.device, kv_cache_gib=1.0, max_num_seqs=max(args.batches),
                  quantization=args.quantization)
        load_s = time.perf_counter() - t0
        ids = prompt_ids(llm.engine.tokenizer, args.prompt_tokens)
        pr = measure_prefill(llm, ids)
        pr.update(model=name, quantization=llm.engine.config.model.quantization)
        prefill.append(pr)
        print(f"{name:30} prefill {pr['prompt_tokens']} tokens: {pr['prompt_tokens_per_s']:.1f} tok/s")
        arch = llm.engine.arch
        wbytes = llm.engine.runner.weight_bytes_per_step()
        kv_tok = arch.kv_bytes_per_token(llm.engine.runner.dtype.itemsize)
        measure_decode(llm, 1, 4)  # warm-up
        for b in args.batches:
            r = measure_decode(llm, b, args.gen_tokens, args.temperature, args.top_p)
            # Bytes per step: weights once + KV of every sequence's context (mean over the run).
            mean_ctx = r["max_context"] - args.gen_tokens / 2
            step_bytes = wbytes + b * mean_ctx * kv_tok
            r.update(
                model=name, dtype=str(llm.engine.runner.dtype).replace("torch.", ""),
                quantization=llm.engine.config.model.quantization,
                linear_backend=llm.engine.runner.linear_backend,
                weight_bytes=wbytes, bytes_per_step=step_bytes,
                achieved_bandwidth_gbs=step_bytes / (r["step_ms"] / 1e3) / 1e9,
                roofline_tokens_per_s=b * bw / step_bytes,
            )
            r["roofline_fraction"] = r["tokens_per_s"] / r["roofline_tokens_per_s"]
            r["load_s"] = load_s
            results.append(r)
            print(
                f"{name:30} batch {b:3d}: {r['tokens_per_s']:7.1f} tok/s  step {r['step_ms']:7.1f} ms  "
                f"roofline {r['roofline_tokens_per_s']:7.1f} tok/s  ({100 * r['roofline_fraction']:.0f}%)"
            )
        del llm
        if not args.no_llamacpp and args.device == "cpu":
            from specserve.models.bundled import resolve_model

            lc = llamacpp_rates(resolve_model(name), ids, args.gen_tokens, torch.get_num_threads())
            if lc is not None:
                lc["model"] = name
                peer.append(lc)
                print(f"{name:30} llama.cpp: prefill {lc['prompt_tokens_per_s']:.1f} tok/s, "
                      f"decode {lc['decode_tokens_per_s']:.1f} tok/s (batch 1)")
    payload = {
        "benchmark": "decode throughput",
        "machine": machine_info(),
        "read_bandwidth_gbs": bw / 1e9,
        "settings": vars(args),
        "results": results,
        "prefill": prefill,
        "llamacpp": peer,
    }
    path = write_json(f"{args.out}.json", payload)
    plot(payload, RESULTS_DIR / f"{args.out}.png")
    print(f"wrote {path}")
    return 0


def plot(payload: dict, path: Path) -> None:
    """Bars of tokens/s per batch size per model; batch-1 roofline marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = payload["results"]
    models = list(dict.fromkeys(r["model"] for r in results))
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.2), squeeze=False)
    for ax, m in zip(axes[0], models):
        rows = [r for r in results if r["model"] == m]
        xs = [str(r["batch"]) for r in rows]
        ax.bar(xs, [r["tokens_per_s"] for r in rows], color="#4c72b0", label="measured")
        ax.scatter(xs, [r["roofline_tokens_per_s"] for r in rows], color="#c44e52", marker="_", s=900,
                   label="memory roofline", zorder=3)
        for x, r in zip(xs, rows):
            ax.annotate(f"{r['tokens_per_s']:.1f}\n({100 * r['roofline_fraction']:.0f}%)", (x, r["tokens_per_s"]),
                        ha="center", va="bottom", fontsize=8)
        ax.set_title(f"{m} ({rows[0].get('quantization', rows[0]['dtype'])})", fontsize=10)
        pre = next((p for p in payload.get("prefill", []) if p["model"] == m), None)
        lc = next((p for p in payload.get("llamacpp", []) if p["model"] == m), None)
        note = []
        if pre:
            note.append(f"prompt: {pre['prompt_tokens_per_s']:.0f} tok/s")
        if lc:
            note.append(f"llama.cpp: prompt {lc['prompt_tokens_per_s']:.0f}, decode {lc['decode_tokens_per_s']:.1f} tok/s")
        if note:
            ax.text(0.98, 0.02, "\n".join(note), transform=ax.transAxes, ha="right", va="bottom", fontsize=8)
        ax.set_xlabel("batch size")
        ax.set_ylabel("decode tokens/s")
        ax.set_yscale("log")
        ax.legend(fontsize=8, loc="upper left")
    mi = payload["machine"]
    fig.suptitle(f"specserve decode throughput — {mi['cpu']}, {mi['torch_threads']} threads, "
                 f"{payload['read_bandwidth_gbs']:.1f} GB/s read, commit {mi['commit']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
