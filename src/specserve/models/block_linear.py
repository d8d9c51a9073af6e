"""Linear layers that keep their weight in a GGUF block format and compute from it.

`BlockQuantLinear` holds the weight exactly as the GGUF file stores it (Q4_K, Q6_K, Q8_0, Q5_0,
Q4_1 rows of blocks) and multiplies with specserve's native kernel (specserve.kernels), which
reads those blocks directly: a Q4_K_M 1.5B model reads ~1.1 GB per decoded token instead of
6.2 GB as float32 or 1.8 GB as int8. `--quantization auto` loads such tensors without ever
decoding them to float; `--quantization int4` turns float weights into Q4_K blocks
(`quantize_q4_k`), the same format llama.cpp's Q4_K_M files use for most matrices.

Q4_K, Q6_K, Q8_0, Q5_0, Q4_0 and Q4_1 matrices whose row count is a multiple of 8 are rearranged at load
time into an 8-row interleaved layout (same information; +2.8% bytes for Q4_K, whose scales are
stored unpacked, same bytes otherwise; see qmatmul.cpp) that lets the kernel treat 8 rows per
vector step; `packed()` converts back. Where the kernels were built with their AVX-512 path, matrices
with a multiple of 16 rows store two such groups per row, block by block (`PAIRED`), which one
512-bit pass reads front to back.

Numerics: each activation row is rounded to int8 per block (see qmatmul.cpp), so results differ
from a float32 matmul against the decoded weight by about 1% of an output's magnitude; they do
not depend on the other rows of the batch.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from specserve.kernels import BLOCK_SHAPES, kernels, qmatmul
from specserve.models.gguf_quants import dequantize

Q4_K = 12
Q6_K = 14
Q8_0 = 8
Q5_0 = 6
Q4_0 = 2
Q4_1 = 3
FOUR_BIT = (Q4_K, Q4_0, Q4_1)  # what --quantization int4 keeps as the file has it
# specserve's 8-row interleaved layouts (see qmatmul.cpp): same information, laid out so the
# kernel handles 8 rows per vector step. Built at load time, never written to disk.
INTERLEAVED = {Q4_0: 102, Q4_1: 103, Q5_0: 106, Q8_0: 108, Q4_K: 112, Q6_K: 114}
# The same with two 8-row groups per stored row, their blocks alternating: what a build with the
# AVX-512 path reads (one 512-bit pass covers both groups; 16 rows per stored row).
PAIRED = {q: k + 100 for q, k in INTERLEAVED.items()}


class PackedWeight(NamedTuple):
    """A weight matrix in GGUF blocks: `data` is uint8 [out_features, bytes per row]."""

    qtype: int
    data: torch.Tensor
    shape: tuple[int, int]  # (out_features, in_features)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix the blocks encode."""
        return dequantize(self.data.numpy(), self.qtype, self.shape)


def kernel_can_read(qtype: int, shape: tuple[int, ...]) -> bool:
    """Whether the native kernel multiplies by a matrix of this type and shape."""
    if qtype not in BLOCK_SHAPES or len(shape) != 2:
        return False
    block_values = BLOCK_SHAPES[qtype][0]
    return shape[1] % block_values == 0


class BlockQuantLinear(nn.Module):
    """y = x @ W^T + b with W in GGUF blocks, computed by the native kernel.

    `qtype` is the GGUF type of the weight; `kernel_qtype` the layout the kernel reads, which is
    the 8-row interleaved form of Q4_K/Q6_K where it applies (`interleave=False` keeps the file's).
    """

    def __init__(self, packed: PackedWeight, bias: torch.Tensor | None = None, interleave: bool = True) -> None:
        super().__init__()
        self.out_features, self.in_features = packed.shape
        self.qtype = packed.qtype
        self.kernel_qtype, data = interleave_rows(packed) if interleave else (packed.qtype, packed.data)
        self.register_buffer("qweight", data.contiguous(), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(), persistent=False)
        self.weight_nbytes = data.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out]
        """x @ W^T + b in float32."""
        return qmatmul(x.float(), self.qweight, self.kernel_qtype, self.bias)

    def packed(self) -> PackedWeight:
        """The weight in its GGUF layout."""
        data = self.qweight
        if self.kernel_qtype != self.qtype:
            data = deinterleave_rows(self.qtype, data, (self.out_features, self.in_features), self.kernel_qtype)
        return PackedWeight(self.qtype, data, (self.out_features, self.in_features))

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight the blocks encode (tests, diagnostics)."""
        return self.packed().dequantize()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 rows of `ids` (1-D), decoding only what holds them: an interleaved weight's
        8- or 16-row groups (a few hundred us for a handful of a 150k-row head's rows, where
        `dequantized_weight` decodes all of it)."""
        ids = ids.to(device="cpu", dtype=torch.long)
        n, k = len(ids), self.in_features
        if n == 0:
            return torch.zeros(0, k)
        if self.kernel_qtype == self.qtype:
            return PackedWeight(self.qtype, self.qweight.index_select(0, ids), (n, k)).dequantize()
        group = 16 if self.kernel_qtype == PAIRED[self.qtype] else 8
        groups, where = torch.unique(ids // group, return_inverse=True)
        gguf = deinterleave_rows(self.qtype, self.qweight.index_select(0, groups), (len(groups) * group, k),
                                 self.kernel_qtype)
        picked = gguf.view(len(groups), group, -1)[where, ids % group]
        return PackedWeight(self.qtype, picked, (n, k)).dequantize()

    def extra_repr(self) -> str:
        from gguf import GGMLQuantizationType

        name = GGMLQuantizationType(self.qtype).name
        return f"in_features={self.in_features}, out_features={self.out_features}, blocks={name}"


EMBEDDING = "model.embed_tokens.weight"  # the checkpoint name a BlockEmbedding replaces


class BlockEmbedding(nn.Module):
    """An embedding table kept in its GGUF file's blocks: a lookup decodes only the rows it reads.

    As float32 the table is a small model's largest tensor (Qwen2.5-Coder-1.5B: 151936 x 1536,
    890 MiB, a quarter of the process's memory) while a step reads a few of its rows. A row's
    blocks decode to the same float32 values as the whole table does, so outputs do not change.
    """

    def __init__(self, packed: PackedWeight, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = packed.shape
        self.qtype = packed.qtype
        self.out_dtype = dtype
        self.register_buffer("qweight", packed.data.contiguous(), persistent=False)
        self.weight_nbytes = packed.data.numel()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The rows of `input_ids` ([...] -> [..., embedding_dim]); an id out of range raises IndexError."""
        out = self.rows(input_ids.reshape(-1))
        return out.to(device=input_ids.device, dtype=self.out_dtype).reshape(*input_ids.shape, self.embedding_dim)

    def rows(self, ids: torch.Tensor | int) -> torch.Tensor:
        """float32 rows: those of `ids` (a 1-D tensor), or the first `ids` rows (the native
        kernels decode them: a decode step's lookup takes ~15 us, 0.3 ms with torch ops)."""
        index = torch.arange(ids) if isinstance(ids, int) else ids.to(device="cpu", dtype=torch.long)
        return kernels().dequantize_rows(self.qweight.cpu(), self.qtype, index, self.embedding_dim)

    @property
    def weight(self) -> torch.Tensor:
        """The whole table in float32 (decoded on each access: for training and fingerprints of
        a few rows use `rows`)."""
        return self.rows(self.num_embeddings)

    def packed(self) -> PackedWeight:
        """The table in its GGUF layout."""
        return PackedWeight(self.qtype, self.qweight, (self.num_embeddings, self.embedding_dim))

    def extra_repr(self) -> str:
        from gguf import GGMLQuantizationType

        return f"{self.num_embeddings}, {self.embedding_dim}, blocks={GGMLQuantizationType(self.qtype).name}"


def embedding_rows(embedding: nn.Module, n: int) -> torch.Tensor:
    """The first n rows of an embedding table (nn.Embedding or BlockEmbedding), without decoding
    a block table whole."""
    if isinstance(embedding, BlockEmbedding):
        return embedding.rows(n)
    return embedding.weight[:n]


def _check_blocks(w: torch.Tensor, block: int) -> torch.Tensor:
    if w.dim() != 2 or w.shape[1] % block:
        raise ValueError(f"a {tuple(w.shape)} matrix does not split into rows of {block}-value blocks")
    return w.detach().float()


def quantize_q8_0(w: torch.Tensor) -> PackedWeight:
    """Symmetric int8 per 32 values with a float16 scale (GGUF Q8_0)."""
    w = _check_blocks(w, 32)
    n, k = w.shape
    blocks = w.reshape(n, k // 32, 32)
    d = (blocks.abs().amax(-1, keepdim=True) / 127).half()
    inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros(()))
    q = torch.round(blocks * inv).clamp_(-127, 127).to(torch.int8)
    raw = torch.cat((d.view(torch.uint8).reshape(n, k // 32, 2), q.view(torch.uint8)), dim=-1)
    return PackedWeight(Q8_0, raw.reshape(n, -1).contiguous(), (n, k))


def quantize_q4_0(w: torch.Tensor) -> PackedWeight:
    """Symmetric 4-bit per 32 values with a float16 scale (GGUF Q4_0): value = d * (q - 8), where
    d puts each block's value of largest magnitude exactly on the code -8 (GGUF's own rule)."""
    w = _check_blocks(w, 32)
    n, k = w.shape
    raw = torch.empty(n, k // 32, 18, dtype=torch.uint8)
    for r0 in range(0, n, 512):  # row chunks: the temporaries stay in cache (2x faster on a big head)
        blocks = w[r0 : r0 + 512].reshape(-1, k // 32, 32)
        extreme = torch.gather(blocks, -1, blocks.abs().argmax(-1, keepdim=True))  # signed
        d = (extreme / -8).half()
        inv = torch.where(d != 0, 1 / d.float(), torch.zeros(()))
        q = torch.round(blocks * inv).add_(8).clamp_(0, 15).to(torch.uint8)
        raw[r0 : r0 + 512, :, :2] = d.view(torch.uint8)
        raw[r0 : r0 + 512, :, 2:] = q[..., :16] | (q[..., 16:] << 4)
    return PackedWeight(Q4_0, raw.reshape(n, -1), (n, k))


def quantize_q4_k(w: torch.Tensor) -> PackedWeight:
    """Asymmetric 4-bit per 32 values, 6-bit scales and mins per 256 (GGUF Q4_K).

    value = d * sc[j] * q - dmin * m[j] for sub-block j. Scales and mins come from each
    sub-block's range (min clipped to <= 0 so the offset is representable); d and dmin are the
    largest of them divided by 63.
    """
    w = _check_blocks(w, 256)
    n, k = w.shape
    sub = w.reshape(n, k // 256, 8, 32)
    lo = sub.amin(-1).clamp(max=0)  # [n, nb, 8]
    hi = sub.amax(-1)
    scale = (hi - lo) / 15
    offset = -lo
    d = (scale.amax(-1, keepdim=True) / 63).half()
    dmin = (offset.amax(-1, keepdim=True) / 63).half()
    df, dminf = d.float(), dmin.float()
    sc = torch.where(df > 0, torch.round(scale / df.clamp(min=1e-30)), torch.zeros(())).clamp_(0, 63)
    mn = torch.where(dminf > 0, torch.round(offset / dminf.clamp(min=1e-30)), torch.zeros(())).clamp_(0, 63)
    step = (df * sc).unsqueeze(-1)  # [n, nb, 8, 1]
    shift = (dminf * mn).unsqueeze(-1)
    q = torch.where(step > 0, torch.round((sub + shift) / step.clamp(min=1e-30)), torch.zeros(())).clamp_(0, 15)
    q = q.to(torch.uint8)  # [n, nb, 8, 32]
    # qs: 4 chunks of 32 bytes; chunk c holds sub-block 2c in the low nibbles, 2c+1 in the high.
    qs = (q[:, :, 0::2] | (q[:, :, 1::2] << 4)).reshape(n, k // 256, 128)
    sc8, mn8 = sc.to(torch.uint8), mn.to(torch.uint8)
    packed = torch.empty(n, k // 256, 12, dtype=torch.uint8)
    packed[..., 0:4] = sc8[..., 0:4] | ((sc8[..., 4:8] >> 4) << 6)
    packed[..., 4:8] = mn8[..., 0:4] | ((mn8[..., 4:8] >> 4) << 6)
    packed[..., 8:12] = (sc8[..., 4:8] & 0xF) | ((mn8[..., 4:8] & 0xF) << 4)
    raw = torch.cat(
        (d.view(torch.uint8).reshape(n, -1, 2), dmin.view(torch.uint8).reshape(n, -1, 2), packed, qs), dim=-1
    )
    return PackedWeight(Q4_K, raw.reshape(n, -1).contiguous(), (n, k))


def requantize_4bit(pw: PackedWeight) -> PackedWeight:
    """The weight in 4-bit blocks: 4-bit formats (Q4_K, Q4_0, Q4_1) as they are, wider ones
    (Q5_0, Q6_K, Q8_0) decoded and requantized to Q4_K where rows split into 256-value
    super-blocks, else Q4_0."""
    return pw if pw.qtype in FOUR_BIT else quantize_4bit(pw.dequantize())


def quantize_4bit(w: torch.Tensor) -> PackedWeight:
    """Q4_K where rows split into 256-value super-blocks, else Q4_0 (32-value blocks)."""
    return quantize_q4_k(w) if w.shape[1] % 256 == 0 else quantize_q4_0(w)


def packed_from_gguf(raw: np.ndarray, qtype: int, shape: tuple[int, int]) -> PackedWeight:
    """Own a copy of a GGUF tensor's blocks (the file mapping is released after loading)."""
    values, nbytes = BLOCK_SHAPES[qtype]
    row_bytes = shape[1] // values * nbytes
    data = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True).reshape(-1)[: shape[0] * row_bytes])
    return PackedWeight(qtype, data.reshape(shape[0], row_bytes), shape)


def interleave_rows(pw: PackedWeight, paired: bool | None = None) -> tuple[int, torch.Tensor]:
    """(kernel qtype, data) for the kernel: the 8-row interleaved layout of Q4_K/Q6_K/Q8_0/Q5_0/
    Q4_0/Q4_1 weights whose row count is a multiple of 8 on an AVX2 build, with pairs of groups
    stored together (`PAIRED`) where the rows are a multiple of 16 and `paired` is true (default:
    where the build has the AVX-512 path); else the GGUF layout unchanged."""
    from specserve.kernels import kernels

    n, k = pw.shape
    if pw.qtype not in INTERLEAVED or n % 8 or not kernels().has_avx2():
        return pw.qtype, pw.data
    if paired is None:
        paired = kernels().has_avx512()
    paired = paired and n % 16 == 0
    data = kernels().interleave_rows(pw.data.contiguous(), pw.qtype, paired)
    return (PAIRED if paired else INTERLEAVED)[pw.qtype], data


def deinterleave_rows(qtype: int, data: torch.Tensor, shape: tuple[int, int], kernel_qtype: int | None = None) -> torch.Tensor:
    """The GGUF rows [n, bytes per row] back from interleave_rows' layout (`kernel_qtype`, default
    the unpaired one)."""
    n, k = shape
    g, nb = n // 8, k // BLOCK_SHAPES[qtype][0]
    if kernel_qtype == PAIRED[qtype]:  # [g / 2, nb, 2, B] -> [g, nb, B]
        data = data.view(g // 2, nb, 2, -1).permute(0, 2, 1, 3).reshape(g, -1)
    r = data.numpy().reshape(g, nb, -1)
    if qtype == Q8_0:
        qs = r[..., 16:272].reshape(g, nb, 8, 8, 4).transpose(0, 1, 3, 2, 4).reshape(g, nb, 8, 32)
        rows = np.concatenate([r[..., 0:16].reshape(g, nb, 8, 2), qs], axis=-1)
    elif qtype in (Q5_0, Q4_0, Q4_1):  # Q4_0: Q5_0 without the fifth bits; Q4_1: Q4_0 plus a min
        at = 32 if qtype == Q4_1 else 16
        q = r[..., at : at + 128].reshape(g, nb, 4, 8, 1, 4).transpose(0, 1, 3, 2, 4, 5)  # [.., row, i, 1, k]
        vals = np.concatenate([q & 0xF, q >> 4], axis=-2).reshape(g, nb, 8, 32)  # value 8i + 4h + k
        fields = [r[..., 0:16].reshape(g, nb, 8, 2)]
        if qtype == Q4_1:
            fields.append(r[..., 16:32].reshape(g, nb, 8, 2))
        if qtype == Q5_0:
            qh = r[..., 144:176].reshape(g, nb, 8, 1, 4)
            top = ((qh >> np.arange(8, dtype=np.uint8)[:, None]) & 1).reshape(g, nb, 8, 32)  # value 4v + k
            vals = vals | (top << 4)
            bits = (vals >> 4).reshape(g, nb, 8, 4, 8) << np.arange(8, dtype=np.uint8)
            fields.append(bits.sum(axis=-1, dtype=np.uint8))  # the uint32 of fifth bits, little-endian bytes
        fields.append((vals[..., :16] & 0xF) | ((vals[..., 16:] & 0xF) << 4))
        rows = np.concatenate(fields, axis=-1)
    elif qtype == Q4_K:
        d, dmin = r[..., 0:16].reshape(g, nb, 8, 2), r[..., 16:32].reshape(g, nb, 8, 2)
        mn = r[..., 32:96].reshape(g, nb, 4, 8, 2).transpose(0, 1, 3, 2, 4).reshape(g, nb, 8, 8)
        sub = r[..., 96:1184].reshape(g, nb, 8, 136)
        sc = sub[..., 0:8].transpose(0, 1, 3, 2)  # [.., row, sub-block]
        packed = np.empty((g, nb, 8, 12), dtype=np.uint8)
        packed[..., 0:4] = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
        packed[..., 4:8] = mn[..., 0:4] | ((mn[..., 4:8] >> 4) << 6)
        packed[..., 8:12] = (sc[..., 4:8] & 0xF) | ((mn[..., 4:8] & 0xF) << 4)
        vals = _unquads(sub[..., 8:136], g, nb).reshape(g, nb, 8, 4, 2, 32)  # value 64c + 32h + l
        qs = (vals[..., 0, :] | (vals[..., 1, :] << 4)).reshape(g, nb, 8, 128)
        rows = np.concatenate([d, dmin, packed, qs], axis=-1)
    else:
        d = r[..., 0:16].reshape(g, nb, 8, 2)
        chunk = r[..., 16:1680].reshape(g, nb, 8, 208)
        sc = chunk[..., 0:16].reshape(g, nb, 8, 8, 2).transpose(0, 1, 3, 2, 4).reshape(g, nb, 8, 16)
        low = _unquads(chunk[..., 16:144], g, nb)  # [g, nb, row, 256]
        qh = chunk[..., 144:208].reshape(g, nb, 8, 2, 8, 4).transpose(0, 1, 4, 2, 3, 5)  # [.., row, chunk, half, k]
        top = (qh[..., None, :] >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3  # [.., half, field, k]
        vals = low | (top.reshape(g, nb, 8, 256) << 4)
        # GGUF: half h of 128 values; ql[64h + l] low/high nibble = values 128h + l / + 64,
        # ql[64h + 32 + l] = values 128h + 32 + l / + 96; qh[32h + l] bits 2q = value 128h + 32q + l.
        v = vals.reshape(g, nb, 8, 2, 4, 32)
        ql = np.concatenate([(v[..., 0, :] & 0xF) | ((v[..., 2, :] & 0xF) << 4),
                             (v[..., 1, :] & 0xF) | ((v[..., 3, :] & 0xF) << 4)], axis=-1).reshape(g, nb, 8, 128)
        qh_out = ((v >> 4) << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(axis=-2, dtype=np.uint8).reshape(g, nb, 8, 64)
        rows = np.concatenate([ql, qh_out, sc, d], axis=-1)
    out = rows.transpose(0, 2, 1, 3).reshape(n, -1)
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.uint8))


def _unquads(b: np.ndarray, g: int, nb: int) -> np.ndarray:
    """[g, nb, chunk, 128] bytes [i][row][k] (low nibble value 32c + 8i + k, high nibble
    32c + 8i + 4 + k) -> [g, nb, row, 256] values."""
    q = b.reshape(g, nb, 8, 4, 8, 1, 4).transpose(0, 1, 4, 2, 3, 5, 6)  # [g, nb, row, chunk, i, 1, k]
    return np.concatenate([q & 0xF, q >> 4], axis=-2).reshape(g, nb, 8, 256)


def enable_native_ops(model: nn.Module) -> int:
    """Route a block-quantized float32 CPU model through the fused native calls.

    Per decoder layer: q/k/v in one call with RoPE applied in place, gate/up/SiLU-multiply in
    one call, both RMSNorms native. That is ~10 native calls per layer instead of ~40 torch ops,
    which matters when a whole 1.5B decode step is ~50 ms. Returns the number of modules switched.
    """
    from specserve.kernels import kernels
    from specserve.models.llama import MLP, Attention, LlamaModel, RMSNorm

    native = kernels()
    _weights_into_huge_pages(model)
    count = 0
    for module in model.modules():
        if isinstance(module, Attention):
            projs = (module.q_proj, module.k_proj, module.v_proj)
            if all(isinstance(p, BlockQuantLinear) for p in projs):
                module.native = native
                count += 1
        elif isinstance(module, MLP):
            if isinstance(module.gate_proj, BlockQuantLinear) and isinstance(module.up_proj, BlockQuantLinear):
                module.native = native
                count += 1
        elif isinstance(module, RMSNorm) and module.weight.dtype == torch.float32 and module.weight.device.type == "cpu":
            module.native = native
            count += 1
    for module in model.modules():
        if isinstance(module, LlamaModel):
            module.native_stack = layers_stack(list(module.layers), module.norm.eps, native)
    return count


def _weights_into_huge_pages(model: nn.Module) -> None:
    """Move every block-quantized weight of `model` into one huge-page-backed buffer."""
    from specserve.kernels import pack_into_huge_pages

    mods = [m for m in model.modules() if isinstance(m, BlockQuantLinear) and m.qweight.device.type == "cpu"]
    for m, w in zip(mods, pack_into_huge_pages([m.qweight for m in mods])):
        m.qweight = w


def layers_stack(layers: list[nn.Module], eps: float, native: object | None = None) -> object | None:
    """A native DecoderStack over these decoder layers, in order (their own tensors, not copies),
    or None when one has a float projection or norm: the same kernels as the layers' native ops in
    one call. A drafter's single layer uses it too (an EAGLE head's pass)."""
    if native is None:
        from specserve.kernels import kernels

        native = kernels()
    weights: list[torch.Tensor] = []
    qtypes: list[int] = []
    biases: list[torch.Tensor | None] = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        projs = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if not all(isinstance(p, BlockQuantLinear) for p in projs) or any(n.native is None for n in norms):
            return None
        q, k, v, o, gate, up, down = (p.qweight for p in projs)
        weights += [norms[0].weight.detach(), q, k, v, o, norms[1].weight.detach(), gate, up, down]
        qtypes += [p.kernel_qtype for p in projs]
        biases += [None if p.bias is None else p.bias.detach() for p in projs[:3]]
    if not weights:
        return None
    a = layers[0].self_attn
    return native.DecoderStack(weights, qtypes, biases, a.num_heads, a.num_kv_heads, a.head_dim, eps)


def partial_decoder_stack(model: nn.Module, layers: range) -> object | None:
    """A native DecoderStack over `layers` of a LlamaModel whose full stack is native (layer-skip
    drafting, early-exit features), sharing its weights; None when the model has no native stack."""
    if getattr(model, "native_stack", None) is None:
        return None
    return layers_stack([model.layers[i] for i in layers], model.norm.eps)
