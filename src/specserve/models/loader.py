"""Read a checkpoint (a GGUF file or a HF directory of safetensors) into float32 HF-named tensors.

Whatever the source, the result uses HF's Llama/Qwen2 parameter names and layouts, so the model
code has a single weight format to understand.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, NamedTuple

import torch

from specserve.errors import (
    CorruptModelError,
    ModelNotFoundError,
    SpecServeError,
    UnsupportedModelError,
)
from specserve.models.arch import ArchConfig
from specserve.models.block_linear import EMBEDDING, PackedWeight, kernel_can_read, packed_from_gguf
from specserve.models.gguf_file import GGUFFile
from specserve.models.gguf_quants import _one_thread_per_op, dequantize_many
from specserve.models.tokenizer import Tokenizer
from specserve.progress import spinner

__all__ = [
    "LoadedCheckpoint",
    "arch_from_gguf",
    "arch_from_hf_config",
    "expected_shapes",
    "load_gguf",
    "load_hf_dir",
    "load_model_files",
    "open_gguf",
]

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
# Source architecture names accepted for each of our architecture keys. Mistral checkpoints are
# plain Llama networks (their sliding window only matters past 4k tokens, and is refused below).
_ARCH_ALIASES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
_HF_CLASSES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}


class LoadedCheckpoint(NamedTuple):
    """Everything read from a checkpoint: shape, float32 weights by HF name, tokenizer, origin.

    `packed` holds linear weights and the embedding table kept in their GGUF blocks (load with
    keep_blocks=True; a tied head shares the table's); those names are absent from `weights`.
    """

    arch: ArchConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None
    source: str  # the file or directory the checkpoint was read from
    packed: dict[str, PackedWeight] = {}  # noqa: RUF012 - never mutated; NamedTuple default
    mtp_layers: int = 0  # multi-token-prediction layers the file ships beside the network (not loaded)


# --- entry point ---------------------------------------------------------------------------------


def load_model_files(
    path: str | os.PathLike[str], *, load_tokenizer: bool = True, keep_blocks: bool = False
) -> LoadedCheckpoint:
    """Load a GGUF file or a HF model directory (config.json + *.safetensors).

    keep_blocks: leave GGUF linear weights the native kernel can read in their block format
    (LoadedCheckpoint.packed) instead of decoding them to float32.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelNotFoundError(
            f"{p} does not exist; pass the path of a GGUF file, a HF model directory, or a "
            "bundled model name."
        )
    if p.is_dir():
        if (p / "config.json").is_file():
            return load_hf_dir(p, load_tokenizer=load_tokenizer)
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return load_gguf(ggufs[0], load_tokenizer=load_tokenizer, keep_blocks=keep_blocks)
        raise ModelNotFoundError(
            f"{p} has no config.json and {'several' if ggufs else 'no'} .gguf files; point "
            "specserve at one GGUF file or at a HF model directory."
        )
    return load_gguf(p, load_tokenizer=load_tokenizer, keep_blocks=keep_blocks)


def load_model_metadata(path: str | os.PathLike[str]) -> tuple[ArchConfig, Tokenizer | None]:
    """Architecture and tokenizer only, without reading any weights (routers, front-ends)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelNotFoundError(f"{p} does not exist; pass a GGUF file, a HF model directory, or a bundled model name.")
    if p.is_dir() and (p / "config.json").is_file():
        tok = Tokenizer.from_dir(p) if (p / "tokenizer.json").is_file() else None
        return arch_from_hf_config(_read_config(p), name=p.name), tok
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ModelNotFoundError(f"{p} has no config.json and not exactly one .gguf file.")
        p = ggufs[0]
    reader = open_gguf(p)
    arch = arch_from_gguf(reader)
    return arch, _gguf_tokenizer(reader, arch.name)


# --- GGUF ---------------------------------------------------------------------------------------


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse a GGUF file's header, raising CorruptModelError for anything malformed or truncated."""
    p = Path(path)
    if p.exists() and not p.is_file():  # a FIFO would block the open below forever
        raise ModelNotFoundError(f"{p} is not a regular file; pass a GGUF model file or a HF model directory.")
    try:
        with p.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelNotFoundError(
            f"Cannot open {p}: {exc}. Check the path and permissions."
        ) from exc
    if magic != b"GGUF":
        raise CorruptModelError(
            f"{p} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); pass a GGUF model "
            "file or a HF model directory, and re-download the file if it should be GGUF."
        )
    try:
        reader = GGUFFile(p)
    except Exception as exc:  # the reader signals damage with assorted ValueError/IndexError/...
        raise CorruptModelError(
            f"{p} could not be parsed as GGUF ({type(exc).__name__}: {exc}); the file is probably "
            "truncated or damaged, so download or re-convert it."
        ) from exc
    file_size = p.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > file_size:
            raise CorruptModelError(
                f"{p} is truncated: tensor {t.name} ends at byte {t.data_offset + t.n_bytes} but "
                f"the file has {file_size}; download or re-convert it."
            )
    # Tensors lie aligned and apart (GGUF writes each at a multiple of general.alignment): one
    # that starts mid-alignment or inside another was damaged or mislabelled, and would load
    # and compute from the wrong bytes.
    align = int(_field(reader, "general.alignment", 32))
    placed = sorted(reader.tensors, key=lambda t: t.data_offset)
    for t, after in zip(placed, [*placed[1:], None]):
        if t.data_offset % align:
            raise CorruptModelError(f"{p}: tensor {t.name} starts at byte {t.data_offset}, not a multiple of the "
                                    f"file's alignment {align}; the file is damaged, so download or re-convert it.")
        if after is not None and t.data_offset + t.n_bytes > after.data_offset:
            raise CorruptModelError(f"{p}: tensor {t.name} (bytes {t.data_offset}-{t.data_offset + t.n_bytes}) runs "
                                    f"into {after.name} (from byte {after.data_offset}): its size or type is wrong; "
                                    "the file is damaged, so download or re-convert it.")
    return reader


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _require_int(reader: GGUFFile, key: str) -> int:
    value = _field(reader, key)
    if isinstance(value, list):
        raise UnsupportedModelError(
            f"{key} varies per layer in this GGUF; specserve needs the same value in every layer, "
            "so use a model with a uniform layer shape."
        )
    if value is None:
        raise CorruptModelError(
            f"GGUF metadata key {key} is missing; the file is incomplete, so re-convert it with a "
            "current llama.cpp."
        )
    if isinstance(value, bool) or not isinstance(value, int):
        raise CorruptModelError(f"GGUF metadata key {key} is {value!r}, not an integer; re-convert the file.")
    return int(value)


def arch_from_gguf(reader: GGUFFile) -> ArchConfig:
    """Translate a GGUF's ``general.architecture`` and ``<arch>.*`` metadata into an ArchConfig;
    metadata of the wrong kind or out of range is a CorruptModelError naming the file."""
    try:
        arch = _arch_from_gguf(reader)
    except (ValueError, TypeError, ZeroDivisionError) as exc:
        if isinstance(exc, SpecServeError):
            raise
        raise CorruptModelError(f"{reader.path}: its metadata does not describe a usable model ({exc}); "
                                "re-convert the file.") from exc
    # block_count against the blocks the file holds (a count of 10**9 in a small file built
    # ten billion expected tensor names before anything said no).
    blocks = {b for t in reader.tensors if (b := _block_of(t.name)) >= 0}
    held = max(blocks) + 1 if blocks else 0
    if arch.num_layers + nextn_layers(reader) != held:
        raise CorruptModelError(f"{reader.path}: its metadata counts {arch.num_layers + nextn_layers(reader)} blocks "
                                f"but the file holds blocks 0-{held - 1}; re-convert it.")
    return arch


def _arch_from_gguf(reader: GGUFFile) -> ArchConfig:
    source = str(_field(reader, "general.architecture", ""))
    key = _ARCH_ALIASES.get(source)
    if key is None:
        raise UnsupportedModelError(
            f"GGUF architecture {source!r} is not supported; specserve runs "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} models (including SmolLM2, Llama 2-style, "
            "Mistral-style and Qwen2/2.5). Use a model of one of those families."
        )
    pre = source + "."
    hidden = _require_int(reader, pre + "embedding_length")
    n_head = _require_int(reader, pre + "attention.head_count")
    n_kv = int(_field(reader, pre + "attention.head_count_kv", n_head))
    head_dim = int(_field(reader, pre + "attention.key_length", hidden // n_head))
    value_dim = int(_field(reader, pre + "attention.value_length", head_dim))
    rope_dim = int(_field(reader, pre + "rope.dimension_count", head_dim))
    if value_dim != head_dim or rope_dim != head_dim:
        raise UnsupportedModelError(
            f"This GGUF has key width {head_dim}, value width {value_dim} and rotary width "
            f"{rope_dim}; specserve needs all three equal. Use a standard Llama/Qwen2 model."
        )
    scaling = _field(reader, pre + "rope.scaling.type")
    names = {t.name for t in reader.tensors}
    if (scaling not in (None, "none")) or "rope_freqs.weight" in names:
        raise UnsupportedModelError(
            "This GGUF uses RoPE frequency scaling (e.g. Llama 3.1-style or YaRN), which "
            "specserve does not implement; use a model with plain rotary embeddings."
        )
    window = _field(reader, pre + "attention.sliding_window")
    if window:
        raise UnsupportedModelError(
            f"This GGUF uses sliding-window attention (window {window}); specserve implements full "
            "attention only, so use a model without a sliding window."
        )
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise CorruptModelError(
            "The GGUF has no token_embd.weight tensor; the file is incomplete, so re-convert it."
        )
    vocab = int(embed.shape[-1])  # ggml lists dimensions fastest-first: [hidden, vocab]
    theta = _field(reader, pre + "rope.freq_base", 10000.0)
    eps = _field(reader, pre + "attention.layer_norm_rms_epsilon", 1e-5)
    return ArchConfig(
        architecture=key,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=_require_int(reader, pre + "feed_forward_length"),
        num_layers=_require_int(reader, pre + "block_count") - nextn_layers(reader),
        num_heads=n_head,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        rope_theta=float(theta),
        rms_norm_eps=float(eps),
        max_position_embeddings=int(_field(reader, pre + "context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias=key == "qwen2",
        name=str(_field(reader, "general.name", "") or ""),
    )


def _gguf_tokenizer(reader: GGUFFile, name: str) -> Tokenizer:
    """The GGUF's tokenizer; metadata it cannot be built from (an EOS id that is text, merges of
    tokens the vocabulary lacks) is a CorruptModelError naming the file."""
    try:
        return Tokenizer.from_gguf(reader, name=name)
    except SpecServeError:
        raise
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises bare Exceptions
        raise CorruptModelError(f"{reader.path}: its tokenizer metadata is unusable ({type(exc).__name__}: "
                                f"{str(exc)[:200]}); re-convert the file.") from exc


def nextn_layers(reader: GGUFFile) -> int:
    """How many multi-token-prediction layers the file ships after its decoder layers
    (``<arch>.nextn_predict_layers``, llama.cpp's name: DeepSeek-V3, GLM-4.5, Qwen3.5 and the like
    convert their MTP modules as the last blocks, counted in ``block_count``, with
    ``blk.N.nextn.*`` tensors beside the block's own). They are not part of the network that
    decodes: the loader leaves them out, and ``--spec-method mtp`` drafts with the first one
    (gguf_mtp_tensors)."""
    source = str(_field(reader, "general.architecture", ""))
    value = _field(reader, source + ".nextn_predict_layers", 0)
    blocks = _field(reader, source + ".block_count", 0)
    if not (isinstance(value, int) and isinstance(blocks, int) and 0 <= value < max(1, blocks)):
        raise CorruptModelError(
            f"{source}.nextn_predict_layers is {value!r} with block_count {blocks!r}: the file's "
            "multi-token-prediction layers do not fit its blocks; re-convert it with a current llama.cpp."
        )
    return value


GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_BLOCK_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")


_GGUF_BLOCK_PREFIX = re.compile(r"blk\.(\d+)\.")


def _block_of(gguf_name: str) -> int:
    """The block a GGUF tensor belongs to (-1 for the embedding, the final norm and the head)."""
    m = _GGUF_BLOCK_PREFIX.match(gguf_name)
    return int(m.group(1)) if m else -1


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[gguf_name]
    m = _GGUF_BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in GGUF_BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{GGUF_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def _unpermute_rope_rows(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of Llama q/k projection rows.

    HF Llama rotates dimension i of a head with dimension i + head_dim/2 ("rotate half").
    llama.cpp's converter reorders each head's rows so that those two sit side by side, as its
    interleaved-pair RoPE expects: HF row (half j, index i) is stored at row 2*i + j. Reading the
    stored rows as (head, i, j) and swapping the last two axes restores (head, j, i) = HF order.
    """
    rows = t.shape[0]
    head_dim = rows // n_heads
    rest = t.shape[1:]
    return (
        t.reshape(n_heads, head_dim // 2, 2, *rest)
        .transpose(1, 2)
        .reshape(rows, *rest)
        .contiguous()
    )


_LINEAR_WEIGHT = re.compile(r"(\.(self_attn|mlp)\.\w+_proj\.weight|^lm_head\.weight)$")


def load_gguf(
    path: str | os.PathLike[str], *, load_tokenizer: bool = True, keep_blocks: bool = False
) -> LoadedCheckpoint:
    """Load a llama/qwen2 GGUF: weights under HF names (float32, or GGUF blocks), plus its tokenizer."""
    p = Path(path)
    reader = open_gguf(p)
    arch = arch_from_gguf(reader)
    tokenizer = _gguf_tokenizer(reader, arch.name) if load_tokenizer else None

    # The multi-token-prediction blocks after the decoder's (nextn_layers) are a drafter's, not
    # the network's: left for gguf_mtp_tensors.
    mtp_layers = nextn_layers(reader)
    mtp_blocks = range(arch.num_layers, arch.num_layers + mtp_layers)
    tensors = [t for t in reader.tensors if _block_of(t.name) not in mtp_blocks]
    unknown = [t.name for t in tensors if _hf_name(t.name) is None]
    if unknown:
        shown = ", ".join(unknown[:8]) + (" ..." if len(unknown) > 8 else "")
        hint = (" Its blk.N.nextn.* tensors are multi-token-prediction layers, but the file does not say "
                f"how many ({arch.architecture}.nextn_predict_layers): re-convert it with a current llama.cpp."
                if any(".nextn." in n for n in unknown) else "")
        raise UnsupportedModelError(
            f"{p} holds tensors specserve does not know how to use ({shown}); it is not a plain "
            f"{arch.architecture} network. Use a standard Llama/Qwen2 GGUF.{hint}"
        )
    names = [_hf_name(t.name) for t in tensors]
    shapes = [tuple(reversed([int(d) for d in t.shape])) for t in tensors]
    # Refuse an inconsistent file before spending seconds decoding it.
    _check_shapes(arch, dict(zip(names, shapes, strict=True)), p)  # type: ignore[arg-type]
    packed: dict[str, PackedWeight] = {}
    if keep_blocks:
        for t, name, shape in zip(tensors, names, shapes, strict=True):
            assert name is not None
            if kernel_can_read(int(t.tensor_type), shape):
                if _LINEAR_WEIGHT.search(name):
                    packed[name] = packed_from_gguf(t.data, int(t.tensor_type), shape)  # type: ignore[arg-type]
                elif name == EMBEDDING:
                    # Lookups decode the rows they read (BlockEmbedding: 890 MiB of float32 for
                    # Qwen2.5-Coder-1.5B stays ~200 MiB of blocks); a tied head reads the same blocks.
                    packed[name] = packed_from_gguf(t.data, int(t.tensor_type), shape)  # type: ignore[arg-type]
                    if arch.tie_word_embeddings:
                        packed["lm_head.weight"] = packed[name]
    todo = [(t, n, s) for t, n, s in zip(tensors, names, shapes, strict=True) if n not in packed]
    with spinner(f"loading {p.name} ({len(packed)} tensors kept in blocks, {len(todo)} decoded)"):
        values = dequantize_many([(t.data, t.tensor_type, shape) for t, _, shape in todo])
    del reader, tensors  # the decoded tensors own their memory; release the file mapping
    weights: dict[str, torch.Tensor] = {}
    with _one_thread_per_op():  # see there: keeps the copies below fast on a busy machine
        for (_, name, _), value in zip(todo, values, strict=True):
            assert name is not None
            weights[name] = _llama_row_order(arch, name, value)
        for name, pw in packed.items():  # rows are independent runs of blocks: permute them alike
            packed[name] = pw._replace(data=_llama_row_order(arch, name, pw.data))
    return LoadedCheckpoint(arch, weights, tokenizer, str(p), packed, mtp_layers)


def _llama_row_order(arch: ArchConfig, name: str, value: torch.Tensor) -> torch.Tensor:
    """GGUF stores Llama q/k rows interleaved for llama.cpp's RoPE; restore HF's order."""
    if arch.architecture == "llama" and ".self_attn.q_proj." in name:
        return _unpermute_rope_rows(value, arch.num_heads)
    if arch.architecture == "llama" and ".self_attn.k_proj." in name:
        return _unpermute_rope_rows(value, arch.num_kv_heads)
    # Qwen2 GGUFs keep HF's row order (llama.cpp runs them with NEOX-style RoPE).
    return value


# A multi-token-prediction layer's own tensors (blk.N.nextn.<key>, llama.cpp's names) -> DeepSeek-V3's.
GGUF_NEXTN_NAMES = {"eh_proj": "eh_proj", "enorm": "enorm", "hnorm": "hnorm", "shared_head_norm": "shared_head.norm"}
# Its copies of the embedding and the output head: the module drafts with the target's own.
_NEXTN_SHARED = ("embed_tokens", "shared_head_head")


def gguf_mtp_tensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The first multi-token-prediction layer a GGUF ships (see nextn_layers), float32, in DeepSeek-V3's
    names under ``model.layers.N.``: ``eh_proj``, ``enorm``, ``hnorm``, ``shared_head.norm`` and the
    block's own ``self_attn.*`` / ``mlp.*`` / norms (Llama q/k rows in HF order), as
    specserve.spec.eagle.import_mtp_tensors reads them. The layer's copies of the embedding and the
    output head are not decoded. UnsupportedModelError for a file without such a layer, or with
    tensors in it that specserve cannot run."""
    p = Path(path)
    reader = open_gguf(p)
    arch = arch_from_gguf(reader)
    if nextn_layers(reader) == 0:
        raise UnsupportedModelError(
            f"{p} ships no multi-token-prediction layer ({arch.architecture}.nextn_predict_layers is absent or "
            "0); train a module for the model with `specserve train-draft --method mtp --model MODEL`."
        )
    layer = arch.num_layers  # the first block after the decoder's
    prefix = f"blk.{layer}."
    picked = []
    for t in reader.tensors:
        if not t.name.startswith(prefix):
            continue
        stem, _, kind = t.name.removeprefix(prefix).rpartition(".")
        if stem.removeprefix("nextn.") in _NEXTN_SHARED:
            continue
        name = GGUF_NEXTN_NAMES.get(stem.removeprefix("nextn.")) if stem.startswith("nextn.") else GGUF_BLOCK_NAMES.get(stem)
        if name is None or kind not in ("weight", "bias"):
            raise UnsupportedModelError(
                f"{p}'s multi-token-prediction layer holds {t.name}, which specserve does not know how to "
                "run: its MTP module is not DeepSeek-V3's form over a Llama/Qwen2 block."
            )
        picked.append((t, f"model.layers.{layer}.{name}.{kind}", tuple(reversed([int(d) for d in t.shape]))))
    if not any(name.endswith(".eh_proj.weight") for _, name, _ in picked):
        raise CorruptModelError(f"{p} says it ships a multi-token-prediction layer but has no {prefix}nextn.eh_proj.weight; "
                                "re-convert it with a current llama.cpp.")
    with spinner(f"loading the multi-token-prediction layer of {p.name} ({len(picked)} tensors)"):
        values = dequantize_many([(t.data, t.tensor_type, shape) for t, _, shape in picked])
    return {name: _llama_row_order(arch, name, value) for (_, name, _), value in zip(picked, values, strict=True)}


# --- HF directories -----------------------------------------------------------------------------


def _read_config(path: Path) -> dict[str, Any]:
    try:
        data = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CorruptModelError(
            f"Cannot read {path / 'config.json'}: {exc}. Re-download or re-save the model."
        ) from exc
    if not isinstance(data, dict):
        raise CorruptModelError(f"{path / 'config.json'} is not a JSON object; re-save the model.")
    return data


def arch_from_hf_config(config: dict[str, Any], name: str = "") -> ArchConfig:
    """Translate a HF ``config.json`` (Llama/Qwen2/Mistral) into an ArchConfig."""
    key = None
    for cls_name in config.get("architectures") or []:
        key = key or _HF_CLASSES.get(cls_name)
    key = key or _ARCH_ALIASES.get(str(config.get("model_type", "")))
    if key is None:
        found = config.get("architectures") or config.get("model_type")
        raise UnsupportedModelError(
            f"HF model type {found!r} is not supported; specserve runs "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} models (LlamaForCausalLM, Qwen2ForCausalLM). "
            "Use a model of one of those families."
        )
    try:
        hidden = int(config["hidden_size"])
        n_head = int(config["num_attention_heads"])
        n_kv = int(config.get("num_key_value_heads") or n_head)
        head_dim = int(config.get("head_dim") or hidden // n_head)
        rope = config.get("rope_parameters") or {}
        scaling = config.get("rope_scaling") or {}
        rope_type = (
            scaling.get("rope_type") or scaling.get("type") or rope.get("rope_type") or "default"
        )
        if rope_type != "default":
            raise UnsupportedModelError(
                f"This model uses RoPE scaling type {rope_type!r}, which specserve does not "
                "implement; use a model with plain rotary embeddings."
            )
        if config.get("use_sliding_window") or (
            key == "llama" and config.get("sliding_window") not in (None, 0)
        ):
            raise UnsupportedModelError(
                "This model uses sliding-window attention; specserve implements full attention "
                "only, so use a model without a sliding window."
            )
        if key == "llama" and (config.get("attention_bias") or config.get("mlp_bias")):
            raise UnsupportedModelError(
                "This Llama variant has projection biases (attention_bias/mlp_bias), which "
                "specserve's Llama does not implement; use a model without them."
            )
        theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
        return ArchConfig(
            architecture=key,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=n_head,
            num_kv_heads=n_kv,
            head_dim=head_dim,
            rope_theta=float(theta),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=key == "qwen2",
            name=name or str(config.get("_name_or_path") or ""),
        )
    except KeyError as exc:
        raise CorruptModelError(
            f"config.json lacks the required field {exc.args[0]!r}; re-save the model with "
            "save_pretrained."
        ) from None
    except SpecServeError:
        raise
    except (ValueError, TypeError, ZeroDivisionError, AttributeError) as exc:  # a field of the wrong kind or range
        raise CorruptModelError(f"config.json does not describe a usable model ({exc}); re-save the model with "
                                "save_pretrained.") from None


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CorruptModelError(
                f"Cannot read {index}: {exc}. Re-download or re-save the model."
            ) from exc
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CorruptModelError(f"{index}: its weight_map must map tensor names to shard file names; "
                                    "re-download or re-save the model.")
        files = [path / f for f in dict.fromkeys(weight_map.values())]
        # A shard is a file of the model's own directory, by its name: not resolved, since the
        # Hugging Face cache links each shard to a blob elsewhere.
        outside = [str(f) for f in files if not Path(os.path.normpath(f)).is_relative_to(os.path.normpath(path))
                   or Path(os.path.normpath(f)) == Path(os.path.normpath(path))]
        if outside:
            raise CorruptModelError(f"{index} names shards outside {path} ({', '.join(outside[:3])}); re-save the model.")
        absent = [str(f.relative_to(path)) for f in files if not f.is_file()]
        if absent:
            raise CorruptModelError(
                f"{index} lists shards that are missing ({', '.join(absent)}); finish the download "
                "or re-save the model."
            )
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    not_files = [f.name for f in files if not f.is_file()]  # a directory (or a broken link) named like weights
    if not_files:
        raise CorruptModelError(f"{path}: {', '.join(not_files[:3])} should be a safetensors file, and is not one "
                                "(a directory or a broken link); re-download or re-save the model.")
    if not files:
        raise ModelNotFoundError(
            f"{path} has config.json but no *.safetensors weights; download the safetensors files "
            "(pytorch_model.bin is not supported: convert it with "
            "save_pretrained(safe_serialization=True))."
        )
    return files


def load_hf_dir(path: str | os.PathLike[str], *, load_tokenizer: bool = True) -> LoadedCheckpoint:
    """Load a HF directory: config.json, safetensors shard(s), and tokenizer.json if present."""
    from safetensors import SafetensorError, safe_open

    p = Path(path)
    arch = arch_from_hf_config(_read_config(p), name=p.name)
    weights: dict[str, torch.Tensor] = {}
    integral: dict[str, torch.dtype] = {}  # tensors stored as integers: no weight of this network is
    for file in _safetensors_files(p):
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    name = key if key.startswith(("model.", "lm_head.")) else f"model.{key}"
                    t = f.get_tensor(key)
                    if not t.is_floating_point():
                        integral[name] = t.dtype
                    weights[name] = t.to(torch.float32).contiguous()
        except (SafetensorError, OSError, ValueError) as exc:
            raise CorruptModelError(
                f"Cannot read {file}: {exc}. The file is damaged; re-download or re-save the model."
            ) from exc
    if arch.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    _check_shapes(arch, {n: tuple(t.shape) for n, t in weights.items()}, p)
    wanted = expected_shapes(arch)
    if bad := [f"{n} ({integral[n]})" for n in wanted if n in integral]:  # their integers read as values
        raise CorruptModelError(f"{p}: weights stored as integers ({', '.join(bad[:3])}), not floats; the checkpoint "
                                "is damaged or quantized in a form specserve does not read, so re-save it.")
    # DeepSeek-V3-style MTP layers after the decoder's (hf_mtp_prefix): not part of the network.
    mtp_layers = len({n.removesuffix("eh_proj.weight") for n in weights if n.endswith("eh_proj.weight")})
    for extra in [n for n in weights if n not in wanted]:
        del weights[extra]  # e.g. rotary inv_freq buffers saved by old transformers versions, MTP layers
    tokenizer = None
    if load_tokenizer and (p / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_dir(p)
    return LoadedCheckpoint(arch, weights, tokenizer, str(p), mtp_layers=mtp_layers)


_LAYER_INDEX = re.compile(r"\.(\d+)\.$")


def hf_mtp_prefix(path: str | os.PathLike[str]) -> str | None:
    """The name prefix (``model.layers.N.``) of the first multi-token-prediction layer a HF
    directory's safetensors ship in DeepSeek-V3's form (``eh_proj`` beside the block, after the
    decoder's layers, which load_hf_dir leaves out), from the files' headers alone; None for a
    directory without one or that is not a HF model."""
    from safetensors import SafetensorError, safe_open

    p = Path(path)
    if not (p / "config.json").is_file():
        return None
    try:
        files = _safetensors_files(p)
        anchors = []
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                anchors += [k.removesuffix("eh_proj.weight") for k in f.keys() if k.endswith("eh_proj.weight")]  # noqa: SIM118
    except (ModelNotFoundError, CorruptModelError, SafetensorError, OSError):
        return None
    if not anchors:
        return None
    return min(anchors, key=lambda k: int(m.group(1)) if (m := _LAYER_INDEX.search(k)) else -1)


def hf_mtp_tensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The first multi-token-prediction layer of a HF directory (hf_mtp_prefix), float32, under its
    own names; its copies of the embedding and the output head are not read (the module drafts
    with the target's)."""
    from safetensors import safe_open

    p = Path(path)
    prefix = hf_mtp_prefix(p)
    if prefix is None:
        raise UnsupportedModelError(f"{p} ships no multi-token-prediction layer (no '*eh_proj.weight' in its safetensors).")
    out: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(p):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if key.startswith(prefix) and not key.removeprefix(prefix).startswith(("embed_tokens.", "shared_head.head.")):
                    out[key] = f.get_tensor(key).to(torch.float32).contiguous()
    return out


# --- validation ---------------------------------------------------------------------------------


def expected_shapes(arch: ArchConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name an ArchConfig needs, with its HF (out_features, in_features) shape."""
    h, f = arch.hidden_size, arch.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (arch.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    for i in range(arch.num_layers):
        pre = f"model.layers.{i}."
        shapes.update(
            {
                pre + "self_attn.q_proj.weight": (arch.q_size, h),
                pre + "self_attn.k_proj.weight": (arch.kv_size, h),
                pre + "self_attn.v_proj.weight": (arch.kv_size, h),
                pre + "self_attn.o_proj.weight": (h, arch.q_size),
                pre + "mlp.gate_proj.weight": (f, h),
                pre + "mlp.up_proj.weight": (f, h),
                pre + "mlp.down_proj.weight": (h, f),
                pre + "input_layernorm.weight": (h,),
                pre + "post_attention_layernorm.weight": (h,),
            }
        )
        if arch.attention_bias:
            shapes[pre + "self_attn.q_proj.bias"] = (arch.q_size,)
            shapes[pre + "self_attn.k_proj.bias"] = (arch.kv_size,)
            shapes[pre + "self_attn.v_proj.bias"] = (arch.kv_size,)
    return shapes


_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _check_shapes(arch: ArchConfig, shapes: dict[str, tuple[int, ...]], source: Path) -> None:
    """Refuse checkpoints with missing or mis-shaped tensors (extra tensors are allowed here, but
    not decoder layers beyond the config's count: those were dropped silently; multi-token-
    prediction layers after them, with their eh_proj, are a drafter's)."""
    layers = {int(m.group(1)) for n in shapes if (m := _HF_LAYER.match(n))}
    layers -= {int(m.group(1)) for n in shapes if n.endswith("eh_proj.weight") and (m := _HF_LAYER.match(n))}  # MTP
    held = max(layers) + 1 if layers else 0
    if held != arch.num_layers:  # before naming every tensor of 10**9 layers
        raise CorruptModelError(f"{source}: its config counts {arch.num_layers} layers but the checkpoint holds "
                                f"layers 0-{held - 1}; the checkpoint and its config disagree, so re-convert it.")
    wanted = expected_shapes(arch)
    missing = [n for n in wanted if n not in shapes]
    if missing:
        shown = ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else "")
        raise CorruptModelError(
            f"{source} lacks {len(missing)} tensors the {arch.architecture} model needs ({shown}); "
            "the checkpoint is incomplete, so re-download or re-convert it."
        )
    for name, shape in wanted.items():
        if tuple(shapes[name]) != shape:
            raise CorruptModelError(
                f"{source}: tensor {name} has shape {tuple(shapes[name])}, but the config "
                f"implies {shape}; the checkpoint and its config disagree, so re-convert it."
            )
