"""Earlier requests' outputs as a draft source (`--suffix-cache-requests`, spec/served.py).

Batch 1, per prompt and interleaved on one engine (so the machine's drift hits every mode alike):

  plain     no speculation
  cold      speculation with an empty store (what a fresh server, or --suffix-cache-requests 0, does)
  warm      the store holds a server's earlier answers to other asks (the model's greedy answers
            to `specserve build-corpus`'s generic asks when that file is in the cache, else the
            answers to --warm-prompts other prompts of the bench, served first)
  repeat    the same ask again (a retry or a regenerate): the store also holds this prompt's own
            earlier answer; greedy, and at T=0.7 with another seed than the stored answer's

Every greedy output is compared with plain decoding's.

    python bench/suffix.py                                   # Qwen2.5-Coder 1.5B, ngram and lookahead
    python bench/suffix.py --target smollm2-135m-instruct --methods ngram

Writes bench/results/suffix.json and suffix.png.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, machine_info, write_json  # noqa: E402
from prompts import CODING, EDIT, PROSE  # noqa: E402

from specserve import LLM, SamplingParams  # noqa: E402
from specserve.models.bundled import resolve_model  # noqa: E402
from specserve.spec.corpus import self_text_path  # noqa: E402
from specserve.spec.served import ServedOutputs  # noqa: E402

MODES = ("plain", "cold", "warm", "repeat")


def log(msg: str) -> None:
    print(msg, flush=True)


def stores(proposer: object) -> list[ServedOutputs]:
    """The served-output stores inside a proposer (a hybrid's copiers included)."""
    found, todo, seen = [], [proposer], set()
    while todo:
        p = todo.pop()
        if p is None or id(p) in seen:
            continue
        seen.add(id(p))
        d = vars(p) if hasattr(p, "__dict__") else {}
        if isinstance(d.get("served"), ServedOutputs):
            found.append(d["served"])
        todo += [d.get("copier"), d.get("drafter"), *d.get("copiers", [])]
    return found


def fill(llm: LLM, outputs: list[list[int]]) -> None:
    """Make every store of the engine's proposer hold exactly these outputs."""
    for s in stores(llm.engine.proposer):
        s.clear()
        for toks in outputs:
            s.add(toks)


def warm_outputs(llm: LLM, args: argparse.Namespace) -> tuple[str, list[list[int]]]:
    """A server's earlier answers: build-corpus's file cut into answer-sized pieces, or the
    answers to other prompts of the bench."""
    path = self_text_path(resolve_model(args.target))
    if path.is_file() and not args.warm_prompts:
        ids = llm.get_tokenizer().encode(path.read_text(encoding="utf-8"), add_special_tokens=False)
        return f"build-corpus answers ({len(ids)} tokens)", [ids[i : i + 256] for i in range(0, len(ids), 256)]
    n = args.warm_prompts or 4
    asks = CODING[4 : 4 + n] + PROSE[4 : 4 + n]
    llm.engine.set_speculation(False)
    outs = llm.chat([[{"role": "user", "content": a}] for a in asks],
                    SamplingParams(max_tokens=args.max_tokens, temperature=0), use_tqdm=False)
    return f"answers to {len(asks)} other bench prompts", [o.outputs[0].token_ids for o in outs]


def run_method(method: str, args: argparse.Namespace) -> list[dict]:
    kw: dict[str, Any] = {}
    if "+" in method:
        method, kw["spec_copy"] = method.split("+", 1)
    llm = LLM(args.target, quantization=args.quantization, kv_cache_gib=1.0, spec_method=method,
              draft_model=args.draft if method == "draft" else None, max_num_seqs=8, **kw)
    eng = llm.engine
    what, warm = warm_outputs(llm, args)
    log(f"{method}: store warmed with {what}: {len(warm)} outputs")
    tok = llm.get_tokenizer()
    sets = {"coding": CODING[: args.prompts], "prose": PROSE[: args.prompts],
            "edit": [p for p, _ in EDIT[: args.prompts]]}
    rows = []
    for set_name in args.sets:
        acc = {m: {"gen": 0, "t": 0.0, "steps": 0, "same": 0} for m in (*MODES, "plain_t07", "cold_t07", "repeat_t07")}
        for ask in sets[set_name]:
            prompt = tok.apply_chat_template([{"role": "user", "content": ask}])
            greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0)
            plain_ids: list[int] = []  # greedy plain decoding's answer (also the repeat's stored one)
            sampled_ids: list[int] = []  # plain decoding's T=0.7 sample (seed 2)
            for mode, params, store, spec in [
                ("plain", greedy, [], False),
                ("cold", greedy, [], True),
                ("warm", greedy, warm, True),
                ("repeat", greedy, None, True),  # None: warm + this prompt's greedy answer (set below)
                # A regenerate: another sample of the same ask, the store holding the first one's.
                ("plain_t07", SamplingParams(max_tokens=args.max_tokens, temperature=0.7, seed=2), [], False),
                ("cold_t07", SamplingParams(max_tokens=args.max_tokens, temperature=0.7, seed=2), [], True),
                ("repeat_t07", SamplingParams(max_tokens=args.max_tokens, temperature=0.7, seed=2), "t07", True),
            ]:
                if store is None:
                    store = [*warm, plain_ids]
                elif store == "t07":  # the first sample (seed 1) of the same ask
                    fill(llm, [])
                    eng.set_speculation(False)
                    s1 = llm.generate(prompt, SamplingParams(max_tokens=args.max_tokens, temperature=0.7, seed=1),
                                      use_tqdm=False)[0].outputs[0].token_ids
                    store = [*warm, s1]
                eng.set_speculation(spec)
                eng.kv_manager.reset_prefix_cache()
                fill(llm, store)
                out = llm.generate(prompt, params, use_tqdm=False)[0]
                m, a = out.metrics, acc[mode]
                ids = out.outputs[0].token_ids
                a["gen"] += m.num_generated_tokens - 1
                a["t"] += m.e2e_s - m.ttft_s
                a["steps"] += m.extra["num_target_steps"] - 1
                if mode == "plain":
                    plain_ids = ids
                elif mode == "plain_t07":
                    sampled_ids = ids
                # Seeded sampling with one-hot drafts gives plain sampling's tokens; a model
                # drafter's sampled drafts give another draw of the same distribution.
                a["same"] += ids == (plain_ids if mode in MODES else sampled_ids)
                a["compared"] = mode in MODES or eng.proposer.traits.cost == "flat"
        for mode, a in acc.items():
            rows.append({"method": method + ("+" + kw["spec_copy"] if "spec_copy" in kw else ""), "prompt_set": set_name,
                         "mode": mode, "decode_tokens_per_s": a["gen"] / a["t"], "tokens_per_step": a["gen"] / max(a["steps"], 1),
                         "outputs_equal_to_plain": f"{a['same']}/{len(sets[set_name])}" if a.get("compared", True)
                         else "n/a (sampled drafts of a model)", "warm_store": what})
        for r in rows[-len(acc):]:
            base = next(x for x in rows[-len(acc):] if x["mode"] == ("plain_t07" if r["mode"].endswith("t07") else "plain"))
            r["speedup_vs_plain"] = r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
            log(f"{r['method']:12s} {set_name:6s} {r['mode']:10s} {r['decode_tokens_per_s']:7.2f} tok/s x{r['speedup_vs_plain']:.2f} "
                f"{r['tokens_per_step']:.2f} tokens/step, equal to plain {r['outputs_equal_to_plain']}")
    del llm
    return rows


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["method"], r["prompt_set"]) for r in rows))
    modes = ["cold", "warm", "repeat", "cold_t07", "repeat_t07"]
    colors = ["#999999", "#4c72b0", "#55a868", "#c9c9c9", "#8fbf8f"]
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(groups)), 5))
    w = 0.8 / len(modes)
    for j, (mode, c) in enumerate(zip(modes, colors)):
        vals = [next((r["speedup_vs_plain"] for r in rows if (r["method"], r["prompt_set"]) == g and r["mode"] == mode), 0)
                for g in groups]
        xs = [i + (j - (len(modes) - 1) / 2) * w for i in range(len(groups))]
        ax.bar(xs, vals, width=w, color=c, label=mode.replace("_t07", " (T=0.7)"))
        for x, v in zip(xs, vals):
            ax.annotate(f"{v:.2f}", (x, v), ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(groups)), [f"{m}\n{s}" for m, s in groups], fontsize=8)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_ylabel("decode speedup vs plain (batch 1)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct", help="for --methods draft+ngram")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--methods", nargs="+", default=["ngram", "lookahead"])
    ap.add_argument("--sets", nargs="+", default=["coding", "prose", "edit"], choices=["coding", "prose", "edit"])
    ap.add_argument("--prompts", type=int, default=4, help="prompts per set")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--warm-prompts", type=int, default=0,
                    help="warm the store with the answers to this many other coding and prose prompts "
                         "(default: build-corpus's answers when present, else 4)")
    ap.add_argument("--out", default="suffix")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = [r for m in args.methods for r in run_method(m, args)]
    payload = {"benchmark": "earlier requests' outputs as a draft source", "machine": machine_info(),
               "settings": vars(args), "rows": rows, "seconds": time.perf_counter() - t0}
    write_json(f"{args.out}.json", payload)
    plot(rows, RESULTS_DIR / f"{args.out}.png", f"{args.target}, batch 1: speculation with an empty / warm store / "
         f"a repeated ask ({payload['machine'].get('cpu', '')})")
    log(f"wrote {RESULTS_DIR / args.out}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
