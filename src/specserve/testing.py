"""Tiny random models, head files and prompts for tests and device checks (bench/device_check.py).

Nothing here is on a serving path. Building a tiny model needs `transformers` (a test extra).
"""

from __future__ import annotations

import atexit
import random
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn


def tiny_hf_model(arch: str = "llama", seed: int = 0, vocab: int = 256, layers: int = 2) -> Any:
    """A tiny random HF causal LM: "llama" (untied), "qwen2" (q/k/v biases) or any other name for a
    llama with tied embeddings (SmolLM2-style)."""
    import transformers

    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, initializer_range=0.15, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    if arch == "llama":
        cfg = transformers.LlamaConfig(rope_theta=10000.0, **common)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(rope_theta=1000000.0, **common)
        cls = transformers.Qwen2ForCausalLM
    else:
        common["tie_word_embeddings"] = True
        cfg = transformers.LlamaConfig(rope_theta=100000.0, **common)
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    return cls(cfg).float().eval()


def scratch_dir(prefix: str) -> Path:
    """A new temporary directory, removed (with what is in it) when the process exits.

    Checkpoints read their files lazily, so the directory must outlive everything loaded from it;
    before this, every test session left its tiny models and head files behind in /tmp (about 40
    directories, 27 MB, a run)."""
    d = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    return Path(d)


def tiny_checkpoint(arch: str = "llama", seed: int = 0, vocab: int = 256, layers: int = 2,
                    tmp_dir: str | Path | None = None) -> tuple[Any, Any]:
    """(hf_model, LoadedCheckpoint) for a tiny random model, loaded through our HF-dir loader."""
    from specserve.models.loader import load_model_files

    hf = tiny_hf_model(arch, seed, vocab, layers)
    d = tmp_dir or scratch_dir(f"tiny-{arch}-")
    hf.save_pretrained(d, safe_serialization=True)
    return hf, load_model_files(Path(d))


def repetitive_prompts(n: int = 24, seed: int = 3, vocab: int = 64) -> list[list[int]]:
    """Token prompts that repeat with variations: the same tail is followed by different tokens in
    different places, which is what makes prompt lookup draft and branch."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [[rng.randint(3, vocab - 1) for _ in range(rng.randint(2, 4))] for _ in range(4)]
        seq: list[int] = []
        for _ in range(rng.randint(6, 14)):
            seq += rng.choice(words) + [rng.choice([5, 6, 7])]
        out.append(seq)
    return out


def write_random_head(ckpt: Any, path: str | Path, method: str = "eagle", seed: int = 0, **card: object) -> Path:
    """A randomly initialised EAGLE, MTP or Medusa (3 heads) head file for the checkpoint `ckpt`
    (its fingerprint, every id)."""
    from specserve.spec.eagle import EagleHead, MTPModule, head_arch, save_head, target_fingerprint
    from specserve.spec.medusa import MedusaHeads

    arch = ckpt.arch
    torch.manual_seed(seed)
    if method == "medusa":
        head: nn.Module = MedusaHeads(arch.hidden_size, 3)
        for p in head.parameters():
            nn.init.normal_(p, std=0.2)
    elif method == "mtp":
        head = MTPModule(head_arch(arch))
    else:
        head = EagleHead(head_arch(arch), card.get("feature_layers", ()))
        if head.feature_layers:  # a fusion that reads every layer it is given
            nn.init.normal_(head.fuse.weight, std=0.05)
    tok = ckpt.tokenizer
    fp = target_fingerprint(arch, tok.fingerprint() if tok is not None else None, ckpt.weights["model.embed_tokens.weight"])
    meta = {"method": method, "target": fp, "target_name": "tiny", "intermediate_size": arch.intermediate_size,
            "num_heads": 3, **card}
    save_head(path, head, torch.arange(arch.vocab_size), meta)
    return Path(path)


def gguf_name(hf_name: str) -> str:
    """A tensor's name in a GGUF as llama.cpp's converter writes it, from its HF name (a DeepSeek-V3
    MTP layer's own tensors as blk.N.nextn.*): the loader's tables read backwards."""
    from specserve.models.loader import GGUF_BLOCK_NAMES, GGUF_GLOBAL_NAMES, GGUF_NEXTN_NAMES

    glob = {hf: g for g, hf in GGUF_GLOBAL_NAMES.items()}
    if hf_name in glob:
        return glob[hf_name]
    block = {hf: g for g, hf in GGUF_BLOCK_NAMES.items()} | {hf: "nextn." + g for g, hf in GGUF_NEXTN_NAMES.items()}
    _, _, layer, *rest = hf_name.split(".")
    return f"blk.{layer}.{block['.'.join(rest[:-1])]}.{rest[-1]}"


def _byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet in byte order: printable bytes as themselves, the others
    shifted past 255."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(shifted)) for b in range(256)]


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The row reordering llama.cpp's converter applies to Llama q/k (the loader undoes it)."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf_model(path: str | Path, arch: str, hf_weights: dict[str, torch.Tensor], cfg: dict, *,
                     mtp: dict[str, torch.Tensor] | None = None, nextn_key: bool = True, byte_vocab: bool = False,
                     extra: Any = ()) -> Path:
    """A llama / qwen2 GGUF as llama.cpp's converter writes it, from HF-named float tensors; cfg:
    layers, hidden, ffn, heads, kv_heads. mtp: a multi-token-prediction module in DeepSeek-V3's
    names (eh_proj, enorm, hnorm, shared_head.norm, the block's self_attn / mlp / norms), written as
    the block after the decoder's (blk.N.nextn.* beside the block's own tensors, block_count
    counting it, `<arch>.nextn_predict_layers` 1 unless nextn_key is False). byte_vocab: a
    byte-level BPE tokenizer of 256 ids (bytes 0-254 and "ab"; ids 1 / 2 BOS / EOS), so that an
    engine can load the file by path. extra: (name, array) tensors written as they are."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_block_count(cfg["layers"] + (mtp is not None))
    if mtp is not None and nextn_key:
        writer.add_uint32(f"{arch}.nextn_predict_layers", 1)
    writer.add_context_length(256)
    writer.add_embedding_length(cfg["hidden"])
    writer.add_feed_forward_length(cfg["ffn"])
    writer.add_head_count(cfg["heads"])
    writer.add_head_count_kv(cfg["kv_heads"])
    writer.add_rope_freq_base(5000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    if byte_vocab:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list([*_byte_chars()[:255], "ab"])  # (a GGUF needs one merge)
        writer.add_token_types([1] * 256)
        writer.add_token_merges(["a b"])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
    tensors = dict(hf_weights)
    tensors.update({f"model.layers.{cfg['layers']}.{k}": v for k, v in (mtp or {}).items()})
    for name, tensor in tensors.items():
        gname = gguf_name(name)
        data = tensor.detach().float().numpy()
        if arch == "llama" and gname.endswith(("attn_q.weight", "attn_k.weight")):
            data = llama_cpp_permute(data, cfg["heads"] if "attn_q" in gname else cfg["kv_heads"])
        writer.add_tensor(gname, np.ascontiguousarray(data))
    for gname, data in extra:
        writer.add_tensor(gname, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


class _PlainMemmapNumpy:
    """Stand-in for the numpy module inside gguf's reader whose memmap returns a plain ndarray.

    GGUFReader slices its memmap once per metadata string; for a 150k-token vocabulary that is
    millions of memmap-subclass slices whose Python-level ``__array_finalize__`` dominates the
    load time. A base-class view of the same mapping behaves identically and parses ~2x faster.
    """

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)

    @staticmethod
    def memmap(*args: Any, **kwargs: Any) -> np.ndarray:
        return np.memmap(*args, **kwargs).view(np.ndarray)


_READER_PATCH_LOCK = threading.Lock()


@contextmanager
def plain_memmap() -> Iterator[None]:
    """gguf-py's reader made ~2x faster while the block runs, for tests that load a GGUF with
    transformers (which parses it with gguf-py); specserve reads GGUF with its own parser."""
    import gguf.gguf_reader

    module = gguf.gguf_reader
    if getattr(module, "np", None) is not np:  # a gguf release that reads files differently
        yield
        return
    with _READER_PATCH_LOCK:
        module.np = _PlainMemmapNumpy()  # type: ignore[assignment]
        try:
            yield
        finally:
            module.np = np
