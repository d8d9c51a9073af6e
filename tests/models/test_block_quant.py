"""The native block-quantized path: kernel vs reference decoder, quantizers, native ops, models.

The kernel rounds activations to int8 per block, so it is compared with a float32 matmul
against the exactly decoded weight with a tolerance derived from that rounding; everything
that must be exact (row independence, speculation on the fast path) is compared exactly.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.kernels import BLOCK_SHAPES, kernels
from specserve.models.block_linear import (
    INTERLEAVED,
    PAIRED,
    BlockEmbedding,
    BlockQuantLinear,
    PackedWeight,
    deinterleave_rows,
    interleave_rows,
    quantize_q4_0,
    quantize_q4_k,
    quantize_q8_0,
)

NAMES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 8: "Q8_0", 12: "Q4_K", 14: "Q6_K"}
# Byte offsets of the float16 scale fields in each block, set to sane values in random blocks.
HALF_FIELDS = {2: (0,), 3: (0, 2), 6: (0,), 8: (0,), 12: (0, 2), 14: (208,)}


def random_blocks(qtype: int, rows: int, cols: int, seed: int = 0) -> PackedWeight:
    """Random payload bytes (every bit pattern of the quantized fields), finite small scales."""
    values, nbytes = BLOCK_SHAPES[qtype]
    g = np.random.default_rng(seed)
    raw = g.integers(0, 256, size=(rows, cols // values, nbytes), dtype=np.uint8)
    for off in HALF_FIELDS[qtype]:
        scales = g.uniform(0.001, 0.02, size=(rows, cols // values)).astype(np.float16)
        raw[:, :, off : off + 2] = scales.view(np.uint8).reshape(rows, cols // values, 2)
    return PackedWeight(qtype, torch.from_numpy(raw.reshape(rows, -1).copy()), (rows, cols))


def _bound(x: torch.Tensor, w: torch.Tensor, block: int) -> torch.Tensor:
    """|error| bound of rounding x to int8 per block: sum over blocks of (d/2) * sum|w|."""
    m, k = x.shape
    d = x.reshape(m, k // block, block).abs().amax(-1) / 127  # [m, nb]
    wsum = w.abs().reshape(w.shape[0], k // block, block).sum(-1)  # [n, nb]
    return 0.5 * d @ wsum.T + 1e-4


@pytest.mark.parametrize("qtype", sorted(NAMES))
@pytest.mark.parametrize("m", [1, 3, 4, 7, 9])
@pytest.mark.parametrize("rows", [40, 44, 48])  # 40 rows are interleaved by 8, 44 stay rows, 48 may pair groups
def test_kernel_matches_decoded_weight(qtype, m, rows):
    pw = random_blocks(qtype, rows=rows, cols=512, seed=qtype)
    w = pw.dequantize()
    assert torch.isfinite(w).all()
    torch.manual_seed(m)
    x = torch.randn(m, 512)
    bias = torch.randn(rows)
    lin = BlockQuantLinear(pw, bias)
    assert (lin.kernel_qtype != qtype) == (qtype in INTERLEAVED and rows % 8 == 0 and kernels().has_avx2())
    y = lin(x)
    ref = x @ w.T + bias
    act_block = 256 if qtype in (12, 14) else 32
    err = (y - ref).abs()
    assert (err <= _bound(x, w, act_block)).all(), f"{NAMES[qtype]}: max error {err.max():.3g}"


@pytest.mark.parametrize("qtype", sorted(NAMES))
@pytest.mark.parametrize("rows", [70, 72, 80])
def test_each_row_is_independent_of_the_batch(qtype, rows):
    """Bit-identical results for a row alone and inside batches of any size (verify == decode ==
    prefill), across the activation tiles (4 rows for row layouts; register kernels for 1-4 rows
    and passes of 32 rows for interleaved layouts)."""
    pw = random_blocks(qtype, rows=rows, cols=1024, seed=7)
    lin = BlockQuantLinear(pw)
    x = torch.randn(70, 1024)
    full = lin(x)
    for i in (*range(11), 31, 32, 33, 69):
        assert torch.equal(lin(x[i : i + 1]), full[i : i + 1])
    for a, b in ((2, 7), (1, 10), (3, 7), (0, 33), (5, 70), (30, 35)):
        assert torch.equal(lin(x[a:b]), full[a:b]), (a, b)


@pytest.mark.parametrize("qtype", [12, 14])
def test_paired_group_passes_equal_one_group_passes(qtype):
    """An AVX2 build without VNNI runs passes of 8 or more activation rows over two 8-row Q4_K /
    Q6_K groups at once (each broadcast activation shared); every result is bit-identical to the
    one-group passes', for group counts even and odd (a last group alone) and any row count."""
    k = kernels()
    if not k.has_avx2() or k.has_vnni():
        pytest.skip("paired passes are the AVX2 (no VNNI) kernels' (test_vnni_kernels_are_bit_identical_to_the_avx2_ones covers them there)")
    before = k.pair_min_rows()
    assert before in (0, 8)  # 8 on AMD cores, 0 (off by default) on others
    try:
        for rows in (8, 24, 48, 136):
            lin = BlockQuantLinear(random_blocks(qtype, rows=rows, cols=1024, seed=rows), torch.randn(rows))
            x = torch.randn(40, 1024, generator=torch.Generator().manual_seed(rows)) * 2
            k.set_pair_min_rows(0)
            alone = [lin(x[:m]) for m in (1, 2, 3, 5, 9, 16, 17, 33, 40)]
            assert k.set_pair_min_rows(2) == 0  # from 2 rows, to cover every pass size
            for m, ref in zip((1, 2, 3, 5, 9, 16, 17, 33, 40), alone):
                assert torch.equal(lin(x[:m]), ref), (rows, m)
            assert torch.equal(lin(x)[7:8], lin(x[7:8]))  # a row inside a paired pass == the row alone (one group)
    finally:
        k.set_pair_min_rows(before)


@pytest.mark.parametrize("rows", [8, 24, 40, 136, 1000, 4104])
def test_every_tile_runs_once_whatever_the_thread_count(rows):
    """The threads split a product's 16-row tiles into owned shares and steal each other's last
    tiles: for any row count and thread count every output is written once, and the same as one
    thread's (a tile's arithmetic does not depend on who runs it), fused products included."""
    pw = random_blocks(12, rows=rows, cols=512, seed=rows)
    up = random_blocks(12, rows=rows, cols=512, seed=rows + 1)
    lin, lin_up = BlockQuantLinear(pw, torch.randn(rows)), BlockQuantLinear(up)
    k = kernels()
    before = torch.get_num_threads()
    try:
        results = {}
        for threads in (1, 2, 3, 5):
            torch.set_num_threads(threads)
            for m in (1, 9):
                x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
                fused = k.qmatmul_multi(x, [lin.qweight, lin_up.qweight], [lin.kernel_qtype, lin_up.kernel_qtype],
                                        [lin.bias, None], False)
                gated = k.qmatmul_multi(x, [lin.qweight, lin_up.qweight], [lin.kernel_qtype, lin_up.kernel_qtype],
                                        [None, None], True)
                got = (lin(x), fused, gated)
                assert all(torch.isfinite(t).all() for t in got)
                ref = results.setdefault(m, got)
                assert all(torch.equal(a, b) for a, b in zip(ref, got)), (threads, m)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("qtype", sorted(INTERLEAVED))
def test_interleaved_layout_round_trips_and_agrees_with_rows(qtype):
    """The 8-row layout holds exactly the file's information: it converts back byte for byte,
    and the kernel computes the same integers from it (only the float summation order differs)."""
    pw = random_blocks(qtype, rows=24, cols=768, seed=11)
    kq, data = interleave_rows(pw)
    extra = 1184 - 8 * 144 if qtype == 12 else 0  # Q4_K's scales are stored unpacked
    assert kq == INTERLEAVED[qtype] and data.numel() == pw.data.numel() + 3 * 768 // 256 * extra
    assert torch.equal(deinterleave_rows(qtype, data, pw.shape), pw.data)
    lin = BlockQuantLinear(pw)
    assert torch.equal(lin.packed().data, pw.data)
    x = torch.randn(6, 768)
    ref = BlockQuantLinear(pw, interleave=False)(x)  # float32 sums of the same integers, other order
    torch.testing.assert_close(lin(x), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("qtype", sorted(INTERLEAVED))
def test_rows_decode_just_the_rows_asked_from_every_layout(qtype):
    """BlockQuantLinear.rows (a learned draft id's row of a 150k-row head) equals the whole
    weight's rows for ids in any order, repeated, first and last, whatever layout the kernel
    reads: the file's, 8-row groups, pairs of groups."""
    pw = random_blocks(qtype, rows=48, cols=512, seed=3)
    whole = pw.dequantize()
    ids = torch.tensor([47, 0, 17, 16, 17, 31, 8, 40])
    layouts = [BlockQuantLinear(pw, interleave=False), BlockQuantLinear(pw)]
    if kernels().has_avx2():
        lin = BlockQuantLinear(pw, interleave=False)
        lin.kernel_qtype, data = interleave_rows(pw, paired=not kernels().has_avx512())  # the other form
        lin.qweight = data
        layouts.append(lin)
    assert {m.kernel_qtype for m in layouts} >= ({qtype, INTERLEAVED[qtype], PAIRED[qtype]} if kernels().has_avx2() else {qtype})
    for lin in layouts:
        assert torch.equal(lin.rows(ids), whole[ids]), lin.kernel_qtype
        assert lin.rows(ids[:0]).shape == (0, 512)


def test_fused_products_equal_separate_ones():
    """One call over several weights (row and interleaved layouts mixed, a segment whose row
    count is not a multiple of 8 first) equals the separate products bit for bit."""
    k = kernels()
    x = torch.randn(5, 512)
    parts = [random_blocks(12, 44, 512, 0), random_blocks(12, 64, 512, 1), random_blocks(14, 32, 512, 2),
             random_blocks(8, 32, 512, 3)]
    biases = [None, None, torch.randn(32), None]
    lins = [BlockQuantLinear(p, b) for p, b in zip(parts, biases)]
    assert [lin.kernel_qtype != lin.qtype for lin in lins] == [False] + [k.has_avx2()] * 3
    fused = k.qmatmul_multi(x, [m.qweight for m in lins], [m.kernel_qtype for m in lins], biases, False)
    assert torch.equal(fused, torch.cat([m(x) for m in lins], dim=1))
    g, u = BlockQuantLinear(random_blocks(12, 48, 512, 4)), BlockQuantLinear(random_blocks(12, 48, 512, 5))
    act = k.qmatmul_multi(x, [g.qweight, u.qweight], [g.kernel_qtype, u.kernel_qtype], [None, None], True)
    ref = torch.nn.functional.silu(g(x)) * u(x)
    torch.testing.assert_close(act, ref, rtol=1e-5, atol=1e-6)
    # 44 rows (row layout, a last tile of 12 columns: a padded tail), gates far out on both sides,
    # and every row's result independent of the others in the step
    g, u = BlockQuantLinear(random_blocks(12, 44, 512, 6)), BlockQuantLinear(random_blocks(12, 44, 512, 7))
    xs = torch.cat([x, 400 * x[:2], torch.zeros(1, 512)])
    act = k.qmatmul_multi(xs, [g.qweight, u.qweight], [g.kernel_qtype, u.kernel_qtype], [None, None], True)
    ref = torch.nn.functional.silu(g(xs)) * u(xs)
    assert g(xs)[5:7].abs().max() > 100  # exp(-g) over- and underflows somewhere here
    torch.testing.assert_close(act, ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item())
    for i in range(len(xs)):
        alone = k.qmatmul_multi(xs[i:i + 1], [g.qweight, u.qweight], [g.kernel_qtype, u.kernel_qtype], [None, None], True)
        assert torch.equal(alone, act[i:i + 1]), i


def test_the_kernel_builds_from_a_copy_in_its_cache_directory():
    """ninja compiles the copy of the source kept in the (content-keyed) build directory, so
    another checkout with the same source finds the same build command and does not rebuild."""
    import specserve.kernels as kmod

    kernels()
    build = kmod._build_dir()
    copy = build / kmod._SOURCE.name
    assert copy.read_bytes() == kmod._SOURCE.read_bytes()
    ninja = (build / "build.ninja").read_text()
    assert str(copy) in ninja and str(kmod._SOURCE) not in ninja


def test_bad_shapes_are_refused():
    pw = random_blocks(12, 8, 256)
    with pytest.raises(RuntimeError, match="not a multiple"):
        kernels().qmatmul(torch.randn(1, 100), pw.data, 12, None)
    with pytest.raises(RuntimeError, match="bytes per row"):
        kernels().qmatmul(torch.randn(1, 512), pw.data, 12, None)
    with pytest.raises(RuntimeError, match="unsupported"):
        kernels().qmatmul(torch.randn(1, 256), pw.data, 99, None)


@pytest.mark.parametrize(("quantize", "rel_rms"), [(quantize_q4_k, 0.12), (quantize_q4_0, 0.1), (quantize_q8_0, 0.01)])
def test_quantizers_round_trip(quantize, rel_rms):
    torch.manual_seed(0)
    w = torch.randn(64, 512) * 0.05
    w[3] = 0.0  # all-zero blocks must stay exactly zero
    w[5] = w[5].abs()  # all-positive blocks (zero min)
    pw = quantize(w)
    back = pw.dequantize()
    assert torch.equal(back[3], torch.zeros(512))
    err = ((back - w).pow(2).mean() / w.pow(2).mean()).sqrt()
    assert err < rel_rms
    # and the kernel multiplies by exactly what the blocks decode to
    x = torch.randn(2, 512)
    act_block = 256 if pw.qtype == 12 else 32
    assert ((BlockQuantLinear(pw)(x) - x @ back.T).abs() <= _bound(x, back, act_block)).all()
    assert ((BlockQuantLinear(pw, interleave=False)(x) - x @ back.T).abs() <= _bound(x, back, act_block)).all()


def test_native_rms_norm_and_rope_match_torch():
    from specserve.models.llama import RMSNorm, RotaryEmbedding

    k = kernels()
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    x = torch.randn(5, 64)
    ref = norm(x)
    norm.native = k
    torch.testing.assert_close(norm(x), ref, rtol=1e-5, atol=1e-6)

    rope = RotaryEmbedding(16, 10000.0, 100)
    pos = torch.tensor([0, 3, 99, 7])
    qkv = torch.randn(4, 6 * 16)
    q, kk = qkv[:, :64].view(4, 4, 16), qkv[:, 64:].view(4, 2, 16)
    rq, rk = rope(pos, q.clone(), kk.clone())
    k.rope_(q, kk, rope.cos, rope.sin, pos)
    torch.testing.assert_close(q, rq, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kk, rk, rtol=1e-5, atol=1e-6)


def _attention_step(query_lens, starts, tables, tail_masks, bs, nblocks, n_kv, heads, d):
    """A paged cache holding each request's earlier context and this step's keys, the step's
    metadata and random queries: (q, k_cache, v_cache, meta)."""
    from specserve.attention import build_attention_metadata, write_kv

    kc, vc = torch.zeros(nblocks, bs, n_kv, d), torch.zeros(nblocks, bs, n_kv, d)
    meta = build_attention_metadata(query_lens, starts, tables, bs, torch.device("cpu"), tail_masks=tail_masks)
    for s0, table in zip(starts, tables):
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(s0)], dtype=torch.long)
        write_kv(torch.randn(s0, n_kv, d), torch.randn(s0, n_kv, d), kc, vc, slots, None)
    t = sum(query_lens)
    write_kv(torch.randn(t, n_kv, d), torch.randn(t, n_kv, d), kc, vc, meta.slot_mapping, None)
    return torch.randn(t, heads, d), kc, vc, meta


def test_native_paged_attention_matches_sdpa_path():
    """Decode and verify shapes, GQA, several requests, a tree mask: same as the gather + SDPA path."""
    from specserve.attention import paged_attention

    torch.manual_seed(0)
    d = 16
    tree = torch.ones(5, 5, dtype=torch.bool).tril()
    tree[3, 1] = False  # a draft branch that must not see token 1
    q, kc, vc, meta = _attention_step([1, 5, 3], [9, 0, 14], [[3, 7, 1], [2, 5], [8, 9, 10, 11, 12]],
                                      [None, tree, None], bs=4, nblocks=32, n_kv=2, heads=6, d=d)
    ref = paged_attention(q, kc, vc, meta, d**-0.5)
    out = kernels().paged_attention(q, kc, vc, meta.block_tables, meta.attn_mask, meta.query_index, d**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_native_attention_of_a_token_does_not_depend_on_its_step():
    """Tokens of a prefill or a draft go through their keys in tiles (and a prefill's items in
    another order than a decode batch's): every token's output must still be bit-identical to
    the same token computed alone (its own mask row, one-token step), whatever the head size."""
    torch.manual_seed(1)
    tree = torch.ones(5, 5, dtype=torch.bool).tril()
    tree[3, 1] = tree[4, 1] = False  # a branch that must not see node 1
    for d, heads, n_kv in [(16, 6, 2), (64, 9, 3), (128, 12, 2)]:
        # a prefill, a draft tree, a decode and a long chunk after some context
        q, kc, vc, meta = _attention_step([37, 5, 1, 300], [0, 20, 41, 40],
                                          [[3, 7, 1], [2, 5], [8, 9, 10, 11], list(range(12, 35))],
                                          [None, tree, None, None], bs=16, nblocks=48, n_kv=n_kv, heads=heads, d=d)
        t = q.shape[0]
        step = kernels().paged_attention(q, kc, vc, meta.block_tables, meta.attn_mask, meta.query_index, d**-0.5)
        for i in list(range(0, t, 7)) + [t - 1]:
            b, r = divmod(int(meta.query_index[i]), meta.attn_mask.shape[2])
            alone = kernels().paged_attention(q[i : i + 1], kc, vc, meta.block_tables[b : b + 1],
                                              meta.attn_mask[b : b + 1, :, r : r + 1], torch.zeros(1, dtype=torch.long), d**-0.5)
            assert torch.equal(alone[0], step[i]), (d, i)


@pytest.mark.parametrize(("heads", "n_kv", "d"), [(9, 3, 64), (12, 2, 128), (6, 2, 24), (4, 2, 12)])
def test_native_attention_reads_a_float16_cache_as_its_widened_values(heads, n_kv, d):
    """A float16 cache widens exactly as it loads: bit for bit what a float32 cache holding the
    same rounded values gives (AVX-512 and 256-bit loads, and the scalar loop for d = 12), for
    decode, tree and prefill rows; and close to the gather + SDPA path over the same cache."""
    from specserve.attention import paged_attention

    torch.manual_seed(3)
    tree = torch.ones(5, 5, dtype=torch.bool).tril()
    tree[3, 1] = False
    q, kc, vc, meta = _attention_step([1, 5, 40], [300, 20, 0], [list(range(20)), [20, 21], [22, 23, 24]],
                                      [None, tree, None], bs=16, nblocks=26, n_kv=n_kv, heads=heads, d=d)
    kh, vh = kc.half(), vc.half()
    args = (meta.block_tables, meta.attn_mask, meta.query_index, d**-0.5)
    half = kernels().paged_attention(q, kh, vh, *args)
    assert torch.equal(half, kernels().paged_attention(q, kh.float(), vh.float(), *args))
    torch.testing.assert_close(half, paged_attention(q, kh, vh, meta, d**-0.5), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="float32, float16 or int8 caches"):  # k and v of one type
        kernels().paged_attention(q, kh, vc, *args)


@pytest.mark.parametrize(("heads", "n_kv", "d"), [(9, 3, 64), (12, 2, 128), (6, 2, 24), (4, 2, 12)])
def test_native_attention_reads_an_int8_cache_with_its_scales(heads, n_kv, d):
    """An int8 cache (values and a float32 scale per slot and KV head) attends close to the gather
    + dequantize + SDPA path over the same cache, and each token's output is bit-identical to the
    same token alone; caches without scales, or scales without an int8 cache, are refused."""
    from specserve.attention import paged_attention, quantize_kv

    torch.manual_seed(4)
    tree = torch.ones(5, 5, dtype=torch.bool).tril()
    tree[3, 1] = False
    q, kc, vc, meta = _attention_step([1, 5, 40], [300, 20, 0], [list(range(20)), [20, 21], [22, 23, 24]],
                                      [None, tree, None], bs=16, nblocks=26, n_kv=n_kv, heads=heads, d=d)
    (k8, ks), (v8, vs) = quantize_kv(kc), quantize_kv(vc)
    args = (meta.block_tables, meta.attn_mask, meta.query_index, d**-0.5)
    out = kernels().paged_attention(q, k8, v8, *args, ks, vs)
    torch.testing.assert_close(out, paged_attention(q, k8, v8, meta, d**-0.5, (ks, vs)), rtol=1e-4, atol=1e-5)
    for i in (0, 3, 20, q.shape[0] - 1):
        b, r = divmod(int(meta.query_index[i]), meta.attn_mask.shape[2])
        alone = kernels().paged_attention(q[i : i + 1], k8, v8, meta.block_tables[b : b + 1],
                                          meta.attn_mask[b : b + 1, :, r : r + 1], torch.zeros(1, dtype=torch.long), d**-0.5, ks, vs)
        assert torch.equal(alone[0], out[i]), i
    with pytest.raises(RuntimeError, match="scales with \\(only\\) an int8 cache"):
        kernels().paged_attention(q, k8, v8, *args)
    with pytest.raises(RuntimeError, match="scales with \\(only\\) an int8 cache"):
        kernels().paged_attention(q, kc, vc, *args, ks, vs)


def test_native_decode_attention_split_by_work_keeps_each_token_exact():
    """A decode batch is split between threads where the keys to read are halved (a long
    request beside short ones no longer runs all its heads on one thread): each token's output
    is still bit-identical to the token alone, for any thread count."""
    torch.manual_seed(2)
    d, heads, n_kv = 64, 9, 3
    lens = [700, 3, 40, 1, 250, 9]
    tables, nxt = [], 0
    for n in lens:
        blocks = -(-(n + 1) // 16)
        tables.append(list(range(nxt, nxt + blocks)))
        nxt += blocks
    q, kc, vc, meta = _attention_step([1] * len(lens), lens, tables, [None] * len(lens), bs=16, nblocks=nxt, n_kv=n_kv,
                                      heads=heads, d=d)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            step = kernels().paged_attention(q, kc, vc, meta.block_tables, meta.attn_mask, meta.query_index, d**-0.5)
            for i in range(len(lens)):
                alone = kernels().paged_attention(q[i : i + 1], kc, vc, meta.block_tables[i : i + 1],
                                                  meta.attn_mask[i : i + 1], torch.zeros(1, dtype=torch.long), d**-0.5)
                assert torch.equal(alone[0], step[i]), (threads, i)
    finally:
        torch.set_num_threads(before)


def test_native_attention_shares_a_lone_verify_tile_between_threads_exactly():
    """A lone request's draft (2-9 tokens, a tree among them) after a long context is split
    between threads by key splits like a decode step (SmolLM2's three KV heads left one thread
    two of them), as are two requests' drafts in one step, and tokens' shared keys go through the
    side kernels where a tile has 3+ tokens and 12+ query rows: every token's output stays
    bit-identical to the token alone, on 1-3 threads, for a float16 and an int8 cache, and close
    to a float64 reference."""
    from specserve.attention import paged_attention, quantize_kv

    torch.manual_seed(6)
    tree = torch.ones(5, 5, dtype=torch.bool).tril()
    tree[3, 1] = tree[4, 1] = False
    before = torch.get_num_threads()
    try:
        for d, heads, n_kv in [(64, 9, 3), (128, 12, 2)]:
            for lens, masks in [([2], [None]), ([3], [None]), ([5], [tree]), ([9], [None]), ([5, 3], [tree, None])]:
                # splits end at 1,024 and 2,048 keys: the drafts' tokens straddle the second
                starts = [2100 + n + 7 * i for i, n in enumerate(lens)]
                tables, nxt = [], 0
                for s0, n in zip(starts, lens):
                    blocks = -(-(s0 + n) // 16)
                    tables.append(list(range(nxt, nxt + blocks)))
                    nxt += blocks
                q, kc, vc, meta = _attention_step(lens, starts, tables, masks, bs=16, nblocks=nxt, n_kv=n_kv, heads=heads, d=d)
                (k8, ks), (v8, vs) = quantize_kv(kc), quantize_kv(vc)
                args = (meta.block_tables, meta.attn_mask, meta.query_index, d**-0.5)
                ref = paged_attention(q.double(), kc.double(), vc.double(), meta, d**-0.5).float()
                for cache in ((kc.half(), vc.half()), (k8, v8, ks, vs)):
                    k_, v_, *scales = cache
                    outs = []
                    for threads in (1, 2, 3):
                        torch.set_num_threads(threads)
                        outs.append(kernels().paged_attention(q, k_, v_, *args, *scales))
                        for i in range(q.shape[0]):
                            b, r = divmod(int(meta.query_index[i]), meta.attn_mask.shape[2])
                            alone = kernels().paged_attention(q[i : i + 1], k_, v_, meta.block_tables[b : b + 1],
                                                              meta.attn_mask[b : b + 1, :, r : r + 1],
                                                              torch.zeros(1, dtype=torch.long), d**-0.5, *scales)
                            assert torch.equal(alone[0], outs[-1][i]), (d, lens, threads, i)
                    assert all(torch.equal(outs[0], o) for o in outs)
                    if not scales:
                        torch.testing.assert_close(outs[1], ref, rtol=2e-3, atol=2e-3)
    finally:
        torch.set_num_threads(before)


def test_native_attention_over_long_contexts_merges_key_splits_exactly():
    """Past kAttnSplitKeys (1,024) keys a token's softmax and value sums run in splits merged in
    order, and a decode step shares one long request's splits between threads. Each token's
    output stays bit-identical to the token alone and across thread counts (the shared splits
    merged after the threads), in decode batches, a lone long request and a verify tile after a
    long context; and close to a float64 reference (split boundaries at 1,024 / 1,025 / 2,048 keys
    and several splits per token). An int8 cache's splits carry their scales."""
    from specserve.attention import paged_attention, quantize_kv

    torch.manual_seed(5)
    before = torch.get_num_threads()
    try:
        for d, heads, n_kv in [(64, 9, 3), (128, 12, 2)]:
            lens = [2600, 3, 1023, 1024, 1, 4100, 2047]
            tables, nxt = [], 0
            for n in lens:
                blocks = -(-(n + 1) // 16)
                tables.append(list(range(nxt, nxt + blocks)))
                nxt += blocks
            q, kc, vc, meta = _attention_step([1] * len(lens), lens, tables, [None] * len(lens), bs=16, nblocks=nxt,
                                              n_kv=n_kv, heads=heads, d=d)
            ref = paged_attention(q.double(), kc.double(), vc.double(), meta, d**-0.5).float()
            args = (meta.block_tables, meta.attn_mask, meta.query_index, d**-0.5)
            outs = {}
            for threads in (1, 2, 3, 4):
                torch.set_num_threads(threads)
                outs[threads] = kernels().paged_attention(q, kc, vc, *args)
                for i in range(len(lens)):
                    alone = kernels().paged_attention(q[i : i + 1], kc, vc, meta.block_tables[i : i + 1],
                                                      meta.attn_mask[i : i + 1], torch.zeros(1, dtype=torch.long), d**-0.5)
                    assert torch.equal(alone[0], outs[threads][i]), (d, threads, i)
            assert all(torch.equal(outs[1], o) for o in outs.values())
            torch.testing.assert_close(outs[2], ref, rtol=1e-5, atol=2e-6)
            (k8, ks), (v8, vs) = quantize_kv(kc), quantize_kv(vc)  # an int8 cache: scales split with their keys
            q8 = {t: (torch.set_num_threads(t), kernels().paged_attention(q, k8, v8, *args, ks, vs))[1] for t in (1, 2, 3)}
            assert torch.equal(q8[1], q8[2]) and torch.equal(q8[1], q8[3])
            torch.testing.assert_close(q8[2], paged_attention(q, k8, v8, meta, d**-0.5, (ks, vs)), rtol=1e-4, atol=1e-5)
            # a 9-token verify tile after 2,500 keys and a lone decode at 3,000: each row as alone
            q, kc, vc, meta = _attention_step([9, 1], [2500, 3000], [list(range(160)), list(range(160, 350))], [None, None],
                                              bs=16, nblocks=350, n_kv=n_kv, heads=heads, d=d)
            torch.set_num_threads(2)
            step = kernels().paged_attention(q, kc, vc, meta.block_tables, meta.attn_mask, meta.query_index, d**-0.5)
            torch.testing.assert_close(step, paged_attention(q.double(), kc.double(), vc.double(), meta, d**-0.5).float(),
                                       rtol=1e-5, atol=2e-6)
            for i in range(q.shape[0]):
                b, r = divmod(int(meta.query_index[i]), meta.attn_mask.shape[2])
                alone = kernels().paged_attention(q[i : i + 1], kc, vc, meta.block_tables[b : b + 1],
                                                  meta.attn_mask[b : b + 1, :, r : r + 1], torch.zeros(1, dtype=torch.long), d**-0.5)
                assert torch.equal(alone[0], step[i]), (d, i)
    finally:
        torch.set_num_threads(before)


# ----------------------------------------------------------------------------- models


def _greedy(n=16):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def smol_auto(smollm_path):
    return LLM(smollm_path, quantization="auto", kv_cache_gib=0.25, profile_spec_costs=False)


def test_auto_keeps_the_files_blocks(smol_auto):
    """SmolLM2's GGUF is Q4_1 with a Q8_0 embedding: every linear layer keeps those blocks."""
    model = smol_auto.engine.runner.model
    lins = [m for m in model.modules() if isinstance(m, BlockQuantLinear)]
    assert len(lins) == 30 * 7 + 1
    assert {m.qtype for m in lins} == {3, 8}  # Q4_1 layers, tied Q8_0 head
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert model.model.layers[0].mlp.native is not None


def test_hot_products_time_the_first_layers_products_from_cache(smol_auto, smollm_llm, monkeypatch):
    """time_hot_products: best-of seconds of the model's first block-quantized products (up to
    HOT_TUNE_BYTES of weights) at n rows, after a pass that brings them into cache; NaN where
    the model has none (float weights)."""
    import specserve.engine.runner as runner_mod

    runner = smol_auto.engine.runner
    seen = []
    real = BlockQuantLinear.forward

    def forward(self, x):
        seen.append((self.weight_nbytes, x.shape[0]))
        return real(self, x)

    monkeypatch.setattr(BlockQuantLinear, "forward", forward)
    t = runner.time_hot_products(3, repeats=2)
    assert 0 < t < 1.0
    per_pass = len(seen) // 3  # one untimed pass and two timed ones, each over the same products
    assert len(seen) == 3 * per_pass and {rows for _, rows in seen} == {3}
    nbytes = [b for b, _ in seen[:per_pass]]
    assert sum(nbytes[:-1]) < runner_mod.HOT_TUNE_BYTES <= sum(nbytes)  # stops once past it
    assert math.isnan(smollm_llm.engine.runner.time_hot_products(3))


@pytest.mark.parametrize("qtype", sorted(NAMES))
def test_a_block_embedding_looks_up_the_rows_the_decoded_table_holds(qtype):
    """BlockEmbedding decodes only the rows a lookup reads, to the same float32 values as the
    whole table; ids of any shape; an id outside the table raises IndexError as nn.Embedding does."""
    pw = random_blocks(qtype, 40, 512, seed=qtype)
    table = pw.dequantize()
    emb = BlockEmbedding(pw)
    ids = torch.tensor([[3, 0, 39], [7, 7, 12]])
    assert torch.equal(emb(ids), torch.nn.functional.embedding(ids, table))
    assert emb(ids[:1, :0]).shape == (1, 0, 512)
    assert torch.equal(emb.rows(5), table[:5]) and torch.equal(emb.weight, table)
    assert BlockEmbedding(pw, torch.float16)(ids).dtype == torch.float16
    for bad in ([40], [-1]):
        with pytest.raises(IndexError):
            emb(torch.tensor(bad))


def test_auto_keeps_the_embedding_in_blocks(smol_auto, smollm_checkpoint):
    """On `auto` the embedding table stays in the file's Q8_0 blocks (a quarter of its float32
    bytes here, a seventh for the Qwen 1.5B's Q4_K) and a lookup gives the float rows exactly."""
    emb = smol_auto.engine.runner.model.model.embed_tokens
    assert isinstance(emb, BlockEmbedding) and emb.qtype == 8
    table = smollm_checkpoint.weights["model.embed_tokens.weight"]
    assert emb.weight_nbytes * 3 < table.numel() * 4
    ids = torch.tensor([0, 1, 17, 4242, table.shape[0] - 1])
    assert torch.equal(emb(ids), table[ids])


def test_auto_logprobs_close_to_float(smollm_path, smollm_checkpoint, smollm_llm):
    """Quality cost of computing from the file's blocks with int8 activations: bounded log-prob change.

    The float path decodes the same Q4_1 blocks to float32, so the only difference is the
    kernel's activation rounding (and the native attention's summation order). Along a
    teacher-forced greedy continuation: mean |delta log p| of the forced token < 0.05 nats and
    top-1 agreement >= 90% (measured: see the printed line).
    """
    from test_quantization import _teacher_forced_logprobs

    from specserve.models.loader import load_model_files

    tok = smollm_checkpoint.tokenizer
    prompt = tok.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
    forced = smollm_llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0].token_ids
    ref = _teacher_forced_logprobs(smollm_checkpoint, "none", prompt, forced)
    blocks = load_model_files(smollm_path, keep_blocks=True)
    q = _teacher_forced_logprobs(blocks, "auto", prompt, forced)
    idx = torch.tensor(forced)[:, None]
    diff = (q.gather(1, idx) - ref.gather(1, idx)).abs().squeeze(1)
    agree = (q.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"auto vs fp32: mean |dlogp|={diff.mean():.4f} max={diff.max():.4f} argmax agreement={agree:.3f}")
    assert diff.mean().item() < 0.05, diff
    assert agree >= 0.9


@pytest.mark.parametrize("which", ["ngram", "draft"])
def test_speculation_stays_exact_on_the_fast_path(smollm_path, smol_auto, which):
    prompts = [
        "Write one sentence about the sea.",
        "def add(a, b):",
        "Repeat after me: red green blue, red green blue, red green blue,",
        "1 2 3 4 5 6 7 8 9",
        "Rewrite with better names:\ndef f(x, y):\n    z = x + y\n    return z\n",
    ]
    base = smol_auto.generate(prompts, _greedy())
    kw = dict(draft_model=smollm_path, draft_num_layers=20) if which == "draft" else {}
    llm = LLM(smollm_path, quantization="auto", kv_cache_gib=0.25, spec_method=which, spec_policy="always",
              profile_spec_costs=False, **kw)
    outs = llm.generate(prompts, _greedy())
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    assert llm.generate(prompts[2], _greedy())[0].token_ids == base[2].token_ids  # alone
    assert llm.engine.spec_counters["num_accepted_tokens"] > 0
    assert llm.engine.check_integrity()
    if which == "draft":  # the draft defaulted to int4: its Q8_0 head became Q4_0, Q4_1 layers stayed
        draft = llm.engine.proposer.runner
        assert draft.quantization == "int4"
        assert {m.qtype for m in draft.model.modules() if isinstance(m, BlockQuantLinear)} == {2, 3}


def test_int4_keeps_4bit_blocks_and_requantizes_wider_ones(smollm_path, smol_auto):
    """--quantization int4 on a GGUF: 4-bit blocks (SmolLM2's Q4_1 layers) byte for byte as the
    file has them, the tied Q8_0 head requantized to Q4_0 (576 columns do not split into Q4_K's
    256s). The 4-bit head is a real quality cost on a 135M model: along a teacher-forced greedy
    continuation the forced tokens' log-probs moved by 0.20 nats on average from the file's own
    precision, top-1 agreement 0.81 (which is why int4 is a default only for drafts, whose
    precision moves the acceptance rate, not the output)."""
    from test_quantization import _teacher_forced_logprobs

    from specserve.models.loader import load_model_files

    q4 = LLM(smollm_path, quantization="int4", kv_cache_gib=0.25, profile_spec_costs=False)
    lins = {n: m for n, m in q4.engine.runner.model.named_modules() if isinstance(m, BlockQuantLinear)}
    ref = {n: m for n, m in smol_auto.engine.runner.model.named_modules() if isinstance(m, BlockQuantLinear)}
    assert lins.keys() == ref.keys()
    assert {n for n, m in lins.items() if m.qtype == 2} == {"lm_head"}
    for n, m in lins.items():
        if n != "lm_head":
            assert m.qtype == 3 and torch.equal(m.qweight, ref[n].qweight), n
    assert lins["lm_head"].weight_nbytes <= ref["lm_head"].weight_nbytes * 18 // 34
    tok = q4.engine.tokenizer
    prompt = tok.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
    forced = smol_auto.generate([prompt], _greedy(32))[0].token_ids
    blocks = load_model_files(smollm_path, keep_blocks=True)
    ref = _teacher_forced_logprobs(blocks, "auto", prompt, forced)
    got = _teacher_forced_logprobs(blocks, "int4", prompt, forced)
    idx = torch.tensor(forced)[:, None]
    diff = (got.gather(1, idx) - ref.gather(1, idx)).abs().squeeze(1)
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"int4 vs auto: mean |dlogp|={diff.mean():.4f} max={diff.max():.4f} argmax agreement={agree:.3f}")
    assert diff.mean().item() < 0.3 and agree >= 0.75


def test_int4_quantizes_a_float_model(tiny_qwen2):
    """--quantization int4 on float weights: Q4_K where rows split into 256s, else Q4_0, each
    matrix within 4-bit rounding of the float one. (The random tiny model's logits are too
    sensitive to compare: 4-bit weights move them ~25-60%, int8 ones ~2%.)"""
    _, ckpt = tiny_qwen2
    q4 = LLM("tiny", dtype="float32", checkpoint=ckpt, quantization="int4")
    lins = {n: m for n, m in q4.engine.runner.model.named_modules() if isinstance(m, BlockQuantLinear)}
    assert lins and all(m.qtype in (2, 12) for m in lins.values())
    for name, m in lins.items():
        w = ckpt.weights[f"{name}.weight"]
        assert ((m.dequantized_weight() - w).norm() / w.norm()).item() < 0.1, name
    b = q4.generate([[5, 6, 7, 8]], _greedy(8))[0]
    assert len(b.token_ids) == 8 and all(0 <= t < ckpt.arch.vocab_size for t in b.token_ids)


@pytest.mark.parametrize(("spec", "kv_dtype"), [("none", "fp32"), ("ngram", "fp32"), ("ngram", "auto"), ("ngram", "int8")])
def test_native_decoder_stack_is_bit_identical_to_the_module_path(tiny_qwen2, spec, kv_dtype):
    """The one-call DecoderStack (q/k/v biases, interleaved Q4_K/Q8_0, batched prefill, decode and
    verify steps) gives exactly the module path's log-probs, and the module path is what runs
    when the stack is removed; with a float16 cache too (the stack rounds the keys and values it
    writes as torch's .to(float16) does) and an int8 one (it quantizes as attention.quantize_kv)."""
    _, ckpt = tiny_qwen2
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11], [3, 4, 3, 4, 3, 4, 3, 4]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=True)
    llm = LLM("tiny", dtype="float32", checkpoint=ckpt, quantization="int4", spec_method=spec, spec_policy="always",
              profile_spec_costs=False, kv_cache_dtype=kv_dtype)
    # auto: float16 on these kernels (specserve.defaults.native_cpu_model)
    assert llm.engine.runner.kv_caches[0][0].dtype == {"auto": torch.float16, "int8": torch.int8}.get(kv_dtype, torch.float32)
    model = llm.engine.runner.model.model
    assert model.native_stack is not None and model.native_stack.num_layers == len(model.layers)
    fast = llm.generate(prompts, params)
    stack, model.native_stack = model.native_stack, None
    slow = llm.generate(prompts, params)
    model.native_stack = stack
    for a, b in zip(fast, slow):
        assert a.token_ids == b.token_ids
        assert a.outputs[0].logprobs and a.outputs[0].logprobs == b.outputs[0].logprobs  # exact, not approximately
    assert llm.engine.check_integrity()


def test_native_decoder_stack_refuses_bad_input(tiny_qwen2):
    _, ckpt = tiny_qwen2
    llm = LLM("tiny", dtype="float32", checkpoint=ckpt, quantization="int4")
    runner = llm.engine.runner
    stack = runner.model.model.native_stack
    hidden = runner.arch.hidden_size
    kv = [t for pair in runner.kv_caches for t in pair]
    one = torch.zeros(1, dtype=torch.long)
    mask = torch.ones(1, 1, 1, 1, dtype=torch.bool)
    rope = runner.model.model.rotary
    with pytest.raises(RuntimeError, match="one \\(k, v\\) cache pair per layer"):
        stack.forward(torch.zeros(1, hidden), one, rope.cos, rope.sin, kv[:-2], one, one[None], mask, one, 1.0)
    with pytest.raises(RuntimeError, match="outside the cache"):
        stack.forward(torch.zeros(1, hidden), one, rope.cos, rope.sin, kv, one + 10**9, one[None], mask, one, 1.0)


@pytest.mark.parametrize("qtype", sorted(INTERLEAVED))
def test_paired_groups_give_the_unpaired_bits_for_any_pass_width(qtype):
    """Two 8-row groups stored block by block (the layout the AVX-512 passes read) hold the same
    information and give exactly the x8 layout's products, for every number of activation rows and
    every row count from which passes go 512 bits wide (where the build has them; the 256-bit
    kernels over both groups everywhere else)."""
    k = kernels()
    if not k.has_avx2():
        pytest.skip("interleaved layouts need the AVX2 build")
    pw = random_blocks(qtype, 48, 512, seed=qtype + 1)
    k8, d8 = interleave_rows(pw, paired=False)
    k16, d16 = interleave_rows(pw, paired=True)
    assert (k8, k16) == (INTERLEAVED[qtype], PAIRED[qtype]) and d16.shape[0] == 3 and d16.numel() == d8.numel()
    assert torch.equal(deinterleave_rows(qtype, d16, pw.shape, k16), pw.data)
    assert interleave_rows(random_blocks(qtype, 40, 512), paired=True)[0] == INTERLEAVED[qtype]  # 5 groups: not paired
    old = k.set_wide_min_rows(1)
    try:
        for m in (1, 2, 3, 4, 5, 9, 32, 33, 40):
            x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)) * 3
            ref = k.qmatmul(x, d8, k8)
            for wide in (1, 4, 33):
                k.set_wide_min_rows(wide)
                assert torch.equal(k.qmatmul(x, d16, k16), ref), (m, wide)
    finally:
        k.set_wide_min_rows(max(old, 1))
    with pytest.raises(RuntimeError, match="one activation row or more"):
        k.set_wide_min_rows(0)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        k.interleave_rows(random_blocks(qtype, 40, 512).data, qtype, True)


@pytest.mark.parametrize("qtype", sorted(INTERLEAVED))
def test_passes_of_every_row_count_equal_their_rows_alone(qtype):
    """Passes of 5-15 activation rows run a kernel compiled for that row count (16 and more share
    one loop): every count must give each row exactly what it gets alone."""
    k = kernels()
    if not k.has_avx2():
        pytest.skip("interleaved layouts need the AVX2 build")
    kq, data = interleave_rows(random_blocks(qtype, 40, 1024, seed=qtype), paired=False)
    assert kq == INTERLEAVED[qtype]
    x = torch.randn(18, 1024, generator=torch.Generator().manual_seed(qtype)) * 3
    alone = torch.cat([k.qmatmul(x[i : i + 1], data, kq) for i in range(18)])
    for m in range(1, 19):
        assert torch.equal(k.qmatmul(x[:m], data, kq), alone[:m]), m


def test_prefill_sized_products_equal_their_rows_in_small_batches():
    """A product of many rows whose activations exceed the L2 runs in sweeps of rows over the weight
    tiles; every row must come out exactly as in a small batch (plain and fused SiLU-gated forms,
    interleaved and paired layouts, sweeps that do not divide the rows)."""
    k = kernels()
    for qtype in (12, 14):  # Q4_K, Q6_K: what a Q4_K_M file's projections are
        kq, data = interleave_rows(random_blocks(qtype, 48, 8192, seed=qtype))
        x = torch.randn(300, 8192, generator=torch.Generator().manual_seed(qtype)) * 3
        assert torch.equal(k.qmatmul(x, data, kq), torch.cat([k.qmatmul(x[i : i + 20], data, kq) for i in range(0, 300, 20)]))
        fused = k.qmatmul_multi(x, [data, data], [kq, kq], [None, None], True)
        parts = [k.qmatmul_multi(x[i : i + 20], [data, data], [kq, kq], [None, None], True) for i in range(0, 300, 20)]
        assert torch.equal(fused, torch.cat(parts))


def test_amx_passes_are_bit_identical_to_the_512_bit_ones():
    """Where the CPU has AMX (and the kernel grants the tiles), wide passes over Q4_K take the tile
    unit; every row's products must be exactly those of the 512-bit kernel, whatever the number
    of activation rows (one tile half or two, a tail pass beside a full one) and wherever the
    threshold lies, so logits never depend on the batch shape."""
    k = kernels()
    with pytest.raises(RuntimeError, match="0 \\(never\\) or a positive number"):
        k.set_amx_min_rows(-1)
    if not k.has_amx():
        assert k.amx_min_rows() == 0
        pytest.skip("this CPU (or its kernel) offers no AMX tiles: the 512-bit kernels are the only ones")
    assert k.amx_min_rows() >= 1
    kq, data = interleave_rows(random_blocks(12, 96, 1024, seed=3), paired=True)
    assert kq == PAIRED[12]
    old = k.set_amx_min_rows(0)
    try:
        for m in (1, 2, 5, 9, 16, 17, 24, 31, 32, 33, 40, 48, 64, 75):
            x = torch.randn(m, 1024, generator=torch.Generator().manual_seed(m)) * 3
            k.set_amx_min_rows(0)
            ref = k.qmatmul(x, data, kq)
            for start in (1, 9, 24):
                k.set_amx_min_rows(start)
                assert torch.equal(k.qmatmul(x, data, kq), ref), (m, start)
    finally:
        k.set_amx_min_rows(old)


def test_native_argmax_is_torchs_on_ties_nan_and_infinities():
    """Greedy decoding takes each logits row's argmax from the kernel: it must be torch.argmax's
    answer for any row (the first of equal values, the first NaN where there is one, rows of every
    length around the 32-value vector loop, strided rows), and row_argmax must fall back to torch
    for what the kernel does not take."""
    from specserve.kernels import row_argmax

    k = kernels()
    g = torch.Generator().manual_seed(11)
    for n in (1, 2, 7, 31, 32, 33, 63, 64, 65, 95, 1000, 151936):
        for case in ("random", "ties", "all -inf", "nan", "nan first", "zeros and -0", "inf twice", "last"):
            x = torch.randn(3, n, generator=g)
            if case == "ties":
                x = torch.randint(-2, 2, (3, n), generator=g).float()
            elif case == "all -inf":
                x[:] = float("-inf")
            elif case == "nan":
                x[:, (n * 2) // 3] = float("nan")
                x[:, n // 2] = 1e30
            elif case == "nan first":
                x[:, 0] = float("nan")
            elif case == "zeros and -0":
                x = torch.where(torch.rand(3, n, generator=g) < 0.5, torch.tensor(0.0), torch.tensor(-0.0))
            elif case == "inf twice":
                x[:, n // 3] = x[:, n // 2] = float("inf")
            elif case == "last":
                x[:, -1] = 1e9
            assert torch.equal(k.argmax_rows(x), x.argmax(-1)), (n, case)
            assert torch.equal(row_argmax(x), x.argmax(-1)), (n, case)
    x = torch.randn(6, 500, generator=g)
    assert torch.equal(k.argmax_rows(x[::2]), x[::2].argmax(-1))  # rows apart in memory
    assert k.argmax_rows(x[:0]).shape == (0,)
    for other in (x.double(), x.t(), x[0]):  # float64, strided values, one dimension: torch's answer
        assert torch.equal(row_argmax(other), other.argmax(dim=-1))
    with pytest.raises(RuntimeError, match="argmax_rows"):
        k.argmax_rows(x.t())


def test_vnni_kernels_are_bit_identical_to_the_avx2_ones(tmp_path):
    """Where the CPU has AVX512-VNNI the interleaved kernels use vpdpbusd; an AVX2-only build of
    the same source must give exactly the same products (so results never depend on the CPU's
    extensions, and the exactness arguments made for the AVX2 kernels carry over). So must its
    attention, whose AVX-512 build runs 512 bits wide."""
    if not kernels().has_vnni():
        pytest.skip("this CPU has no AVX512-VNNI: only the AVX2 kernels exist here")
    from torch.utils import cpp_extension

    from specserve.attention import quantize_kv
    from specserve.kernels import _SOURCE, _ninja_on_path

    _ninja_on_path()
    avx2 = cpp_extension.load(name="specserve_qmatmul_avx2_only", sources=[str(_SOURCE)], build_directory=str(tmp_path),
                              extra_cflags=["-O3", "-march=native", "-mno-avx512vnni", "-fopenmp"], extra_ldflags=["-fopenmp"])
    assert not avx2.has_vnni()
    for qtype in sorted(INTERLEAVED):
        for paired in (False, True):  # paired: 512-bit passes from 4 rows where this CPU has AVX-512
            kq, data = interleave_rows(random_blocks(qtype, 64, 512, seed=qtype), paired=paired)
            for m in (1, 3, 4, 5, 8, 9, 33):
                x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)) * 3
                assert torch.equal(avx2.qmatmul(x, data, kq), kernels().qmatmul(x, data, kq)), (qtype, paired, m)
    x = torch.randint(-3, 3, (4, 151936), generator=torch.Generator().manual_seed(2)).float()
    assert torch.equal(avx2.argmax_rows(x), kernels().argmax_rows(x))
    # Attention: on AVX-512 the scores take two keys per 512-bit register and the values 16 columns,
    # each key's and column's arithmetic that of the 256-bit kernels.
    g = torch.Generator().manual_seed(5)
    for hq, hkv, d in ((9, 3, 64), (12, 2, 128), (4, 4, 8), (10, 2, 24), (8, 2, 16)):
        for t, n_keys in ((1, 37), (2, 300), (9, 300), (17, 70)):
            blocks = n_keys // 16 + 3
            kc, vc = (torch.randn(blocks, 16, hkv, d, generator=g) for _ in range(2))
            perm = torch.randperm(blocks, generator=g)
            tables = torch.stack([perm, perm.roll(1)]).to(torch.int64)
            mask = torch.rand(2, 1, t, n_keys, generator=g) < 0.8
            mask[..., 0] = True
            q = torch.randn(2 * t, hq, d, generator=g)
            index = torch.arange(2 * t, dtype=torch.int64)
            (k8, ks), (v8, vs) = quantize_kv(kc), quantize_kv(vc)
            for kv in ((kc, vc), (kc.half(), vc.half()), (k8, v8, ks, vs)):
                assert torch.equal(avx2.paged_attention(q, *kv[:2], tables, mask, index, 0.1, *kv[2:]),
                                   kernels().paged_attention(q, *kv[:2], tables, mask, index, 0.1, *kv[2:])), (hq, hkv, d, t, n_keys, kv[0].dtype)


def test_march_override_builds_elsewhere_and_refuses_junk(monkeypatch):
    """$SPECSERVE_MARCH (x86-64-v3: the AVX2 kernels an AVX2-only CPU runs) gets its own build
    directory, so it never loads the native build's binary; a value that is not a -march target is a
    configuration error naming the variable, before any compiler runs."""
    from specserve.errors import ConfigError
    from specserve.kernels import _build_dir, _march

    monkeypatch.delenv("SPECSERVE_MARCH", raising=False)
    native = _build_dir()
    assert _march() == "native"
    monkeypatch.setenv("SPECSERVE_MARCH", "x86-64-v3")
    assert _march() == "x86-64-v3" and _build_dir() != native
    monkeypatch.setenv("SPECSERVE_MARCH", " ")
    assert _build_dir() == native
    for junk in ("native -O0", "x86;rm", "-mavx2"):
        monkeypatch.setenv("SPECSERVE_MARCH", junk)
        with pytest.raises(ConfigError, match="SPECSERVE_MARCH"):
            _march()


def test_prefetch_distance_changes_speed_not_results(monkeypatch):
    """Software prefetch is a hint: any distance (0 = off) gives the same bits, out-of-range
    distances are refused, and a bad $SPECSERVE_PREFETCH is a clear configuration error."""
    k = kernels()
    if not k.has_avx2():
        pytest.skip("prefetch lives in the AVX2 kernels")
    old = k.set_prefetch_distance(2048)
    old_multi = k.set_prefetch_distance(8192, multi_row=True)
    try:
        cases = [interleave_rows(random_blocks(q, 64, 512, seed=q)) for q in sorted(INTERLEAVED)]
        cases += [(q, random_blocks(q, 64, 512, seed=q).data) for q in sorted(NAMES)]
        for kq, data in cases:
            x = torch.randn(5, 512, generator=torch.Generator().manual_seed(kq))
            ref = k.qmatmul(x, data, kq)
            for dist in (0, 64, 100_000, 1 << 20):
                for multi_row in (False, True):
                    k.set_prefetch_distance(dist, multi_row)
                    assert torch.equal(k.qmatmul(x, data, kq), ref), (kq, dist, multi_row)
                    assert torch.equal(k.qmatmul(x[:1], data, kq), ref[:1]), (kq, dist, multi_row)
            k.set_prefetch_distance(2048)
            k.set_prefetch_distance(8192, multi_row=True)
        with pytest.raises(RuntimeError, match="prefetch distance"):
            k.set_prefetch_distance(-1)
        with pytest.raises(RuntimeError, match="prefetch distance"):
            k.set_prefetch_distance((1 << 20) + 1)
        with pytest.raises(RuntimeError, match="prefetch distance"):
            k.set_prefetch_distance(-1, multi_row=True)
    finally:
        k.set_prefetch_distance(old)
        k.set_prefetch_distance(old_multi, multi_row=True)

    from specserve.errors import ConfigError
    from specserve.kernels import _prefetch_from_env

    for bad in ("fast", "-5", "99999999", "1024,", "1024,2048,4096", "1024,-1"):
        monkeypatch.setenv("SPECSERVE_PREFETCH", bad)
        with pytest.raises(ConfigError, match="SPECSERVE_PREFETCH"):
            _prefetch_from_env(k)
    monkeypatch.setenv("SPECSERVE_PREFETCH", "4096")  # one value pins both distances
    _prefetch_from_env(k)
    assert k.set_prefetch_distance(old) == 4096 and k.set_prefetch_distance(old_multi, multi_row=True) == 4096
    monkeypatch.setenv("SPECSERVE_PREFETCH", "3072,12288")  # one-row, multi-row
    _prefetch_from_env(k)
    assert k.set_prefetch_distance(old) == 3072 and k.set_prefetch_distance(old_multi, multi_row=True) == 12288
    monkeypatch.setenv("SPECSERVE_PREFETCH", "auto")  # the default: measured by the first large model
    _prefetch_from_env(k)
    assert k.set_prefetch_distance(old) == old and k.set_prefetch_distance(old_multi, multi_row=True) == old_multi


class _FakePrefetchKernels:
    """Stands in for the kernel module: records the prefetch distance it is given."""

    def __init__(self) -> None:
        self.distance = 2048
        self.multi_distance = 8192
        self.history: list[tuple[int, bool]] = []

    def has_avx2(self) -> bool:
        return True

    def set_prefetch_distance(self, bytes_ahead: int, multi_row: bool = False) -> int:
        if multi_row:
            old, self.multi_distance = self.multi_distance, bytes_ahead
        else:
            old, self.distance = self.distance, bytes_ahead
        self.history.append((bytes_ahead, multi_row))
        return old


def test_prefetch_tuning_keeps_the_fastest_distance_once_per_process(monkeypatch):
    """tune_prefetch times every candidate distance (interleaved rounds, best time each) on a
    1-token forward for one-row passes and on a multi-token forward for multi-row passes, keeps
    the fastest of each, and runs once per process; a pinned $SPECSERVE_PREFETCH, a model too
    small to stream from memory, or a step that cannot be timed (NaN) leave the distances alone."""
    import specserve.kernels as kmod

    fake = _FakePrefetchKernels()
    monkeypatch.setattr(kmod, "kernels", lambda: fake)
    monkeypatch.setattr(kmod, "_prefetch_tuned", {})
    monkeypatch.delenv("SPECSERVE_PREFETCH", raising=False)
    big = kmod.PREFETCH_TUNE_MIN_BYTES
    calls = []

    def step(tokens: int) -> float:
        """One-token forwards are fastest at 3072 bytes, multi-token ones at 12288 (each run only
        by its own distance); the first timing of every setting is slower (noise)."""
        setting = (tokens, fake.distance if tokens == 1 else fake.multi_distance)
        calls.append(setting)
        best = 3072 if tokens == 1 else 12288
        return abs(setting[1] - best) / 1e6 + 0.01 * tokens + (0.05 if calls.count(setting) == 1 else 0.0)

    # pinned or small: nothing timed, nothing changed
    monkeypatch.setenv("SPECSERVE_PREFETCH", "1024")
    assert kmod.tune_prefetch(step, big) is None
    monkeypatch.setenv("SPECSERVE_PREFETCH", "auto")
    assert kmod.tune_prefetch(step, big - 1) is None
    assert calls == [] and fake.history == []
    # a step that cannot be timed: the distance goes back to what it was
    assert kmod.tune_prefetch(lambda tokens: float("nan"), big) is None
    assert (fake.distance, fake.multi_distance) == (2048, 8192) and kmod.prefetch_tuning() == {}

    assert kmod.tune_prefetch(step, big, rounds=2) == 3072
    assert (fake.distance, fake.multi_distance) == (3072, 12288)
    assert sorted({d for n, d in calls if n == 1}) == sorted(kmod.PREFETCH_CANDIDATES)
    assert sorted({d for n, d in calls if n > 1}) == sorted(kmod.PREFETCH_MULTI_CANDIDATES)
    assert {n for n, _ in calls} == {1, *kmod.PREFETCH_MULTI_TOKENS}
    info = kmod.prefetch_tuning()
    assert info["distance"] == 3072 and set(info["step_ms"]) == set(kmod.PREFETCH_CANDIDATES)
    assert info["multi_row_distance"] == 12288 and set(info["multi_row_step_ms"]) == set(kmod.PREFETCH_MULTI_CANDIDATES)
    assert all(len(ms) == len(kmod.PREFETCH_MULTI_TOKENS) for ms in info["multi_row_step_ms"].values())
    n = len(calls)
    assert kmod.tune_prefetch(step, big) is None and len(calls) == n  # once per process


def test_the_multi_row_distance_is_the_one_fastest_over_its_small_forwards_together(monkeypatch):
    """The multi-row distance is timed on forwards of each of PREFETCH_MULTI_TOKENS and chosen by
    the least sum of each forward's time over its fastest distance's: a distance 30% slower on
    one forward loses to one 2% slower on the other (as 4 KiB against 8 KiB on a Zen 4's 2-token
    forwards, where the 8-token forward alone could not tell them apart)."""
    import specserve.kernels as kmod

    fake = _FakePrefetchKernels()
    monkeypatch.setattr(kmod, "kernels", lambda: fake)
    monkeypatch.setattr(kmod, "_prefetch_tuned", {})
    monkeypatch.delenv("SPECSERVE_PREFETCH", raising=False)
    few = kmod.PREFETCH_MULTI_TOKENS[0]

    def step(tokens: int) -> float:
        if tokens == 1:
            return 0.025
        d = fake.multi_distance
        if tokens == few:  # fastest at 8 KiB, 4 KiB 30% slower
            return 0.025 * (1.3 if d == 4096 else 1.0 if d == 8192 else 1.1)
        return 0.040 * (1.0 if d == 4096 else 1.02 if d == 8192 else 1.1)  # 4 KiB fastest by 2%

    kmod.tune_prefetch(step, kmod.PREFETCH_TUNE_MIN_BYTES)
    assert fake.multi_distance == 8192
    ms = kmod.prefetch_tuning()["multi_row_step_ms"]
    assert ms[4096] == [32.5, 40.0] and ms[8192] == [25.0, 40.8]


class _FakeWideKernels:
    """Stands in for the kernel module: records from how many rows passes go 512 bits wide."""

    def __init__(self, avx512: bool = True) -> None:
        self.avx512 = avx512
        self.rows = 4

    def has_avx512(self) -> bool:
        return self.avx512

    def set_wide_min_rows(self, rows: int) -> int:
        old, self.rows = self.rows, rows
        return old


@pytest.mark.parametrize("wins_from, chosen", [(4, 4), (2, 2), (1, 1), (None, 33), ("6 but not 8", 33)])
def test_wide_pass_tuning_keeps_the_smallest_width_that_wins_from_there_on(monkeypatch, wins_from, chosen):
    """tune_wide_passes times 256- and 512-bit passes per candidate width and keeps the smallest
    width from which the 512-bit pass wins at every larger candidate (or never); once per
    process, only with the AVX-512 path and a model large enough to stream from memory."""
    import specserve.kernels as kmod

    fake = _FakeWideKernels()
    monkeypatch.setattr(kmod, "kernels", lambda: fake)
    monkeypatch.setattr(kmod, "_wide_tuned", {})
    big = kmod.PREFETCH_TUNE_MIN_BYTES
    calls = []

    def step(n: int) -> float:
        calls.append(n)
        wide = fake.rows <= n
        wins = wins_from == "6 but not 8" and n == 6 or isinstance(wins_from, int) and n >= wins_from
        return 0.01 * n * (0.8 if wide == wins else 1.0) + (0.05 if calls.count(n) <= 2 else 0.0)  # first round noisier

    assert kmod.tune_wide_passes(step, big - 1) is None and calls == []
    fake.avx512 = False
    assert kmod.tune_wide_passes(step, big) is None and calls == []
    fake.avx512 = True
    assert kmod.tune_wide_passes(lambda n: float("nan"), big) is None and fake.rows == 4
    assert kmod.tune_wide_passes(step, big, rounds=2) == chosen and fake.rows == chosen
    info = kmod.wide_tuning()
    assert info["min_rows"] == chosen and set(info["ratio"]) == set(kmod.WIDE_CANDIDATES)
    n = len(calls)
    assert kmod.tune_wide_passes(step, big) is None and len(calls) == n  # once per process


@pytest.mark.parametrize("forward, hot, chosen", [
    ({}, {2: 0.8, 3: 0.8, 4: 0.8}, 2),  # forwards even (memory-bound), the 512-bit pass computes faster: it goes from 2
    ({}, {}, 5),  # even everywhere but from 5 (the forward rule alone)
    ({2: 1.05}, {2: 0.8, 3: 0.8, 4: 0.8}, 3),  # its 2-row forward 5% slower: not there, whatever it computes
    ({3: 1.02}, {2: 0.8, 3: 0.8, 4: 0.8}, 2),  # 2% slower is within the margin
    ({}, {2: 1.2, 3: 0.8, 4: 0.8}, 3),  # computes slower at 2 rows
    ({}, {1: 0.8, 2: 0.8, 3: 0.8, 4: 0.8}, 2),  # one row: the forward alone decides (its pass is the read)
])
def test_wide_passes_that_compute_faster_win_where_forwards_wait_on_memory(monkeypatch, forward, hot, chosen):
    """A forward in a slow memory phase times the 256- and 512-bit passes even at 2-4 rows (the
    read hides the arithmetic; a 2-vCPU Zen 4 chose 512 bits from 4 or 5 there and from 2 in a
    fast phase, where the 256-bit passes cost 8-16% more). Timed in cache too, the 512-bit pass
    wins where it computes faster and its forward is not slower beyond the margin."""
    import specserve.kernels as kmod

    fake = _FakeWideKernels()
    monkeypatch.setattr(kmod, "kernels", lambda: fake)
    monkeypatch.setattr(kmod, "_wide_tuned", {})

    def step(n: int) -> float:  # forwards: the 512-bit pass 20% faster from 5 rows, else even (unless `forward` says)
        wide = fake.rows <= n
        return 0.03 * (1.0 if not wide else forward.get(n, 0.8 if n >= 5 else 1.0))

    def in_cache(n: int) -> float:
        wide = fake.rows <= n
        return 0.001 * n * (1.0 if not wide else hot.get(n, 0.8 if n >= 5 else 1.0))

    assert kmod.tune_wide_passes(step, kmod.PREFETCH_TUNE_MIN_BYTES, time_hot=in_cache) == chosen and fake.rows == chosen
    info = kmod.wide_tuning()
    assert set(info["hot_ratio"]) == set(kmod.WIDE_CANDIDATES)


def test_weights_move_into_one_huge_page_buffer_unchanged():
    """pack_into_huge_pages: exact copies, each on its own page of one 2 MiB-aligned buffer; the
    quantized linears of a model built with native ops read from it and give the same products."""
    from specserve.kernels import HUGE_PAGE, pack_into_huge_pages

    ts = [torch.randint(0, 256, (n, 40), dtype=torch.uint8) for n in (1, 7, 300)] + [torch.randn(5, 3)]
    moved = pack_into_huge_pages(ts)
    for a, b in zip(ts, moved):
        assert torch.equal(a, b) and b.is_contiguous() and b.data_ptr() % 4096 == 0
    base = moved[0].untyped_storage().data_ptr()
    assert all(m.untyped_storage().data_ptr() == base for m in moved)  # one allocation
    assert moved[0].data_ptr() % HUGE_PAGE == 0
    assert pack_into_huge_pages([]) == []

    from specserve.models.block_linear import _weights_into_huge_pages

    model = torch.nn.Sequential(BlockQuantLinear(random_blocks(12, 16, 512)), BlockQuantLinear(random_blocks(14, 24, 512)))
    x = torch.randn(3, 512)
    before = [m(x) for m in model]
    _weights_into_huge_pages(model)
    assert model[0].qweight.untyped_storage().data_ptr() == model[1].qweight.untyped_storage().data_ptr()
    assert all(torch.equal(m(x), b) for m, b in zip(model, before))


def test_a_build_killed_midway_does_not_block_the_next_start(tmp_path):
    """torch's `lock` file left by a killed compile is stale once we hold the OS lock; a live
    builder's lock makes the next one wait instead."""
    import fcntl
    import threading

    from specserve.kernels import _build_lock

    (tmp_path / "lock").touch()  # what a build killed by Ctrl-C leaves behind
    with _build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
        entered = threading.Event()

        def second_builder():
            with _build_lock(tmp_path):
                entered.set()

        t = threading.Thread(target=second_builder)
        t.start()
        assert not entered.wait(0.3)  # flock is per open file: a second open waits for the first
    t.join(5)
    assert entered.is_set()
    with open(tmp_path / ".specserve-build.lock") as fh:  # released: a non-blocking lock succeeds
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_kernel_builds_unused_for_a_month_are_removed_and_live_ones_kept(tmp_path):
    """Each source version, torch or CPU builds into a directory of its own; a fresh build removes
    the ones no process has loaded for KEEP_UNUSED_BUILDS_S, except one another process holds."""
    import fcntl
    import os
    import time

    from specserve.kernels import KEEP_UNUSED_BUILDS_S, _build_lock, _prune_old_builds

    now = time.time()
    old_time = now - KEEP_UNUSED_BUILDS_S - 86400

    def build(name, mtime):
        d = tmp_path / name
        d.mkdir()
        (d / "specserve_qmatmul.so").write_bytes(b"x" * 100)
        lock = d / ".specserve-build.lock"
        lock.touch()
        os.utime(lock, (mtime, mtime))
        os.utime(d / "specserve_qmatmul.so", (mtime, mtime))
        return d

    current = build("current", old_time)  # the one being loaded: never removed, whatever its age
    build("old", old_time)
    recent, held = build("recent", now - 86400), build("held", old_time)
    empty = tmp_path / "empty"  # a directory a killed start left without a lock file
    empty.mkdir()
    os.utime(empty, (old_time, old_time))
    (tmp_path / "note.txt").write_text("not a build")
    os.utime(tmp_path / "note.txt", (old_time, old_time))
    with open(held / ".specserve-build.lock", "a") as fh:  # another process building or loading there
        fcntl.flock(fh, fcntl.LOCK_EX)
        removed = _prune_old_builds(current, now=now)
    assert sorted(p.name for p in removed) == ["empty", "old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["current", "held", "note.txt", "recent"]
    with _build_lock(recent):  # a load rewrites the lock: the directory counts as used now
        pass
    assert (recent / ".specserve-build.lock").stat().st_mtime >= now - 1
    assert _prune_old_builds(current, now=now + KEEP_UNUSED_BUILDS_S - 3600) == [held]  # released: old and unused, it goes too


def test_blocks_under_a_float_quantization_run_as_float_and_speculation_stays_exact(smollm_path):
    """A checkpoint that kept its GGUF blocks, served with --quantization none: float weights
    holding the blocks' values, so every step shape computes alike. (Blocks beside torch's
    attention let the kernels' int8 rounding turn ~1e-7 differences between a decode step and a
    verify pass into different tokens: greedy n-gram speculation left plain decoding at the 7th
    token of the first of these prompts.)"""
    from specserve.models.loader import load_model_files

    blocks = load_model_files(smollm_path, keep_blocks=True)
    kw = dict(checkpoint=blocks, quantization="none", dtype="float32", kv_cache_gib=0.25, profile_spec_costs=False)
    plain = LLM(smollm_path, **kw)
    model = plain.engine.runner.model
    assert not any(isinstance(m, BlockQuantLinear) for m in model.modules())
    x = torch.randn(3, blocks.arch.hidden_size)
    w = blocks.packed["model.layers.0.mlp.gate_proj.weight"].dequantize()
    torch.testing.assert_close(model.model.layers[0].mlp.gate_proj(x), x @ w.T, rtol=1e-5, atol=1e-5)
    tok = blocks.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in (
        "Tell me about the history of the bicycle in a few paragraphs.",
        "Why do leaves change colour in autumn? Explain it simply.",
        "Write a Python function `merge_intervals(intervals)` that merges overlapping intervals. Include a docstring.",
    )]
    params = SamplingParams(max_tokens=48, temperature=0)
    base = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = LLM(smollm_path, spec_method="ngram", spec_policy="always", num_spec_tokens=6, **kw)
    assert [o.token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == base
    assert spec.engine.spec_counters["num_draft_tokens"] > 0


def test_every_compiled_kernel_prefetches_the_weights_it_will_read():
    """Each block kernel the build holds asks for the cache lines ahead of it (prefetcht*).

    A decode step streams the weights from memory; the kernels' software prefetches are what keep
    the core from waiting on them (a 1.5B step 47 -> 37-40 ms on a 2-vCPU Xeon). Written as loops of
    _mm_prefetch with nothing else in them, GCC 12 dropped them from every kernel of builds whose
    source moved them a little (session 76: three experimental builds ran every pass as if nothing
    were prefetched); they are volatile asm now (prefetch_line). A build that loses them still
    computes the same numbers, so only the machine code shows it."""
    import re
    import shutil
    import subprocess

    k = kernels()
    if not k.has_avx2():
        pytest.skip("the block kernels prefetch in the AVX2 and wider builds")
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) is not installed")
    text = subprocess.run([objdump, "-d", "--no-show-raw-insn", "-C", k.__file__], capture_output=True, text=True,
                          check=True).stdout
    prefetches: dict[str, int] = {}
    current = None
    for line in text.splitlines():
        if line.endswith(">:"):
            m = re.search(r"\(anonymous namespace\)::(dot_q\w+(?:<[^>]*>)?)\(", line)
            current = m.group(1) if m else None
            if current is not None:
                prefetches.setdefault(current, 0)
        elif current is not None and "prefetcht" in line:
            prefetches[current] += 1
    if not prefetches:
        pytest.skip("the compiler inlined every block kernel into its callers: no symbol to inspect")
    assert any(name.startswith("dot_q4_k") for name in prefetches), sorted(prefetches)
    assert not [name for name, n in prefetches.items() if n == 0], sorted(prefetches.items())
