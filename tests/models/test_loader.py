"""Checkpoint loading: GGUF and HF directories must yield HF transformers' exact weights."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from specserve.errors import (
    CorruptModelError,
    ModelNotFoundError,
    ModelPackageMissingError,
    UnsupportedModelError,
)
from specserve.models.arch import ArchConfig
from specserve.models.bundled import ensure_bundled
from specserve.models.loader import (
    LoadedCheckpoint,
    expected_shapes,
    gguf_mtp_tensors,
    load_model_files,
    open_gguf,
)
from specserve.models.tokenizer import Tokenizer
from specserve.testing import plain_memmap, write_gguf_model

transformers = pytest.importorskip("transformers")


def _bundled_or_skip(name: str) -> Path:
    try:
        return ensure_bundled(name, progress=False)
    except ModelPackageMissingError as exc:
        pytest.skip(f"bundled model {name} is not installed: {exc}")


def _hf_rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _assert_arch_matches_hf(arch: ArchConfig, config) -> None:
    assert arch.architecture == config.model_type
    assert arch.vocab_size == config.vocab_size
    assert arch.hidden_size == config.hidden_size
    assert arch.intermediate_size == config.intermediate_size
    assert arch.num_layers == config.num_hidden_layers
    assert arch.num_heads == config.num_attention_heads
    assert arch.num_kv_heads == config.num_key_value_heads
    assert arch.head_dim == (
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )
    assert arch.rope_theta == _hf_rope_theta(config)
    assert arch.rms_norm_eps == config.rms_norm_eps
    assert arch.max_position_embeddings == config.max_position_embeddings
    assert arch.tie_word_embeddings == config.tie_word_embeddings


def _assert_weights_match(
    ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], tied: bool
) -> None:
    expected = set(reference) - ({"lm_head.weight"} if tied else set())
    assert set(ours) == expected
    for name, tensor in ours.items():
        ref = reference[name]
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu", name
        assert tensor.shape == ref.shape, name
        assert (tensor - ref.float()).abs().max().item() < 1e-6, name


# --- real GGUF files vs HF's GGUF loader ------------------------------------------------------


@pytest.fixture(scope="module", params=["smollm2-135m-instruct",
                                        pytest.param("qwen2.5-coder-0.5b-instruct", marks=pytest.mark.slow)])
def gguf_pair(request):
    """(our checkpoint, HF's model loaded from the same GGUF) — each loaded once per module."""
    path = _bundled_or_skip(request.param)
    ours = load_model_files(path)
    # The plain-memmap patch only speeds up gguf's reader (HF parses the file twice).
    with plain_memmap():
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    yield ours, hf
    del ours, hf


def test_gguf_weights_equal_hf(gguf_pair):
    ours, hf = gguf_pair
    _assert_weights_match(ours.weights, hf.state_dict(), ours.arch.tie_word_embeddings)


def test_gguf_arch_equals_hf_config(gguf_pair):
    ours, hf = gguf_pair
    _assert_arch_matches_hf(ours.arch, hf.config)
    assert ours.arch.attention_bias == (ours.arch.architecture == "qwen2")
    assert ours.arch.name
    assert isinstance(ours.tokenizer, Tokenizer)
    assert ours.source.endswith(".gguf")


def test_gguf_without_tokenizer():
    ck = load_model_files(_bundled_or_skip("smollm2-135m-instruct"), load_tokenizer=False)
    assert isinstance(ck, LoadedCheckpoint) and ck.tokenizer is None
    assert ck.arch.tie_word_embeddings and "lm_head.weight" not in ck.weights


# --- damaged and foreign files ------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    return _bundled_or_skip("smollm2-135m-instruct")


@pytest.mark.parametrize("keep", [0.5, 0.99999, 4096])
def test_truncated_gguf_is_corrupt(smollm2_path, tmp_path, keep):
    size = smollm2_path.stat().st_size
    n = int(size * keep) if keep < 1 else keep
    cut = tmp_path / "cut.gguf"
    with smollm2_path.open("rb") as src, cut.open("wb") as dst:
        dst.write(src.read(n))
    with pytest.raises(CorruptModelError, match="download or re-convert"):
        load_model_files(cut)


def test_random_bytes_are_corrupt(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(np.random.default_rng(0).bytes(100_000))
    with pytest.raises(CorruptModelError, match="not a GGUF file"):
        load_model_files(junk)
    junk.write_bytes(b"GGUF" + np.random.default_rng(1).bytes(100_000))
    with pytest.raises(CorruptModelError):
        load_model_files(junk)


def test_missing_path(tmp_path):
    with pytest.raises(ModelNotFoundError):
        load_model_files(tmp_path / "nope.gguf")
    with pytest.raises(ModelNotFoundError):
        load_model_files(tmp_path)  # a directory with neither config.json nor a .gguf


# --- synthetic GGUF files ----------------------------------------------------------------------


TINY = {"layers": 2, "hidden": 64, "ffn": 96, "heads": 4, "kv_heads": 2, "vocab": 300}


def _random_weights(arch: ArchConfig, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) for n, s in expected_shapes(arch).items()}


def _tiny_arch(key: str, tied: bool) -> ArchConfig:
    return ArchConfig(
        architecture=key,
        vocab_size=TINY["vocab"],
        hidden_size=TINY["hidden"],
        intermediate_size=TINY["ffn"],
        num_layers=TINY["layers"],
        num_heads=TINY["heads"],
        num_kv_heads=TINY["kv_heads"],
        head_dim=TINY["hidden"] // TINY["heads"],
        rope_theta=5000.0,
        rms_norm_eps=float(np.float32(1e-6)),  # GGUF stores float32
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        attention_bias=key == "qwen2",
        name="tiny",
    )


@pytest.mark.parametrize(("key", "tied"), [("llama", True), ("llama", False), ("qwen2", False)])
def test_synthetic_gguf_round_trip(tmp_path, key, tied):
    arch = _tiny_arch(key, tied)
    weights = _random_weights(arch, seed=len(key) + tied)
    path = tmp_path / "tiny.gguf"
    write_gguf_model(path, key, weights, TINY)
    ck = load_model_files(path, load_tokenizer=False)
    assert ck.arch == arch
    assert ck.weights.keys() == weights.keys()
    for name, tensor in weights.items():
        # Llama q/k come back in HF order (the permutation was undone); Qwen2 was never permuted.
        assert torch.equal(ck.weights[name], tensor), name


def _mtp_layer(arch: ArchConfig, seed: int) -> dict[str, torch.Tensor]:
    """A multi-token-prediction module's tensors in DeepSeek-V3's names: eh_proj, its norms and one
    decoder block of the target's shape."""
    gen = torch.Generator().manual_seed(seed)
    h = arch.hidden_size
    block = {n.removeprefix("model.layers.0."): s for n, s in expected_shapes(arch).items() if n.startswith("model.layers.0.")}
    shapes = {"eh_proj.weight": (h, 2 * h), "enorm.weight": (h,), "hnorm.weight": (h,), "shared_head.norm.weight": (h,),
              **block}
    return {n: torch.randn(s, generator=gen) for n, s in shapes.items()}


@pytest.mark.parametrize("key", ["llama", "qwen2"])
def test_a_gguf_s_multi_token_prediction_layer_is_not_part_of_the_network(tmp_path, key):
    """llama.cpp writes a model's MTP modules (DeepSeek-V3, GLM-4.5, Qwen3.5) as the blocks after
    the decoder's, counted in block_count, named blk.N.nextn.* beside the block's own tensors, and
    says how many in <arch>.nextn_predict_layers. The loader leaves them out of the network (the
    same arch and weights as the file without them), and gguf_mtp_tensors reads the first one in
    DeepSeek-V3's names, q/k rows in HF order, without its copies of the embedding and head."""
    arch = _tiny_arch(key, tied=False)
    weights = _random_weights(arch, seed=7)
    mtp = _mtp_layer(arch, seed=8)
    vocab_sized = [(f"blk.{TINY['layers']}.nextn.{n}.weight", np.zeros((TINY["vocab"], TINY["hidden"]), np.float32))
                   for n in ("embed_tokens", "shared_head_head")]
    path = write_gguf_model(tmp_path / "mtp.gguf", key, weights, TINY, mtp=mtp, extra=vocab_sized)
    ck = load_model_files(path, load_tokenizer=False)
    assert ck.arch == arch and ck.weights.keys() == weights.keys() and ck.mtp_layers == 1
    assert all(torch.equal(ck.weights[n], t) for n, t in weights.items())
    layer = gguf_mtp_tensors(path)
    assert layer.keys() == {f"model.layers.{TINY['layers']}.{n}" for n in mtp}
    for name, tensor in mtp.items():
        assert torch.equal(layer[f"model.layers.{TINY['layers']}.{name}"], tensor), name
    plain = write_gguf_model(tmp_path / "plain.gguf", key, weights, TINY)
    with pytest.raises(UnsupportedModelError, match="no multi-token-prediction layer"):
        gguf_mtp_tensors(plain)


def test_mtp_layers_the_file_does_not_count_are_refused_with_the_reason(tmp_path):
    arch = _tiny_arch("qwen2", tied=False)
    path = write_gguf_model(tmp_path / "unsaid.gguf", "qwen2", _random_weights(arch, 0), TINY, mtp=_mtp_layer(arch, 1),
                            nextn_key=False)
    with pytest.raises(UnsupportedModelError, match="nextn_predict_layers"):
        load_model_files(path, load_tokenizer=False)
    for name, value in (("all", 2), ("text", "one")):  # every block a drafter's (no network left); not a count
        writer = gguf.GGUFWriter(str(tmp_path / f"{name}.gguf"), "qwen2")
        writer.add_block_count(2)
        if isinstance(value, int):
            writer.add_uint32("qwen2.nextn_predict_layers", value)
        else:
            writer.add_string("qwen2.nextn_predict_layers", value)
        writer.add_embedding_length(4)
        writer.add_head_count(1)
        writer.add_feed_forward_length(8)
        writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with pytest.raises(CorruptModelError, match="nextn_predict_layers"):
            load_model_files(tmp_path / f"{name}.gguf", load_tokenizer=False)


def test_unknown_architecture_is_unsupported(tmp_path):
    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="'mamba'.*llama, qwen2"):
        load_model_files(path)


def test_unknown_tensor_is_unsupported(tmp_path):
    arch = _tiny_arch("qwen2", False)
    path = tmp_path / "extra.gguf"
    extra = [("blk.0.attn_q_norm.weight", np.ones(16, np.float32))]
    write_gguf_model(path, "qwen2", _random_weights(arch, 0), TINY, extra=extra)
    with pytest.raises(UnsupportedModelError, match="attn_q_norm"):
        load_model_files(path, load_tokenizer=False)


def test_missing_tensor_is_corrupt(tmp_path):
    arch = _tiny_arch("llama", True)
    weights = _random_weights(arch, 0)
    del weights["model.layers.1.mlp.up_proj.weight"]
    path = tmp_path / "missing.gguf"
    write_gguf_model(path, "llama", weights, TINY)
    with pytest.raises(CorruptModelError, match="up_proj"):
        load_model_files(path, load_tokenizer=False)


def test_misshapen_tensor_is_corrupt(tmp_path):
    arch = _tiny_arch("llama", True)
    weights = _random_weights(arch, 0)
    weights["model.layers.1.self_attn.v_proj.weight"] = torch.randn(30, TINY["hidden"])
    path = tmp_path / "misshapen.gguf"
    write_gguf_model(path, "llama", weights, TINY)
    with pytest.raises(CorruptModelError, match=r"v_proj.weight has shape \(30, 64\)"):
        load_model_files(path, load_tokenizer=False)


# --- HF directories -------------------------------------------------------------------------------


def _tiny_hf_model(kind: str, tied: bool):
    common = {
        "vocab_size": TINY["vocab"],
        "hidden_size": TINY["hidden"],
        "intermediate_size": TINY["ffn"],
        "num_hidden_layers": TINY["layers"],
        "num_attention_heads": TINY["heads"],
        "num_key_value_heads": TINY["kv_heads"],
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tied,
    }
    torch.manual_seed(0)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))


@pytest.mark.parametrize(
    ("kind", "tied", "shard"),
    [
        ("llama", True, False),
        ("llama", False, True),
        ("qwen2", False, False),
        ("qwen2", True, True),
    ],
)
def test_hf_dir_matches_transformers(tmp_path, kind, tied, shard):
    model = _tiny_hf_model(kind, tied)
    kwargs = {"max_shard_size": "100KB"} if shard else {}
    model.save_pretrained(tmp_path, safe_serialization=True, **kwargs)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    ck = load_model_files(tmp_path)
    _assert_arch_matches_hf(ck.arch, model.config)
    assert ck.arch.attention_bias == (kind == "qwen2")
    assert ck.tokenizer is None  # no tokenizer.json was saved
    _assert_weights_match(ck.weights, model.state_dict(), tied)


def test_hf_dir_with_tokenizer(tmp_path):
    model = _tiny_hf_model("llama", True)
    model.save_pretrained(tmp_path)
    tok_src = _bundled_or_skip("smollm2-135m-instruct")
    tok = Tokenizer.from_gguf(open_gguf(tok_src))
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    ck = load_model_files(tmp_path)
    assert ck.tokenizer is not None and ck.tokenizer.fingerprint() == tok.fingerprint()


def test_hf_dir_unsupported_and_broken(tmp_path):
    model = _tiny_hf_model("llama", True)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())

    (tmp_path / "config.json").write_text(
        json.dumps({**config, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(UnsupportedModelError, match="gpt2|GPT2"):
        load_model_files(tmp_path)

    rope = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0}
    (tmp_path / "config.json").write_text(
        json.dumps({**config, "rope_scaling": rope, "rope_parameters": rope})
    )
    with pytest.raises(UnsupportedModelError, match="llama3"):
        load_model_files(tmp_path)

    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptModelError):
        load_model_files(tmp_path)

    weights.unlink()
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        load_model_files(tmp_path)


def test_directory_with_single_gguf(tmp_path):
    arch = _tiny_arch("qwen2", False)
    write_gguf_model(tmp_path / "only.gguf", "qwen2", _random_weights(arch, 3), TINY)
    ck = load_model_files(tmp_path, load_tokenizer=False)
    assert ck.arch == arch and ck.source == str(tmp_path / "only.gguf")
    write_gguf_model(tmp_path / "second.gguf", "qwen2", _random_weights(arch, 4), TINY)
    with pytest.raises(ModelNotFoundError, match="several"):
        load_model_files(tmp_path)


# --- damaged and inconsistent files (from a fuzz of ~190 of them) ----------------------------------


def test_a_gguf_counting_more_blocks_than_it_holds_is_refused_at_once(tmp_path):
    """block_count 10**9 in a small file built ten billion expected tensor names (memory until the
    machine ran out); one short of the blocks held dropped a block, and failed deep in the runner."""
    arch = _tiny_arch("qwen2", False)
    for layers in (10**9, 1):
        path = tmp_path / f"blocks{layers}.gguf"
        write_gguf_model(path, "qwen2", _random_weights(arch, 0), {**TINY, "layers": layers})
        with pytest.raises(CorruptModelError, match=f"counts {layers} blocks but the file holds blocks 0-1"):
            load_model_files(path, load_tokenizer=False)


def test_gguf_metadata_out_of_range_or_of_the_wrong_kind_is_corrupt(tmp_path):
    arch = _tiny_arch("qwen2", False)
    path = tmp_path / "kv0.gguf"
    write_gguf_model(path, "qwen2", _random_weights(arch, 0), {**TINY, "kv_heads": 0})
    with pytest.raises(CorruptModelError, match="num_kv_heads is 0"):  # ZeroDivisionError before
        load_model_files(path, load_tokenizer=False)


def test_a_gguf_tensor_that_runs_into_another_or_sits_off_alignment_is_corrupt(tmp_path):
    """A damaged offset loaded and generated from the wrong bytes without a word."""
    arch = _tiny_arch("qwen2", False)
    good = tmp_path / "good.gguf"
    write_gguf_model(good, "qwen2", _random_weights(arch, 0), TINY)
    data = bytearray(good.read_bytes())
    tensors = open_gguf(good).tensors
    a, b = (next(t for t in tensors if t.name == n) for n in ("blk.0.ffn_down.weight", "blk.0.ffn_up.weight"))
    base = min(t.data_offset for t in tensors)  # where tensor data starts: offsets are relative to it

    def offset_field(name: str, n_dims: int) -> int:  # a tensor info's offset: after name, dims and type
        return data.find(name.encode()) + len(name) + 4 + 8 * n_dims + 4

    for label, rel, match in (("overlap", b.data_offset - base, "runs into"), ("misaligned", a.data_offset - base + 1,
                                                                                 "not a multiple of")):
        bad = bytearray(data)
        bad[offset_field(a.name, 2) : offset_field(a.name, 2) + 8] = rel.to_bytes(8, "little")
        path = tmp_path / f"{label}.gguf"
        path.write_bytes(bad)
        with pytest.raises(CorruptModelError, match=match):
            load_model_files(path, load_tokenizer=False)


def test_a_fifo_is_refused_not_waited_on(tmp_path):
    import os

    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    with pytest.raises(ModelNotFoundError, match="not a regular file"):
        open_gguf(fifo)


def test_hf_config_and_index_that_disagree_with_the_checkpoint_are_corrupt(tmp_path):
    model = _tiny_hf_model("llama", True)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for change, match in (({"num_hidden_layers": 10**9}, "counts 1000000000 layers but the checkpoint holds layers 0-1"),
                          ({"num_hidden_layers": 1}, "counts 1 layers"),  # the second layer was dropped silently
                          ({"rms_norm_eps": "tiny"}, "does not describe a usable model"),
                          ({"num_attention_heads": 0}, "does not describe a usable model"),
                          ({"rope_scaling": ["x"]}, "does not describe a usable model")):
        (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(CorruptModelError, match=match):
            load_model_files(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    weights = tmp_path / "model.safetensors"
    saved = load_file(str(weights))
    save_file({**saved, "model.norm.weight": saved["model.norm.weight"].to(torch.int32)}, str(tmp_path / "int.st"))
    (tmp_path / "int.st").replace(weights)  # a norm relabelled I32 loaded its integers as values
    with pytest.raises(CorruptModelError, match=r"stored as integers \(model.norm.weight \(torch.int32\)"):
        load_model_files(tmp_path)
    save_file(saved, str(weights))
    index = tmp_path / "model.safetensors.index.json"
    for weight_map, match in ((["model.safetensors"], "weight_map must map"),
                              ({"model.norm.weight": "../elsewhere/model.safetensors"}, "names shards outside")):
        index.write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(CorruptModelError, match=match):
            load_model_files(tmp_path)
    index.unlink()
    weights.rename(tmp_path / "weights.bin")
    weights.mkdir()  # a directory where the weights file belongs: named, not opened as weights
    with pytest.raises(CorruptModelError, match=r"model.safetensors should be a safetensors file, and is not one"):
        load_model_files(tmp_path)
