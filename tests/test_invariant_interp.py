"""Batch invariance of the GEMM, the norms and fixed-split decode attention under the Triton interpreter
(docs/batch-invariance.md).

Why: a batch-invariant mode needs each row's result to be the same bits whatever rows come with it. Here a few
fixed rows are computed alone (M = 1) and then inside batches of M = 7, 63 and 200 random rows, at the batch's
first, middle and last row (so at other places in a row tile, and in another tile at 200), and must come out
equal bit for bit; so do decode attention rows in the fixed-split mode (`split_size`), alone and among 7 and 63
random rows; each is also checked against the torch reference within a stated tolerance. The interpreter
checks the kernels' tiling, loops and masks (what a change of tile by M would break); that a tensor-core dot
treats every row of a tile alike is a property of the GPU, checked by tests/test_invariant_gpu.py (the GEMM and
norms; the attention has no GPU test yet). So is a reduction's tree: the interpreter's tl.sum is numpy's, and one
merge tile over all splits gave the bits of a fold of smaller tiles unless the running max moved between the tiles
(the attention targets make it move). Run with
`TRITON_INTERPRET=1 python -m pytest tests/test_invariant_interp.py`; skipped otherwise, as
tests/test_kernels_interp.py (whose interpreter caveats hold: bf16 conversions truncate).
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("set TRITON_INTERPRET=1 to run the Triton interpreter tests", allow_module_level=True)
pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's numpy use

from bench.measure.kernel_inputs import paged_copy
from kvtransfer.kernels import ops as K
from kvtransfer.kernels import triton_attention_split as tas
from kvtransfer.kernels.reference import decode_attention_split_ref
from kvtransfer.kernels.triton_attention import default_num_splits

BATCHES = [7, 63, 200]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# K 160: two full 64-deep steps and a partial one for 2-byte inputs (five 32-deep ones for fp32); N 200: a full
# and a partial 128-column tile.
IN_F, OUT_F = 160, 200
SIGNIFICAND = {torch.bfloat16: 8, torch.float16: 11}


def _places(m: int) -> list[int]:
    return [0, m // 2, m - 1]


def _in_batches(targets: torch.Tensor, seed: int):
    """(M, x) for each M in BATCHES: M random rows with targets[j] at row _places(M)[j]."""
    gen = torch.Generator().manual_seed(seed)
    for m in BATCHES:
        x = (torch.randn(m, targets.shape[1], generator=gen) * 2).to(targets.dtype)
        x[_places(m)] = targets
        yield m, x


def _check_ref(out: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b) -> None:
    """The stated tolerance, per element: |out - ref| <= 2 K 2^-24 (|x| @ |w|^T + |b|), the error bound of two fp32
    sums of K + 1 terms in any orders (here they differ only in order), plus, for 2-byte outputs, 1 ulp of the
    reference element in its dtype (2^(exponent - significand + 1): the two sums may round apart, and the
    interpreter truncates to bf16)."""
    r = ref.float()
    err = (out.float() - r).abs()
    mags = x.float().abs() @ w.float().abs().T + (0 if b is None else b.float().abs())
    bound = 2 * (x.shape[1] + 1) * 2.0 ** -24 * mags
    if ref.dtype != torch.float32:
        exp = torch.floor(torch.log2(r.abs().clamp_min(2.0 ** -14)))
        bound += torch.exp2(exp - (SIGNIFICAND[ref.dtype] - 1))
    assert (err <= bound).all(), f"max error {(err / bound).max().item():.2f} x the bound"


def _cancelling(w: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Make the targets' sums round: products of bf16 values are exact in fp32 and sums of a few hundred randn-sized
    ones mostly exact too, so any order would give the same bits and the test could not see a changed order. Each
    target gets 4096 at k = 3 and at k = 100 (another 64-deep step), and w[:, 100] = -w[:, 3] ~ 1000: two products of
    ~4e6 that cancel, with the small terms between them added at 4e6's fp32 ulp (0.25), and a result of ~2.
    Returns (w, targets) in w's dtype (all values fit fp16)."""
    big = w.float().clone()
    big[:, 3] = (big[:, 3] * 1000).clamp(-30000, 30000)
    big[:, 100] = -big[:, 3]
    targets = targets.clone()
    targets[:, 3] = targets[:, 100] = 4096.0
    return big.to(w.dtype), targets.to(w.dtype)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_row_is_the_same_in_any_batch(dtype, bias):
    gen = torch.Generator().manual_seed(31)
    w = torch.randn(OUT_F, IN_F, generator=gen).to(dtype)
    b = torch.randn(OUT_F, generator=gen).to(dtype) if bias else None
    w, targets = _cancelling(w, torch.randn(3, IN_F, generator=gen) * 0.25)
    alone = torch.cat([K.invariant_linear(t[None], w, b, use_triton=True) for t in targets])  # M = 1 each
    assert alone.shape == (3, OUT_F) and alone.dtype == dtype
    _check_ref(alone, K.invariant_linear(targets, w, b, use_triton=False), targets, w, b)
    for m, x in _in_batches(targets, seed=32):
        out = K.invariant_linear(x, w, b, use_triton=True)
        assert torch.equal(out[_places(m)], alone), f"M={m}: a row changed with its batch"
        _check_ref(out, K.invariant_linear(x, w, b, use_triton=False), x, w, b)


def test_matmul_strided_rows_and_empty_batch():
    gen = torch.Generator().manual_seed(33)
    w = torch.randn(OUT_F, IN_F, generator=gen).to(torch.bfloat16)
    wide = torch.randn(9, IN_F + 24, generator=gen).to(torch.bfloat16)  # x as a view of a wider buffer
    x = wide[:, :IN_F]
    assert not x.is_contiguous()
    out = K.invariant_linear(x, w, use_triton=True)
    assert torch.equal(out, K.invariant_linear(x.contiguous(), w, use_triton=True))
    assert torch.equal(out[4:5], K.invariant_linear(x[4:5], w, use_triton=True))
    assert K.invariant_linear(x[:0], w, use_triton=True).shape == (0, OUT_F)


# rtol = atol, as tests/test_kernels_interp.py; bf16 wider: over 200 rows the interpreter's two truncations (of h
# and of the output, each up to 1 ulp, 2^-7 relative) beside the reference's two roundings reach 2.3% here.
NORM_TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("hidden", [100, 1536])
@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_row_is_the_same_in_any_batch(dtype, hidden):
    """The RMSNorm and the fused add + RMSNorm (kernels/triton_norm.py: one program per row, its block and warps
    from the hidden size alone): a row's normed output and residual sum do not depend on the batch."""
    gen = torch.Generator().manual_seed(34)
    w = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    targets = (torch.randn(3, hidden, generator=gen) * 3).to(dtype)
    res_targets = torch.randn(3, hidden, generator=gen).to(dtype)
    alone = torch.cat([K.rms_norm(t[None], w, 1e-6, use_triton=True) for t in targets])
    pairs = [K.add_rms_norm(t[None], r[None], w, 1e-6, use_triton=True) for t, r in zip(targets, res_targets)]
    alone_n, alone_r = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
    tol = NORM_TOL[dtype]
    torch.testing.assert_close(alone, K.rms_norm(targets, w, 1e-6, use_triton=False), rtol=tol, atol=tol)
    res_gen = torch.Generator().manual_seed(35)
    for m, x in _in_batches(targets, seed=36):
        places = _places(m)
        assert torch.equal(K.rms_norm(x, w, 1e-6, use_triton=True)[places], alone), f"M={m}"
        res = torch.randn(m, hidden, generator=res_gen).to(dtype)
        res[places] = res_targets
        normed, summed = K.add_rms_norm(x, res, w, 1e-6, use_triton=True)
        assert torch.equal(normed[places], alone_n) and torch.equal(summed[places], alone_r), f"M={m}"
        ref_n, _ = K.add_rms_norm(x, res, w, 1e-6, use_triton=False)
        torch.testing.assert_close(normed, ref_n, rtol=tol, atol=tol)


# Decode attention, fixed split size (kernels/triton_attention_split.py). A pool of 3 target rows (lengths: 5 splits
# of 64 with a partial last one, 4 full splits, one partial split) and 63 neighbours of random lengths; positions
# past a row's length hold NaN. The smallest legal split (BLOCK_N = 64, not the mode's 256) and a merge tile cut to
# 4 splits keep the interpreter's grid small while the long target still folds two merge tiles; the shipped tile
# (16) is checked below on a row of 18 splits. Heads: G = 2 on one kv head, D 16 (few programs).
ATT_SPLIT, ATT_SEQ, ATT_TILE = 64, 320, 4
ATT_TARGETS = [300, 256, 37]
ATT_HQ, ATT_D, ATT_SCALE = 2, 16, 0.25
ATT_TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}  # x the row's mean |v| under its softmax, per element


def _att_pools(dtype: torch.dtype, seed: int, seq: int = ATT_SEQ, targets=ATT_TARGETS, neighbours: int = 63):
    """(q (S, Hq, D), k, v (S, 1, seq, D), lengths (S,)): slots 0.. hold the targets, then the neighbours.

    Targets of 4+ splits are made order-sensitive, as the GEMM's targets are: without this a bf16 output's rounding
    hides a reordered fp32 merge (planted breaks passed). (1) A cancelling pair: split 2 (positions 128..191) holds
    split 0's keys and its values negated, both x 2^16, so the two partials are exact negatives (same scores,
    running max and rounded P) whose terms cancel in the output, while whatever the merge adds between them is
    rounded at their ulp: a changed order moves the output by ~2^-9 of its size. (2) The last split's keys x 3, so
    its lse is the row's largest and the merge's running max moves at the last tile: a fold of tiles then rescales
    differently from one tile over all splits (the interpreter sums a tile's rows in order, so without a moved max
    the two give the same bits)."""
    gen = torch.Generator().manual_seed(seed)
    n = len(targets) + neighbours
    q = torch.randn(n, ATT_HQ, ATT_D, generator=gen)
    k, v = (torch.randn(n, 1, seq, ATT_D, generator=gen) for _ in range(2))
    lengths = torch.cat([torch.tensor(targets), torch.randint(1, seq + 1, (neighbours,), generator=gen)])
    for t, length in enumerate(targets):
        if length >= 4 * ATT_SPLIT:
            v[t, :, :ATT_SPLIT] *= 2.0 ** 16
            k[t, :, 2 * ATT_SPLIT:3 * ATT_SPLIT] = k[t, :, :ATT_SPLIT]
            v[t, :, 2 * ATT_SPLIT:3 * ATT_SPLIT] = -v[t, :, :ATT_SPLIT]
            k[t, :, (length - 1) // ATT_SPLIT * ATT_SPLIT:length] *= 3  # the last split's lse the row's largest
    dead = torch.arange(seq)[None, :] >= lengths[:, None]  # (S, seq)
    k[dead[:, None]] = v[dead[:, None]] = float("nan")
    return q.to(dtype), k.to(dtype), v.to(dtype), lengths


def _att_batch(q, lengths, m: int, seed: int, targets: int = len(ATT_TARGETS)):
    """(q, slots, lengths) of m rows: random neighbours, target j at row _places(m)[j]."""
    slots = torch.randperm(len(lengths) - targets, generator=torch.Generator().manual_seed(seed))[:m] + targets
    slots[_places(m)] = torch.arange(targets)
    return q[slots], slots, lengths[slots]


def _att_check_ref(out, q, k, v, slots, lengths, table, split_size, merge_tile):
    """Against `decode_attention_split_ref` (the same splits, tiles and merge in torch) within ATT_TOL x the mean
    |v| under the row's softmax (the cancelling pair makes the output far smaller than the terms it sums)."""
    ref = decode_attention_split_ref(q, k, v, slots, lengths, ATT_SCALE, split_size, table, merge_tile=merge_tile)
    mags = K.decode_attention(q, k, v.abs(), slots, lengths, ATT_SCALE, use_triton=False, block_table=table)
    err = (out.float() - ref.float()).abs()
    assert (err <= ATT_TOL[out.dtype] * mags.float() + 1e-6).all(), (err / mags.float()).max().item()


@pytest.mark.parametrize("page", [None, 32], ids=["slots", "paged32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_fixed_split_row_is_the_same_in_any_batch(dtype, page, monkeypatch):
    monkeypatch.setattr(tas, "MERGE_TILE", ATT_TILE)
    q, k, v, lengths = _att_pools(dtype, seed=41)
    table, slot_k, slot_v = None, k, v
    if page:  # the same K/V over shuffled blocks, table columns past the rows naming a garbage block
        (k, table), (v, _) = (paged_copy(p, page, seed=page, width=ATT_SEQ // page + 2) for p in (k, v))

    def att(qq, slots, lens, split_size=ATT_SPLIT, layout=True):  # layout False: the slot layout even when paged
        pools = (k, v, table) if layout else (slot_k, slot_v, None)
        return K.decode_attention(qq, *pools[:2], slots, lens, ATT_SCALE, use_triton=True, block_table=pools[2],
                                  split_size=split_size)

    ids = torch.arange(len(ATT_TARGETS))
    alone = torch.cat([att(q[t:t + 1], ids[t:t + 1], lengths[t:t + 1]) for t in ids])  # batch 1 each
    assert torch.isfinite(alone).all()
    if page:  # the same bits as the slot layout
        slots_alone = [att(q[t:t + 1], ids[t:t + 1], lengths[t:t + 1], layout=False) for t in ids]
        assert torch.equal(alone, torch.cat(slots_alone))
    _att_check_ref(alone, q[ids], k, v, ids, lengths[ids], table, ATT_SPLIT, ATT_TILE)
    for m in (7, 63):
        qq, slots, lens = _att_batch(q, lengths, m, seed=m)
        out = att(qq, slots, lens)
        assert torch.equal(out[_places(m)], alone), f"batch {m}: a row changed with its batch"
        if m == 7:
            _att_check_ref(out, qq, k, v, slots, lens, table, ATT_SPLIT, ATT_TILE)
    if page is None:  # the default mode on the same rows: its split count follows the batch (5 at 1, 3 at 16 here)
        assert len({default_num_splits(m, ATT_HQ, 1, ATT_SEQ, q.device) for m in (1, 16)}) == 2
        alone = torch.cat([att(q[t:t + 1], ids[t:t + 1], lengths[t:t + 1], None) for t in ids[:2]])
        qq, slots, lens = _att_batch(q, lengths, 16, seed=16)
        out = att(qq, slots, lens, None)[_places(16)[:2]]
        for j in range(2):  # each long target changes: the inputs show a changed order
            assert not torch.equal(out[j], alone[j]), f"default mode: target {j} kept its bits in a batch of 16"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_fixed_split_shipped_merge_tile(dtype):
    """The shipped MERGE_TILE (16): a row of 1,100 positions (18 splits of 64, two merge tiles; splits 0 and 2 a
    cancelling pair, as above) alone, then at the first, middle and last row of a batch of 7, and against the
    reference."""
    q, k, v, lengths = _att_pools(dtype, seed=42, seq=1152, targets=[1100], neighbours=4)
    assert tas.MERGE_TILE == 16 and -(-1100 // ATT_SPLIT) > tas.MERGE_TILE
    one = torch.zeros(1, dtype=torch.long)
    alone = K.decode_attention(q[:1], k, v, one, lengths[:1], ATT_SCALE, use_triton=True, split_size=ATT_SPLIT)
    _att_check_ref(alone, q[:1], k, v, one, lengths[:1], None, ATT_SPLIT, tas.MERGE_TILE)
    slots = torch.tensor([0, 1, 2, 0, 3, 4, 0])
    out = K.decode_attention(q[slots], k, v, slots, lengths[slots], ATT_SCALE, use_triton=True, split_size=ATT_SPLIT)
    assert torch.equal(out[_places(7)], alone.expand(3, -1, -1))


def test_decode_attention_fixed_split_edges():
    """Length 0 -> zeros (no split active, the merge's loop empty); a length past the pool clamped, as the default
    mode does; split sizes that are not a positive multiple of 64, or come with num_splits, refused."""
    q, k, v, _ = _att_pools(torch.float32, seed=43, seq=128, targets=[128], neighbours=1)
    slots, lengths = torch.tensor([1, 0]), torch.tensor([0, 999])  # slot 0 holds 128 positions
    out = K.decode_attention(q[:2], k, v, slots, lengths, ATT_SCALE, use_triton=True, split_size=ATT_SPLIT)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isfinite(out).all()
    ref = K.decode_attention(q[:2], k, v, slots, torch.tensor([0, 128]), ATT_SCALE, use_triton=False)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for bad in ({"split_size": 96}, {"split_size": 0}, {"split_size": 64, "num_splits": 2}):
        with pytest.raises(ValueError):
            K.decode_attention(q[:2], k, v, slots, lengths, ATT_SCALE, use_triton=True, **bad)
