"""The engine's own work around the forward: decode tokens/s on a model whose forward is nearly free.

A random 4-layer Llama (hidden 64) with SmolLM2's vocabulary (49,152 ids) costs almost nothing to
run, on a GPU above all, so its tokens/s measure what the engine does per step besides the
model: scheduling, sampling, the request-level features (logprobs, top logprobs, penalties),
speculation's host work and the outputs. Cases:

  plain b1..b64     greedy decoding at batch 1, 8, 32, 64
  features b1, b32  greedy with logprobs, top-3 logprobs, repetition and presence penalties
  ngram b1          n-gram speculation forced on (random text: few accepts; its cost alone)
  sampled top_p b32 seeded T=1, top_p=0.95 (wide nuclei), and whether a seeded request gives the
                    same tokens run after run (of 32) and alone as batched (of 4)

    python bench/host_step.py --device cuda --label head
    PYTHONPATH=<older checkout>/src python bench/host_step.py --device cuda --label base

Run two source trees in turn on one machine to compare them (timings of a shared host vary by
tens of percent between runs). Writes host_step_<device>_<label>.json under --out;
`--plot A.json B.json ... --png FILE` draws their tokens/s side by side.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, machine_info  # noqa: E402

from specserve import LLM, SamplingParams  # noqa: E402
from specserve.testing import repetitive_prompts, tiny_checkpoint  # noqa: E402

VOCAB = 49152


def rate(llm: LLM, prompts: list, params: list, repeats: int = 3) -> float:
    """Best generated tokens/s of `repeats` runs of the prompts together."""
    best = 0.0
    for _ in range(repeats):
        llm.engine.kv_manager.reset_prefix_cache()
        llm.engine.reset_suffix_cache()  # earlier runs' outputs would draft this one's
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = max(best, sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
    return round(best, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--label", default="head", help="names this source tree in the output")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    ap.add_argument("--plot", type=Path, nargs="+", help="result files to draw instead of running")
    ap.add_argument("--png", type=Path, default=RESULTS_DIR / "host_step.png")
    args = ap.parse_args()
    if args.plot:
        plot(args.plot, args.png)
        return
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    ckpt = tiny_checkpoint("smol", seed=5, vocab=VOCAB, layers=4)[1]
    kw = dict(device=args.device, dtype=dtype, checkpoint=ckpt, profile_spec_costs=False, max_num_seqs=64)
    res: dict = {"benchmark": "host_step", "label": args.label, "machine": machine_info(), "results": {}}
    out = res["results"]

    def note(name: str, value: object) -> None:
        out[name] = value
        print(f"{args.label} {name}: {value}", flush=True)

    greedy = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    plain = LLM("tiny", spec_method="none", **kw)
    for b in (1, 8, 32, 64):
        note(f"plain b{b}", rate(plain, repetitive_prompts(b, vocab=VOCAB), [greedy] * b))
    features = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=3,
                              repetition_penalty=1.1, presence_penalty=0.3)
    for b in (1, 32):
        note(f"features b{b}", rate(plain, repetitive_prompts(b, vocab=VOCAB), [features] * b))
    prompts = repetitive_prompts(32, vocab=VOCAB)
    seeded = [SamplingParams(max_tokens=32, temperature=1.0, top_p=0.95, seed=i, ignore_eos=True) for i in range(32)]
    note("sampled top_p b32", rate(plain, prompts, seeded, repeats=2))
    first = plain.generate(prompts, seeded, use_tqdm=False)
    again = plain.generate(prompts, seeded, use_tqdm=False)
    note("sampled top_p reproducible of 32", sum(a.token_ids == b.token_ids for a, b in zip(first, again)))
    alone = [plain.generate([prompts[i]], [seeded[i]], use_tqdm=False)[0] for i in range(4)]
    note("sampled top_p alone == batched of 4", sum(a.token_ids == first[i].token_ids for i, a in enumerate(alone)))
    del plain
    ngram = LLM("tiny", spec_method="ngram", spec_policy="always", **kw)
    note("ngram b1", rate(ngram, repetitive_prompts(1, vocab=VOCAB), [greedy]))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"host_step_{args.device.split(':')[0]}_{args.label}.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")


def plot(files: list[Path], png: Path) -> None:
    """Grouped bars: each case's tokens/s, one bar per result file (its label and commit)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads(f.read_text()) for f in files]
    cases = [k for k, v in runs[0]["results"].items() if isinstance(v, float)]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(runs)
    for i, r in enumerate(runs):
        ax.bar([c + i * width for c in range(len(cases))], [r["results"].get(k, 0) for k in cases], width,
               label=f"{r['label']} ({r['machine'].get('commit', '?')})")
    ax.set_xticks([c + width * (len(runs) - 1) / 2 for c in range(len(cases))], cases, rotation=20)
    ax.set_ylabel("generated tokens/s")
    m = runs[0]["machine"]
    ax.set_title(f"Engine work per step (random 4-layer model, 49k vocabulary), {m.get('gpu') or m.get('cpu')}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
