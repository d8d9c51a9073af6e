"""How fast could copying make these prompts? The ceiling of model-free proposers, on this machine.

Prompt lookup, inference with reference and SuffixDecoding draft what followed an earlier
occurrence of the context's tail. How much they can buy depends on the text (how much of the
answer is a copy of something before it) and on the machine (what verifying n tokens costs,
T(n)). This takes the target's own greedy answers to a prompt set and replays them through
oracle copiers that know the answer, each step drafting exactly the run of tokens its
source gets right (at most --k), so that nothing is ever rejected:

- `latest`: the continuation of the latest occurrence of the longest matching tail (n <= 4
  tokens), prompt lookup's chain;
- `all occurrences`: the best continuation over every occurrence of that tail (a tree holding
  them all, pruned by an oracle);
- `any match`: the best continuation over every occurrence of every tail length 1-4.

A step that drafts d tokens, all right, yields d + 1 and costs T(d + 1); T(n) is measured here
(one request, n new tokens, best of --repeats, sizes interleaved). Drafting the whole run the
source gets right is not always best where T(n) rises steeply past a knee, so the ceiling is the
cheapest way through the answer: at each position the oracle may draft any d up to the run its
source gets right there (a shortest path over the answer's positions). The ceiling speedup over
plain decoding is tokens * T(1) / that cost: no drafting time, no step overhead, no rejected
node. A real copier's measured speedup (bench/spec.py --sections trees) lies below its ceiling; a
target above the ceiling is out of reach for copying on these prompts and this machine.

    python bench/copy_ceiling.py                      # edit and coding prompts, Qwen2.5-Coder 1.5B
    python bench/copy_ceiling.py --sets edit --k 8 --prompts 8

Writes bench/results/copy_ceiling.json and copy_ceiling.png.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, machine_info, write_json  # noqa: E402
from prompts import CODING, EDIT, PROSE  # noqa: E402

from specserve import LLM, SamplingParams  # noqa: E402
from specserve.spec.suffix import suffix_matches  # noqa: E402

ORACLES = ("latest", "all occurrences", "any match")
MAX_TAIL = 4  # the longest tail the copiers match (NgramProposer's default ngram_max)
CONTEXT = 256  # tokens of context under the T(n) measurement (about an edit prompt's)


def run_length(ctx: Sequence[int], start: int, answer: Sequence[int], k: int) -> int:
    """Tokens copied from ctx[start:] that equal the answer's next ones (at most k)."""
    a = 0
    while a < k and start + a < len(ctx) and a < len(answer) and ctx[start + a] == answer[a]:
        a += 1
    return a


def accepted(ctx: Sequence[int], answer: Sequence[int], k: int, oracle: str) -> int:
    """Tokens the oracle copier's draft gets right at this step."""
    if oracle != "any match":  # the longest matching tail, as prompt lookup finds it
        _, starts = suffix_matches(ctx, ctx, 1, MAX_TAIL, exclude_tail=True)
        starts = starts[-1:] if oracle == "latest" else starts
        return max((run_length(ctx, int(s), answer, k) for s in starts), default=0)
    runs = (run_length(ctx, int(s), answer, k) for n in range(1, MAX_TAIL + 1)
            for s in suffix_matches(ctx, ctx, n, n, exclude_tail=True)[1])
    return max(runs, default=0)


def runs(prompt_ids: Sequence[int], answer: Sequence[int], k: int, oracle: str) -> list[int]:
    """At each position of the answer, the run of tokens the oracle copier's source gets right."""
    text = list(prompt_ids) + list(answer)
    return [accepted(text[: len(prompt_ids) + i], answer[i:], k, oracle) for i in range(len(answer))]


def cheapest_steps(run: Sequence[int], costs: dict[int, float]) -> list[int]:
    """Draft lengths of the cheapest way through an answer whose position i allows drafts of up to
    run[i] right tokens (a step drafting d moves d + 1 positions and costs T(d + 1))."""
    n = len(run)
    best = [0.0] * (n + 1)
    choice = [0] * n
    for i in range(n - 1, -1, -1):
        options = [(costs[d + 1] + best[i + d + 1], d) for d in range(min(run[i], n - 1 - i) + 1)]
        best[i], choice[i] = min(options)
    steps, i = [], 0
    while i < n:
        steps.append(choice[i])
        i += choice[i] + 1
    return steps


def step_costs(llm: LLM, k: int, repeats: int) -> dict[int, float]:
    """T(n) for n = 1..k+1: one request, n new tokens, best of `repeats` rounds over all sizes."""
    runner = llm.engine.runner
    sizes = list(range(1, k + 2))
    runner.time_decode_step(1, context=CONTEXT)  # warm-up
    best = {n: float("inf") for n in sizes}
    for _ in range(repeats):  # sizes interleaved: a memory phase moves every size alike
        for n in sizes:
            best[n] = min(best[n], runner.time_decode_step(1, tokens_per_req=n, repeats=1, context=CONTEXT))
    return best


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(dict.fromkeys(r["prompt_set"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    width = 0.8 / len(ORACLES)
    for ax, key, label in ((axes[0], "tokens_per_step", "tokens per step"),
                           (axes[1], "ceiling_speedup", "ceiling speedup over plain")):
        for j, oracle in enumerate(ORACLES):
            vals = [next(r[key] for r in rows if r["prompt_set"] == s and r["oracle"] == oracle) for s in sets]
            ax.bar([i + j * width for i in range(len(sets))], vals, width, label=oracle)
        ax.set_xticks([i + width * (len(ORACLES) - 1) / 2 for i in range(len(sets))], sets)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[1].axhline(1.0, color="black", lw=0.8)
    axes[0].legend(title="oracle copier", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--sets", nargs="+", default=["edit", "coding"], choices=["edit", "coding", "prose"])
    ap.add_argument("--prompts", type=int, default=4, help="prompts per set (bench/spec.py's default: 4)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=16, help="most tokens a draft may hold")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="copy_ceiling")
    args = ap.parse_args()
    if not 1 <= args.k <= 32:
        ap.error("--k must be in [1, 32]")

    llm = LLM(args.target, quantization="auto", spec_method="none", kv_cache_gib=0.5)
    costs = step_costs(llm, args.k, args.repeats)
    t1 = costs[1]
    print(f"T(1) {1e3 * t1:.1f} ms; T(n)/T(1): " + " ".join(f"{n}:{t / t1:.2f}" for n, t in costs.items()), flush=True)
    tok = llm.get_tokenizer()
    pools = {"edit": [p for p, _ in EDIT], "coding": CODING, "prose": PROSE}
    rows = []
    for set_name in args.sets:
        answers = []
        for text in pools[set_name][: args.prompts]:
            prompt = tok.apply_chat_template([{"role": "user", "content": text}])
            out = llm.generate(prompt, SamplingParams(max_tokens=args.max_tokens, temperature=0), use_tqdm=False)[0]
            answers.append((list(out.prompt_token_ids), list(out.outputs[0].token_ids)))
        for oracle in ORACLES:
            per_prompt = [cheapest_steps(runs(p, a, args.k, oracle), costs) for p, a in answers]
            steps = [s for prompt_steps in per_prompt for s in prompt_steps]
            tokens = sum(a + 1 for a in steps)
            cost = sum(costs[a + 1] for a in steps)
            row = {
                "prompt_set": set_name, "oracle": oracle, "k": args.k, "prompts": len(answers),
                "tokens": tokens, "steps": len(steps), "tokens_per_step": tokens / len(steps),
                "ceiling_speedup": tokens * t1 / cost,
                "steps_per_prompt": [len(s) for s in per_prompt],
                "drafted_histogram": {a: steps.count(a) for a in sorted(set(steps))},
            }
            rows.append(row)
            print(f"{set_name:7s} {oracle:16s}: {row['tokens_per_step']:.2f} tokens/step, ceiling "
                  f"{row['ceiling_speedup']:.2f}x plain (steps per prompt {row['steps_per_prompt']})", flush=True)
    payload = {"benchmark": "copy ceiling", "machine": machine_info(), "settings": vars(args),
               "step_costs_s": costs, "rows": rows}
    path = write_json(f"{args.out}.json", payload)
    m = payload["machine"]
    plot(rows, RESULTS_DIR / f"{args.out}.png",
         f"{args.target}: oracle copiers, K <= {args.k}, greedy answers of {args.max_tokens} tokens\n"
         f"{m.get('cpu', '?')} {m.get('cpu_family_model_stepping', '')}, commit {m.get('commit', '?')}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
