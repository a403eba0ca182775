"""Fused ops of one batched decode step, each with a plain-torch reference.

Why: the decode engine runs a step for B rows at once over the slot-layout KV pool and
captures it as a CUDA graph per batch bucket, so these ops take static shapes, never sync
with the host on the Triton path, and are capturable. On CPU (tests, CI) the engine runs the
`*_ref` functions, which mirror HF's eager math.

Backend choice is explicit: every op takes `use_triton`; None means `triton_available(device)`
(CUDA tensors and an importable triton). True forces Triton (e.g. CPU tensors under the Triton
interpreter in tests); False forces the reference. Nothing here reads environment variables.
triton is imported lazily, so this package imports without it.

KV pool, one layer: k_pool, v_pool (slots, kv_heads, max_seq, head_dim), contiguous. Row b
lives in slot slots[b] with lengths[b] valid positions (including this step's token). Paged
(`block_table` given, (R, W) int32): the pool is (blocks, kv_heads, PAGE, head_dim) and slots[b]
names a table row: row b's position n lives in block block_table[slots[b], n // PAGE] at offset
n % PAGE (kernels/triton_paging.py); the slot layout is the case of one block of the whole context.
Padded rows should have length 1 and a scratch slot: they produce garbage, never crash and
write only inside their slot. Out-of-range slots are the caller's bug (not checked: a check
would sync); out-of-range lengths are clamped to [0, max_seq] by the kernel, out-of-range
write positions are skipped by the Triton rope_store.
"""

from __future__ import annotations

import torch

from kvtransfer.kernels._checks import (
    check_attention,
    check_float,
    check_groups,
    check_index,
    check_out,
    check_pieces,
    check_pools,
    check_table,
    last_dim_unit,
    require,
)
from kvtransfer.kernels.backend import triton_available
from kvtransfer.kernels.backend import pick_triton as _use_triton
from kvtransfer.kernels.norms import add_rms_norm, rms_norm
from kvtransfer.kernels.projections import GEMV_MAX_ROWS, gate_up_silu, invariant_linear, linear, silu_mul
from kvtransfer.kernels.reference import (
    add_rms_norm_ref,
    chunk_attention_ref,
    decode_attention_ref,
    decode_attention_split_ref,
    invariant_linear_ref,
    rms_norm_ref,
    rope_store_ref,
    silu_mul_ref,
)

__all__ = [
    "GEMV_MAX_ROWS",
    "triton_available",
    "decode_attention",
    "chunk_attention",
    "mixed_attention",
    "mixed_attention_fuses",
    "rope_store",
    "rms_norm",
    "add_rms_norm",
    "silu_mul",
    "linear",
    "gate_up_silu",
    "invariant_linear",
    "decode_attention_ref",
    "decode_attention_split_ref",
    "chunk_attention_ref",
    "rope_store_ref",
    "rms_norm_ref",
    "add_rms_norm_ref",
    "silu_mul_ref",
    "invariant_linear_ref",
]


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    *,
    use_triton: bool | None = None,
    num_splits: int | None = None,
    block_table: torch.Tensor | None = None,
    split_size: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query per row over the first lengths[b] positions of slot slots[b] (paged: of table row
    slots[b]).

    q: (B, Hq, D); k_pool/v_pool: (S, Hkv, T, D), q's dtype; slots, lengths: (B,) int32/int64.
    Returns a new (B, Hq, D) tensor in q.dtype, or `out` (B, Hq, D) in q.dtype, unit stride on D (a slice of a
    mixed step's attention output), written in place. GQA: q head j reads kv head j // (Hq // Hkv).
    num_splits (Triton only) overrides the static split count (for tuning/benchmarks). split_size (the
    batch-invariant mode, docs/batch-invariance.md: a multiple of BLOCK_N = 64, `INVARIANT_SPLIT_SIZE` = 256 there)
    cuts every row at the same positions instead, so a row's output does not depend on its batch; the reference then
    computes that split and merge in the kernel's order (`decode_attention_split_ref`).
    """
    batch, q_heads, head_dim = check_attention(q, k_pool, v_pool)
    check_index("slots", slots, batch, q.device)
    check_index("lengths", lengths, batch, q.device)
    check_table(block_table, q.device)
    require(split_size is None or (split_size > 0 and split_size % 64 == 0 and num_splits is None),
            f"split_size {split_size}: a positive multiple of 64, without num_splits")
    check_out(out, q)
    if not _use_triton(use_triton, q.device):
        if split_size is not None:
            got = decode_attention_split_ref(q, k_pool, v_pool, slots, lengths, scale, split_size, block_table)
        else:
            got = decode_attention_ref(q, k_pool, v_pool, slots, lengths, scale, block_table)
        return got if out is None else out.copy_(got)
    from kvtransfer.kernels.triton_attention import decode_attention_triton

    return decode_attention_triton(
        last_dim_unit(q), k_pool, v_pool, slots, lengths, scale, num_splits=num_splits, block_table=block_table,
        split_size=split_size, out=out,
    )


def chunk_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    pieces: torch.Tensor,
    scale: float,
    *,
    use_triton: bool | None = None,
    block_table: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of prompt-chunk rows over their slot's cache (a mixed step's prompt rows).

    q: (R, Hq, D); k_pool/v_pool: (S, Hkv, T, D), q's dtype; pieces: (P, 4) int32 on q's device, one row per
    chunk: first row in q, rows, slot (paged: table row), position of the first row (unused: 0 rows; a negative
    slot: rows to zero, a step's padding). Row r of a chunk attends over positions 0..start + r of its slot, as
    `decode_attention` with length start + r + 1 would. Returns a new (R, Hq, D) tensor in q.dtype, zero on rows
    outside every chunk; or `out` (R, Hq, D) in q.dtype, unit stride on D, written in place on the pieces' rows
    only (its other rows left as they are). Pieces must not overlap or run past R.
    """
    check_attention(q, k_pool, v_pool)
    check_pieces(pieces, q.device)
    check_table(block_table, q.device)
    check_out(out, q)
    if not _use_triton(use_triton, q.device):
        return chunk_attention_ref(q, k_pool, v_pool, pieces, scale, block_table, out)
    from kvtransfer.kernels.triton_chunk_attention import chunk_attention_triton

    return chunk_attention_triton(last_dim_unit(q), k_pool, v_pool, pieces, scale, block_table, out)


def mixed_attention_fuses(decode_rows: int, q_heads: int, kv_heads: int, device: torch.device, *,
                          use_triton: bool | None = None, max_seq: int | None = None) -> bool:
    """Whether a mixed step of `decode_rows` decode rows (its bucket) on `device` takes `mixed_attention`'s one
    launch: Triton there, enough decode rows that one split each fills the SMs (kvtransfer/kernels/
    triton_mixed_attention.py, `fuses`), and rows (`max_seq` positions each, None: not checked) no longer than
    the decode kernel's per-split cap (triton_attention.LONG_CHUNK, 0: off). The fused launch reads each decode row
    with one program a kv head, so a long row among short ones would hold the step (README, #39: the per-split
    cap); where rows can be longer than the cap, the decode kernel takes the decode rows and cuts them. Static
    shapes only: one answer per CUDA graph."""
    if not _use_triton(use_triton, device):
        return False
    from kvtransfer.kernels import triton_attention
    from kvtransfer.kernels.triton_mixed_attention import fuses_on

    cap = triton_attention.LONG_CHUNK
    if max_seq is not None and cap and max_seq > cap:
        return False
    return fuses_on(decode_rows, q_heads, kv_heads, device)


def mixed_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    decode_rows: int,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    pieces: torch.Tensor,
    scale: float,
    *,
    use_triton: bool | None = None,
    block_table: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """A mixed step's attention in one call: rows :decode_rows as `decode_attention` over `slots`, `lengths`
    (decode_rows,), the rows after them as `chunk_attention` over `pieces` (first rows counted from decode_rows).

    q: (B, Hq, D); pools, block_table as there. Returns a new (B, Hq, D) tensor in q.dtype (zero on prompt rows
    outside every piece), or `out`, written in place on the decode rows and the pieces' rows. Triton: one launch
    (triton_mixed_attention.py), each decode row at one split: its bits are `decode_attention`'s with num_splits=1,
    a prompt row's are `chunk_attention`'s. The reference: the two references.
    """
    rows = check_attention(q, k_pool, v_pool)[0]
    require(isinstance(decode_rows, int) and 0 <= decode_rows <= rows,
            f"decode_rows {decode_rows!r} must be an int in 0..{rows} (q's rows)")
    check_index("slots", slots, decode_rows, q.device)
    check_index("lengths", lengths, decode_rows, q.device)
    check_pieces(pieces, q.device)
    check_table(block_table, q.device)
    check_out(out, q)
    if not _use_triton(use_triton, q.device):
        out = torch.zeros_like(q) if out is None else out
        if decode_rows:
            out[:decode_rows].copy_(decode_attention_ref(q[:decode_rows], k_pool, v_pool, slots, lengths, scale,
                                                         block_table))
        if decode_rows < rows:
            chunk_attention_ref(q[decode_rows:], k_pool, v_pool, pieces, scale, block_table, out[decode_rows:])
        return out
    from kvtransfer.kernels.triton_mixed_attention import mixed_attention_triton

    return mixed_attention_triton(last_dim_unit(q), k_pool, v_pool, decode_rows, slots, lengths, pieces, scale,
                                  block_table, out)


def rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    *,
    use_triton: bool | None = None,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """RoPE on q and k; rotated k and plain v written to k_pool/v_pool[slots[b], :, positions[b]] (paged: at the
    position's block of table row slots[b]).

    q: (B, Hq, D); k, v: (B, Hkv, D) pre-RoPE, all in the pools' dtype; cos, sin: (B, D) for
    each row's position (HF layout, attention scaling folded in; any float dtype, rounded to
    q's dtype as HF does). Returns a NEW rotated q (B, Hq, D); q and k are not modified.
    """
    check_float("q", q, 3)
    batch, q_heads, head_dim = q.shape
    require(head_dim % 2 == 0, f"head_dim must be even for RoPE, got {head_dim}")
    check_pools(k_pool, v_pool, head_dim, q.dtype)
    kv_heads = k_pool.shape[1]
    check_groups(q_heads, kv_heads)
    for name, t in (("k", k), ("v", v)):
        check_float(name, t, 3)
        require(tuple(t.shape) == (batch, kv_heads, head_dim), f"{name} must be {(batch, kv_heads, head_dim)}, got {tuple(t.shape)}")
        require(t.dtype == q.dtype, f"{name} dtype {t.dtype} != q dtype {q.dtype}")
    for name, t in (("cos", cos), ("sin", sin)):
        check_float(name, t, 2)
        require(tuple(t.shape) == (batch, head_dim), f"{name} must be {(batch, head_dim)}, got {tuple(t.shape)}")
    for name, t in (("k", k), ("v", v), ("cos", cos), ("sin", sin), ("k_pool", k_pool)):
        require(t.device == q.device, f"{name} is on {t.device}, q on {q.device}")
    check_index("slots", slots, batch, q.device)
    check_index("positions", positions, batch, q.device)
    check_table(block_table, q.device)
    if not _use_triton(use_triton, q.device):
        return rope_store_ref(q, k, v, cos, sin, k_pool, v_pool, slots, positions, block_table)
    from kvtransfer.kernels.triton_rope import rope_store_triton

    q, k, v, cos, sin = (last_dim_unit(t) for t in (q, k, v, cos, sin))
    return rope_store_triton(q, k, v, cos, sin, k_pool, v_pool, slots, positions, block_table)


# The decode attention's arguments in the batch-invariant mode (kvtransfer/engine/runner.py): every row cut at the
# same positions whatever the batch, splits of triton_attention_split.INVARIANT_SPLIT_SIZE positions (written here,
# not imported, so this module imports no Triton; tests/test_batch_invariant.py checks the two agree). On CPU the
# reference computes the same splits row by row.
INVARIANT_ATTENTION: dict = {"split_size": 256}
