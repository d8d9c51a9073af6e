"""specserve vs llama.cpp on the same GGUF files, same prompts, same cores, greedy, in one run.

llama.cpp runs through the `llama-cpp-python` package (built from source by pip, so it uses
this CPU's own instruction set) on the Q4_K_M file as is; specserve loads the same file,
either computing from its blocks as stored (`auto`) or decoded to float32 / int8. Batch 1, each
prompt alone. Decode rate = (tokens - 1) / (time from the first token to the last), so prompt
processing is excluded for both.

Rows: llama.cpp plain and with its prompt-lookup decoding; specserve configurations named
`<precision>[-ngram|-draft]`: precision fp32 | int8 | int4 | auto, then no speculation, prompt
lookup (n-gram, 8 tokens) or the Qwen2.5-Coder-0.5B draft (its own GGUF blocks under `auto`,
W8A8 otherwise).

    pip install llama-cpp-python   # builds llama.cpp from source (~10 min on 2 cores)
    python bench/llamacpp.py [--prompts 3] [--max-tokens 96] [--draft-vocab 65536]

On a Xeon with AMX, llama.cpp's native build also compiles its AMX path, which on the 2-vCPU
VM we measured on returned empty text and crashed once torch was loaded in the same process;
there llama.cpp was built with AMX off and AVX-512/VNNI on (the JSON records its feature line):
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
      -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON \
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF" pip install llama-cpp-python

Writes bench/results/llamacpp.json and llamacpp.png.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, machine_info, write_json  # noqa: E402
from prompts import CODING, EDIT  # noqa: E402

from specserve import LLM, SamplingParams  # noqa: E402
from specserve.models.bundled import resolve_model  # noqa: E402
from specserve.models.loader import load_model_files  # noqa: E402
from specserve.spec.factory import default_draft_quantization  # noqa: E402


def log(msg: str) -> None:
    print(msg, flush=True)


def prompt_sets(tokenizer: Any, n: int) -> dict[str, list[str]]:
    """Chat-templated coding and edit prompts (the same text goes to both engines)."""
    chat = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in CODING[:n]]
    edit = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p, _ in EDIT[:n]]
    return {"coding": chat, "edit": edit}


def run_llamacpp(path: Path, sets: dict[str, list[str]], max_tokens: int, threads: int,
                 lookup: bool) -> list[dict[str, Any]]:
    """llama.cpp decode rates per prompt set (streaming, first-token-to-last timing)."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    extra = {"draft_model": LlamaPromptLookupDecoding(num_pred_tokens=8)} if lookup else {}
    llm = Llama(model_path=str(path), n_ctx=4096, n_threads=threads, n_threads_batch=threads,
                verbose=False, **extra)
    llm.create_completion("hello", max_tokens=4, temperature=0.0)  # warm-up
    rows = []
    for name, prompts in sets.items():
        gen, decode_s, texts = 0, 0.0, []
        for prompt in prompts:
            llm.reset()
            first = last = None
            n = 0
            text = ""
            for chunk in llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0, top_k=1,
                                               stream=True):
                now = time.perf_counter()
                first = first or now
                last = now
                n += 1
                text += chunk["choices"][0]["text"]
            gen += n
            decode_s += (last - first) if first and last else 0.0
            texts.append(text)
        rows.append({"engine": "llama.cpp", "config": "prompt lookup (8)" if lookup else "plain",
                     "weights": "Q4_K_M (as stored)", "prompt_set": name, "generated_chunks": gen,
                     "decode_tokens_per_s": (gen - len(prompts)) / decode_s if decode_s else None, "texts": texts})
        log(f"llama.cpp {'lookup' if lookup else 'plain':6s} {name:6s}: {rows[-1]['decode_tokens_per_s']:.2f} tok/s")
    del llm
    gc.collect()
    return rows


class Checkpoints:
    """Loads each checkpoint once, in the form a configuration needs (float or the file's blocks)."""

    def __init__(self) -> None:
        self.cache: dict[tuple[str, bool], Any] = {}

    def get(self, name: str, blocks: bool) -> Any:
        if (name, blocks) not in self.cache:
            self.cache[(name, blocks)] = load_model_files(resolve_model(name), keep_blocks=blocks)
        return self.cache[(name, blocks)]


def run_specserve(ckpts: Checkpoints, sets: dict[str, list[str]], max_tokens: int, config: str,
                  threads: int, draft_vocab: int | None, draft_quant: str | None = None,
                  draft_k: int = 4, draft_p_min: float | None = None) -> list[dict[str, Any]]:
    """specserve decode rates per prompt set for one configuration."""
    precision, _, spec = config.partition("-")
    quant = {"fp32": "none"}.get(precision, precision)
    blocks = quant == "auto"
    target = ckpts.get("qwen2.5-coder-1.5b-instruct", blocks)
    kw: dict[str, Any] = {"quantization": quant}
    if spec == "draft":
        dq = default_draft_quantization(draft_quant, quant) if blocks else (draft_quant or "w8a8")
        kw.update(spec_method="draft", draft_checkpoint=ckpts.get("qwen2.5-coder-0.5b-instruct", dq in ("auto", "int4")),
                  draft_model="qwen2.5-coder-0.5b-instruct", draft_quantization=dq, draft_vocab_size=draft_vocab,
                  num_spec_tokens=draft_k)
        if draft_p_min is not None:
            kw["draft_p_min"] = draft_p_min
    elif spec == "ngram":
        kw.update(spec_method="ngram", num_spec_tokens=8)
    gc.collect()
    llm = LLM("qwen2.5-coder-1.5b-instruct", dtype="float32", checkpoint=target, kv_cache_gib=1.0,
              num_threads=threads, max_num_batched_tokens=1024, **kw)
    llm.generate(sets["coding"][0], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    rows = []
    for name, prompts in sets.items():
        gen, decode_s, texts, acc, drafted = 0, 0.0, [], 0, 0
        for prompt in prompts:
            llm.engine.kv_manager.reset_prefix_cache()
            llm.engine.reset_suffix_cache()  # earlier runs' outputs would draft this one's
            out = llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)[0]
            m = out.metrics
            gen += m.num_generated_tokens
            decode_s += m.e2e_s - m.ttft_s
            texts.append(out.outputs[0].text)
            acc += m.extra.get("num_accepted_tokens", 0)
            drafted += m.extra.get("num_draft_tokens", 0)
        rows.append({"engine": "specserve", "config": config, "weights": quant, "prompt_set": name,
                     "draft_weights": kw.get("draft_quantization"), "draft_vocab_size": kw.get("draft_vocab_size"),
                     "num_spec_tokens": kw.get("num_spec_tokens"),
                     "draft_p_min": llm.engine.config.spec.draft_p_min if spec == "draft" else None,
                     "generated_tokens": gen, "decode_tokens_per_s": (gen - len(prompts)) / decode_s,
                     "acceptance_rate": acc / drafted if drafted else None, "texts": texts})
        log(f"specserve {config:11s} {name:6s}: {rows[-1]['decode_tokens_per_s']:.2f} tok/s")
    del llm
    gc.collect()
    return rows


def _common_prefix_chars(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Ratios against llama.cpp's plain decoding of the same prompt set."""
    base = {r["prompt_set"]: r for r in rows if r["engine"] == "llama.cpp" and r["config"] == "plain"}
    for r in rows:
        b = base.get(r["prompt_set"])
        r["vs_llamacpp_plain"] = r["decode_tokens_per_s"] / b["decode_tokens_per_s"] if b else None
        if b and r is not b:
            # llama.cpp's arithmetic vs specserve's (other rounding): how long the greedy texts agree.
            r["chars_equal_to_llamacpp_plain"] = [_common_prefix_chars(x, y) for x, y in zip(r["texts"], b["texts"])]
    best_plain = max((r["vs_llamacpp_plain"] for r in rows
                      if r["engine"] == "specserve" and "-" not in r["config"]), default=None)
    best_spec_coding = max((r["vs_llamacpp_plain"] for r in rows if r["engine"] == "specserve"
                            and r["prompt_set"] == "coding" and r["config"].endswith(("draft", "ngram"))), default=None)
    return {"best_specserve_plain_vs_llamacpp_plain": best_plain,
            "best_specserve_spec_vs_llamacpp_plain_coding": best_spec_coding,
            "targets": {"plain >= 1.0x": bool(best_plain and best_plain >= 1.0),
                        "speculation on coding >= 2.0x": bool(best_spec_coding and best_spec_coding >= 2.0)}}


def plot(payload: dict[str, Any], path: Path) -> None:
    """Grouped bars: decode tok/s per configuration, coding vs edit prompts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["rows"]

    def label(r: dict[str, Any]) -> str:
        if not r.get("draft_weights"):
            return f"{r['engine']}\n{r['config']}"
        vocab = f", vocab {r['draft_vocab_size']}" if r.get("draft_vocab_size") else ""
        return f"{r['engine']}\n{r['config']}\n(draft {r['draft_weights']}{vocab}, K<={r['num_spec_tokens']})"

    labels = list(dict.fromkeys(label(r) for r in rows))
    fig, ax = plt.subplots(figsize=(11, 4.8))
    width = 0.38
    for j, name in enumerate(("coding", "edit")):
        vals = []
        for lab in labels:
            hit = [r for r in rows if label(r) == lab and r["prompt_set"] == name]
            vals.append(hit[0]["decode_tokens_per_s"] if hit else 0.0)
        xs = [i + (j - 0.5) * width for i in range(len(labels))]
        bars = ax.bar(xs, vals, width, label=f"{name} prompts")
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("decode tokens/s (batch 1, greedy)")
    m = payload["machine"]
    ax.set_title(f"Qwen2.5-Coder-1.5B Q4_K_M GGUF: specserve vs llama.cpp — {m['cpu']}, "
                 f"{m['logical_cpus']} threads, {m['commit']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--specserve-configs", nargs="+", default=["fp32", "auto", "auto-ngram", "auto-draft"])
    ap.add_argument("--draft-vocab", type=int, default=None, help="restrict the draft's LM head to this many tokens")
    ap.add_argument("--draft-k", type=int, default=4, help="most tokens the draft proposes per step")
    ap.add_argument("--draft-p-min", type=float, default=None,
                    help="the draft stops after a token it gives p below this (default: the engine's)")
    ap.add_argument("--draft-quantization", default=None,
                    help="the draft's weights (default: the engine's, int4, under auto; w8a8 otherwise)")
    args = ap.parse_args()
    tpath = resolve_model("qwen2.5-coder-1.5b-instruct")
    ckpts = Checkpoints()
    any_float = any(not c.startswith("auto") for c in args.specserve_configs)
    sets = prompt_sets(ckpts.get("qwen2.5-coder-1.5b-instruct", blocks=not any_float).tokenizer, args.prompts)
    rows = run_llamacpp(tpath, sets, args.max_tokens, args.threads, lookup=False)
    rows += run_llamacpp(tpath, sets, args.max_tokens, args.threads, lookup=True)
    for config in args.specserve_configs:
        rows += run_specserve(ckpts, sets, args.max_tokens, config, args.threads, args.draft_vocab,
                              args.draft_quantization, args.draft_k, args.draft_p_min)
    import llama_cpp

    payload = {
        "machine": machine_info(),
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp_system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
        "settings": vars(args) | {"model": str(tpath.name), "file_bytes": tpath.stat().st_size},
        "rows": rows,
        "summary": summarize(rows),
    }
    out = write_json("llamacpp.json", payload)
    plot(payload, RESULTS_DIR / "llamacpp.png")
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
