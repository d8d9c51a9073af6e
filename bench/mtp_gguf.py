"""A GGUF that ships a multi-token-prediction layer, on a real model: does `--spec-method mtp` draft
with it as with the module's own file?

Takes a bundled GGUF and an MTP module trained here (`specserve train-draft --method mtp`), writes
the GGUF again with the module where llama.cpp puts a model's MTP layer (the block after the
decoder's: blk.N.nextn.{eh_proj,enorm,hnorm,shared_head_norm} beside the block's own tensors,
block_count counting it, `<arch>.nextn_predict_layers` 1; the model's own tensors copied byte for
byte), then decodes held-out prompts greedily: plain, `--spec-method mtp` on the new file with no
--draft-model (the layer it ships), and on the original file with the module's file; every step
drafting, so that the drafts are the module's. Writes bench/results/mtp_gguf_<label>.json.

    specserve train-draft --method mtp --model smollm2-135m-instruct
    python bench/mtp_gguf.py --model smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine_info, write_json  # noqa: E402
from prompts import CODING, PROSE  # noqa: E402

from specserve import LLM, SamplingParams  # noqa: E402
from specserve.models.bundled import resolve_model  # noqa: E402
from specserve.testing import gguf_name, llama_cpp_permute  # noqa: E402


def module_file(model: str) -> Path:
    """The MTP module train-draft left in the cache for `model`."""
    from specserve.models.block_linear import embedding_rows
    from specserve.spec.eagle import FINGERPRINT_ROWS, default_head_path, target_fingerprints

    eng = LLM(model).engine
    tok = eng.tokenizer
    fp = target_fingerprints(eng.runner.arch, tok.fingerprint() if tok is not None else None,
                             embedding_rows(eng.runner.model.model.embed_tokens, FINGERPRINT_ROWS))
    path = default_head_path(fp[0], "mtp")
    if not path.is_file():
        sys.exit(f"no MTP module for {model} in the cache ({path}): run `specserve train-draft --method mtp --model {model}`")
    return path


def write_with_mtp(src: Path, module: Path, out: Path) -> dict:
    """`src` written again to `out` with the MTP module of `module` as its multi-token-prediction layer."""
    import gguf

    from specserve.spec.eagle import load_head_file, mtp_in_deepseek_names

    tensors, card = load_head_file(module, "mtp")
    tensors.pop("token_ids")
    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields["general.architecture"].contents())
    blocks = int(reader.fields[f"{arch}.block_count"].contents())
    heads = int(reader.fields[f"{arch}.attention.head_count"].contents())
    kv_heads = int(reader.fields[f"{arch}.attention.head_count_kv"].contents())
    writer = gguf.GGUFWriter(str(out), arch)
    for field in reader.fields.values():
        if field.name in ("general.architecture", f"{arch}.block_count") or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    writer.add_block_count(blocks + 1)
    writer.add_uint32(f"{arch}.nextn_predict_layers", 1)
    added = {}
    for name, t in mtp_in_deepseek_names(tensors).items():
        gname = gguf_name(f"model.layers.{blocks}.{name}")
        data = t.float().numpy()
        if arch == "llama" and gname.endswith(("attn_q.weight", "attn_k.weight")):
            data = llama_cpp_permute(data, heads if "attn_q" in gname else kv_heads)
        added[gname] = np.ascontiguousarray(data)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    for name, data in added.items():
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data)
    for data in added.values():
        writer.write_tensor_data(data)
    writer.close()
    return {"module": str(module), "module_card": {k: card.get(k) for k in ("tokens_seen", "heldout_accept_by_depth", "intermediate_size", "train_s")},
            "tensors_added": sorted(added), "bytes": out.stat().st_size, "source_bytes": src.stat().st_size}


def decode(llm: LLM, prompts: list[str], max_tokens: int) -> dict:
    """Each prompt alone (batch 1), greedy: outputs, tokens/s, and the drafting counters' change."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    llm.generate(prompts[0], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)  # warm-up
    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    before = {k: llm.engine.spec_counters[k] for k in keys}
    outputs, secs = [], 0.0
    for prompt in prompts:
        llm.engine.kv_manager.reset_prefix_cache()
        t0 = time.perf_counter()
        outputs.append(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
        secs += time.perf_counter() - t0
    d = {k: llm.engine.spec_counters[k] - before[k] for k in keys}
    return {"outputs": outputs, "tokens": sum(map(len, outputs)), "seconds": secs, **d,
            # each verify step emits its accepted drafts and one token of the target's own
            "tokens_per_forward": round((d["num_drafts"] + d["num_accepted_tokens"]) / d["num_drafts"], 3)
            if d["num_drafts"] else 1.0,
            "describe": llm.engine.describe().get("speculation")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--module", default=None, help="the MTP module file (default: the one train-draft left in the cache)")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per set (coding, prose)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--label", default="smollm2")
    args = ap.parse_args()

    src = Path(resolve_model(args.model))
    module = Path(args.module) if args.module else module_file(args.model)
    with tempfile.TemporaryDirectory(prefix="mtp-gguf-") as tmp:
        out = Path(tmp) / f"{src.stem}-mtp.gguf"
        t0 = time.perf_counter()
        written = write_with_mtp(src, module, out)
        written["write_s"] = round(time.perf_counter() - t0, 2)
        plain = LLM(str(out))
        tok = plain.engine.tokenizer
        sets = {"coding": CODING[: args.prompts], "prose": PROSE[: args.prompts]}
        prompts = {k: [tok.apply_chat_template([{"role": "user", "content": p}]) for p in v] for k, v in sets.items()}
        rows: dict[str, dict] = {}
        for name, make in (("plain", lambda: plain),
                           ("shipped layer", lambda: LLM(str(out), spec_method="mtp", spec_policy="always")),
                           ("module file", lambda: LLM(str(src), spec_method="mtp", draft_model=str(module),
                                                       spec_policy="always"))):
            llm = make()
            for kind, ps in prompts.items():
                rows[f"{name} / {kind}"] = decode(llm, ps, args.max_tokens)
            del llm
    base = {k: rows[f"plain / {k}"]["outputs"] for k in prompts}
    summary = {}
    for key, r in rows.items():
        name, kind = key.split(" / ")
        summary[key] = {"equal_to_plain": r["outputs"] == base[kind], "tok_s": round(r["tokens"] / r["seconds"], 1),
                        **{k: r[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "tokens_per_forward")},
                        "describe": r["describe"]}
        print(f"{key:28s} equal to plain {summary[key]['equal_to_plain']}  {summary[key]['tok_s']:6.1f} tok/s  "
              f"{r['tokens_per_forward']:.2f} tokens per forward  drafted {r['num_draft_tokens']}")
    path = write_json(f"mtp_gguf_{args.label}.json", {"benchmark": "a GGUF shipping an MTP layer vs the module's file",
                                                       "machine": machine_info(), "model": args.model, "written": written,
                                                       "max_tokens": args.max_tokens, "rows": summary})
    plot(summary, path.with_suffix(".png"), f"{args.model}: an MTP layer shipped in the GGUF vs the module's file")
    print(f"wrote {path} and {path.with_suffix('.png').name}")
    return 0


def plot(summary: dict, path: Path, title: str) -> None:
    """Tokens per forward and tok/s of each row, by prompt set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(k.split(" / ")[0] for k in summary))
    kinds = list(dict.fromkeys(k.split(" / ")[1] for k in summary))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, key, label in ((axes[0], "tokens_per_forward", "tokens per target forward"), (axes[1], "tok_s", "decode tok/s")):
        for i, name in enumerate(names):
            vals = [summary[f"{name} / {k}"][key] for k in kinds]
            bars = ax.bar([j + i * 0.27 for j in range(len(kinds))], vals, 0.27, label=name)
            ax.bar_label(bars, fmt="%.2f" if key == "tokens_per_forward" else "%.0f", fontsize=8)
        ax.set_xticks([j + 0.27 for j in range(len(kinds))], kinds)
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8, loc="lower right")
    fig.suptitle(title + " (batch 1, greedy, every step drafting; every output equal to plain)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
