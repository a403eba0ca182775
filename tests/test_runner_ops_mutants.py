"""Gaps found by planting one-line bugs in the decode step and its ops (a mutation pass over
kvtransfer/kernels/_checks.py, kvtransfer/kernels/ops.py's dispatch and checks, kvtransfer/kernels/reference.py,
kvtransfer/engine/runner.py, kvtransfer/engine/engine.py, kvtransfer/engine/pool_copies.py and
kvtransfer/determinism.py), each closed here by a unit test on CPU: hand-built tensors or the `tiny` preset, no
server, no Triton interpreter, no timing (the GEMV pick's timer is a stand-in).

Why: the kernels' CPU tests hold the references to HF's math and try one bad call per op, but most argument checks
guard a Triton kernel that reads raw memory, and on CPU a check dropped lets the call reach the reference, which
either works anyway (a strided `out`, an int64 block table, a second dim on `slots`) or fails with torch's own
error; only a test that names the check's message sees it go. Tensors on the `meta` device stand in for a second
device. The fixed-split reference (the batch-invariant mode's attention on CPU) was checked against the kernel
under the interpreter and through the servers' comparisons of a request with itself, which pass a clamp dropped or
P left unrounded; the mixed-attention reference only under the interpreter. The engine's routing of a local
prefill (whole, or in the steps) and its option checks at their bounds, the GEMV pick's margin (GPU only: timed by
a stand-in here), the pool's one-view and bounds checks and enable_deterministic's switches had no test at all.

Of 88 planted bugs, 61 survived these modules' CPU tests (test_kernels, test_mixed, test_engine, test_paged, the
pool, prefix, preempt, sampler and gemv tests; the interpreter files and test_batch_invariant.py counted too); 50 of
them are killed here, each test's docstring naming the ones it kills ("kills ..."). Eleven are left: nine change
nothing reachable (a block count past the row's length trimmed after, torch's bf16 softmax on CPU giving the fp32
one's bits, a tile end that a split of a multiple of 64 never cuts, the GEMV pick's per-layer average taken on both
sides, `scaling` read from HF's module where it is head_dim ** -0.5 anyway, the host-tier probe one token longer,
copy_prefix re-copying blocks that src and dst share, an empty copy, sync on a device that is neither cpu nor
cuda), one nearly so (the invariant GEMM's reference without its fp32 upcast: torch's CPU bf16 GEMM accumulates
in fp32 already), and one is GPU only (graph_us's median).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from bench.measure.kernel_inputs import decode_case
from kvtransfer import determinism
from kvtransfer.engine import runner as runner_mod
from kvtransfer.engine.engine import DecodeEngine, EngineOptions, check_options
from kvtransfer.engine.pool import KVPool
from kvtransfer.engine.runner import PROJECTIONS, StepRunner
from kvtransfer.geometry import CacheGeometry
from kvtransfer.kernels import ops as K
from kvtransfer.kernels.reference import decode_attention_ref, decode_attention_split_ref
from kvtransfer.model.spec import ModelSpec, load_model

META = torch.device("meta")  # a second device on a CPU-only machine: the checks compare devices, never read data


def _case(dtype=torch.float32):
    """Two rows (lengths 3 and 5) in a (3, 2, 8, 16) pool, 4 q heads: a valid decode_attention call."""
    c = decode_case([3, 5], 4, 2, 16, max_seq=8, dtype=dtype, garbage=None)
    return c.q, c.k_pool, c.v_pool, c.slots, c.lengths


def _raises(match: str, call, *args, **kw) -> None:
    with pytest.raises(ValueError, match=match):
        call(*args, **kw)


# --- kernels/_checks.py, through the ops that use them ---


def test_a_float_argument_needs_exactly_its_dims_and_a_float_dtype():
    """kills check_float's `t.dim() == ndim` -> `>=` (an x of (B, H, extra) normed over its last dim) and its dtype
    check dropped (an int64 x and weight normed as if float)."""
    x, w = torch.randn(2, 4, 4), torch.randn(4)
    _raises("x must have 2 dims", K.rms_norm, x, w, 1e-6)
    _raises("x must be fp16/bf16/fp32", K.rms_norm, torch.ones(2, 4, dtype=torch.long),
            torch.ones(4, dtype=torch.long), 1e-6)


def test_slots_and_lengths_must_be_exactly_b_on_qs_device():
    """kills check_index's `tuple(t.shape) == (batch,)` -> `t.shape[0] == batch` (a (B, 1) slots tensor) and its
    device check dropped."""
    q, kp, vp, slots, lengths = _case()
    _raises(r"slots must have shape \(2,\)", K.decode_attention, q, kp, vp, slots[:, None], lengths, 0.25)
    _raises("lengths is on meta", K.decode_attention, q, kp, vp, slots, lengths.to(META), 0.25)


def test_a_block_table_must_be_int32_with_a_unit_stride_on_qs_device():
    """kills check_table's int32 test widened to INDEX_DTYPES (an int64 table: the Triton paging reads int32), its
    `table.stride(1) == 1` dropped (a transposed table), and its device check dropped."""
    q, kp, vp, slots, lengths = _case()
    table = torch.arange(3, dtype=torch.int32)[:, None].repeat(1, 2)  # (3, 2)
    K.decode_attention(q, kp, vp, slots, lengths, 0.25, block_table=table)  # valid
    _raises("2-D int32", K.decode_attention, q, kp, vp, slots, lengths, 0.25, block_table=table.long())
    strided = torch.arange(6, dtype=torch.int32).reshape(2, 3).t()  # (3, 2), stride (1, 3)
    _raises("unit stride", K.decode_attention, q, kp, vp, slots, lengths, 0.25, block_table=strided)
    _raises("block_table is on meta", K.decode_attention, q, kp, vp, slots, lengths, 0.25,
            block_table=table.to(META))


def test_the_pools_must_match_in_dtype_layout_and_head_dim():
    """kills check_pools' `k_pool.dtype == v_pool.dtype == dtype` -> `k_pool.dtype == dtype`, its contiguity check
    of v_pool dropped, and its `k_pool.shape[3] == head_dim` dropped (torch's matmul error instead)."""
    q, kp, vp, slots, lengths = _case()
    _raises("pool dtypes", K.decode_attention, q, kp, vp.double(), slots, lengths, 0.25)
    v_strided = vp.transpose(1, 2).contiguous().transpose(1, 2)  # the same shape, not contiguous
    _raises("must be contiguous", K.decode_attention, q, kp, v_strided, slots, lengths, 0.25)
    _raises("pool head_dim 16 != 8", K.decode_attention, q[..., :8], kp, vp, slots, lengths, 0.25)


def test_pools_of_zero_kv_heads_are_refused_as_a_value_error():
    """kills check_groups' `kv_heads > 0` dropped (`q_heads % 0`: a ZeroDivisionError where callers catch
    ValueError)."""
    q, kp, vp, slots, lengths = _case()
    _raises("not a multiple of kv heads 0", K.decode_attention, q, kp[:, :0], vp[:, :0], slots, lengths, 0.25)


def test_an_output_must_be_qs_dtype_with_a_unit_stride_on_its_last_dim():
    """kills check_out's dtype test dropped (the reference casts into it silently) and its `out.stride(-1) == 1`
    dropped (the Triton kernels write D with unit stride), and chunk_attention's check_out dropped."""
    q, kp, vp, slots, lengths = _case()
    _raises("out must be", K.decode_attention, q, kp, vp, slots, lengths, 0.25, out=torch.empty_like(q).double())
    strided = torch.empty(q.shape[0], q.shape[1], 2 * q.shape[2])[..., ::2]
    assert strided.shape == q.shape and strided.stride(-1) == 2
    _raises("unit stride on its last dim", K.decode_attention, q, kp, vp, slots, lengths, 0.25, out=strided)
    pieces = torch.tensor([[0, 2, 0, 0]], dtype=torch.int32)
    _raises("out must be", K.chunk_attention, q, kp, vp, pieces, 0.25, out=torch.empty_like(q).double())


def test_q_and_the_pools_must_share_a_device():
    """kills check_attention's `q.device == k_pool.device` dropped."""
    q, kp, vp, slots, lengths = _case()
    _raises("pools on meta", K.decode_attention, q, kp.to(META), vp.to(META), slots, lengths, 0.25)


def test_pieces_are_exactly_four_columns_on_qs_device():
    """kills check_pieces' `pieces.shape[1] == 4` -> `>= 4` and its device check dropped."""
    q, kp, vp, _, _ = _case()
    pieces = torch.tensor([[0, 2, 0, 0]], dtype=torch.int32)
    _raises(r"\(P, 4\) int32", K.chunk_attention, q, kp, vp, torch.cat([pieces, pieces[:, :1]], 1), 0.25)
    _raises("pieces is on meta", K.chunk_attention, q, kp, vp, pieces.to(META), 0.25)


# --- kernels/ops.py: the ops' own checks and the reference dispatch ---


def test_split_size_is_a_multiple_of_64_and_excludes_num_splits():
    """kills decode_attention's `split_size % 64` -> `% 32` and its `num_splits is None` dropped (a split count the
    Triton path would then ignore or apply twice)."""
    q, kp, vp, slots, lengths = _case()
    K.decode_attention(q, kp, vp, slots, lengths, 0.25, split_size=64)  # valid
    _raises("split_size 32", K.decode_attention, q, kp, vp, slots, lengths, 0.25, split_size=32)
    _raises("without num_splits", K.decode_attention, q, kp, vp, slots, lengths, 0.25, split_size=64, num_splits=2)


def test_rope_store_refuses_an_odd_head_dim_other_kv_dtypes_and_bad_positions():
    """kills rope_store's `head_dim % 2 == 0` dropped (rotate_half of an odd D), its k/v dtype check dropped, its
    cos/sin device check dropped and its positions check dropped."""
    def args(d=16, kv_dtype=torch.float32, cos_device="cpu", positions=None):
        q = torch.randn(2, 4, d)
        kv = torch.randn(2, 2, d, dtype=kv_dtype)
        pool = torch.zeros(3, 2, 8, d)
        cs = torch.randn(2, d, device=cos_device)
        pos = torch.tensor([1, 2]) if positions is None else positions
        return q, kv, kv.clone(), cs, cs.clone(), pool, pool.clone(), torch.tensor([0, 1]), pos

    K.rope_store(*args())  # valid
    _raises("head_dim must be even", K.rope_store, *args(d=15))
    _raises("k dtype", K.rope_store, *args(kv_dtype=torch.float16))
    _raises("cos is on meta", K.rope_store, *args(cos_device=META))
    _raises(r"positions must have shape \(2,\)", K.rope_store, *args(positions=torch.tensor([[1], [2]])))


def test_the_norms_refuse_a_weight_elsewhere_and_a_residual_of_another_dtype():
    """kills _check_norm's weight device check dropped and add_rms_norm's `residual.dtype == x.dtype` dropped (the
    residual stream would change dtype at the add)."""
    x, w = torch.randn(3, 8), torch.randn(8)
    _raises("weight is on meta", K.rms_norm, x, w.to(META), 1e-6)
    _raises("residual must match x", K.add_rms_norm, x, x.half(), w, 1e-6)


def _mixed_case(page: int = 0):
    """A mixed step of 2 decode rows and 6 prompt rows (pieces: 4 rows of slot 2 from position 3, then a padding
    piece of 2 rows) over a pool of 4 slots x 16 positions, or the same positions spread over `page`-position blocks
    (table row r = slot r, its blocks in reverse order) -> (q, k_pool, v_pool, slots, lengths, pieces, table)."""
    g = torch.Generator().manual_seed(5)
    kp, vp = torch.randn(4, 2, 16, 8, generator=g), torch.randn(4, 2, 16, 8, generator=g)
    q = torch.randn(8, 4, 8, generator=g)
    slots, lengths = torch.tensor([1, 3]), torch.tensor([9, 16])
    pieces = torch.tensor([[0, 4, 2, 3], [4, 2, -1, 0]], dtype=torch.int32)
    if not page:
        return q, kp, vp, slots, lengths, pieces, None
    width = 16 // page
    blocks = torch.arange(4 * width).reshape(4, width).flip(1)  # (4, width): row r's blocks, last first
    pk, pv = torch.zeros(4 * width, 2, page, 8), torch.zeros(4 * width, 2, page, 8)
    for r in range(4):
        for j in range(width):
            pk[blocks[r, j]] = kp[r, :, j * page:(j + 1) * page]
            pv[blocks[r, j]] = vp[r, :, j * page:(j + 1) * page]
    return q, pk, pv, slots, lengths, pieces, blocks.to(torch.int32)


@pytest.mark.parametrize("page", [0, 4])
def test_the_mixed_attention_reference_is_the_two_references(page):
    """kills mixed_attention's reference with its decode rows at another scale, and with its chunk rows read
    without the block table (the slot layout's positions of a paged pool). Paged, the answer is the slot layout's."""
    q, kp, vp, slots, lengths, pieces, table = _mixed_case(page)
    got = K.mixed_attention(q, kp, vp, 2, slots, lengths, pieces, 0.3, use_triton=False, block_table=table)
    q0, kp0, vp0 = _mixed_case()[:3]
    assert torch.equal(got[:2], K.decode_attention(q0[:2], kp0, vp0, slots, lengths, 0.3, use_triton=False))
    assert torch.equal(got[2:], K.chunk_attention(q0[2:], kp0, vp0, pieces, 0.3, use_triton=False))
    assert got[6:].eq(0).all() and got[2:6].ne(0).all()


def test_a_mixed_step_of_decode_rows_only_is_the_decode_attention():
    """kills mixed_attention's `0 <= decode_rows <= rows` -> `< rows` (a mixed step whose every row decodes, no
    prompt row left, refused)."""
    q, kp, vp, slots, lengths, _, _ = _mixed_case()
    none = torch.zeros(0, 4, dtype=torch.int32)
    got = K.mixed_attention(q[:2], kp, vp, 2, slots, lengths, none, 0.3, use_triton=False)
    assert torch.equal(got, K.decode_attention(q[:2], kp, vp, slots, lengths, 0.3, use_triton=False))
    _raises("decode_rows 3", K.mixed_attention, q[:2], kp, vp, 3, slots, lengths, none, 0.3, use_triton=False)


# --- kernels/reference.py ---


def test_the_fixed_split_reference_is_the_attention_over_many_splits_and_clamps_long_rows():
    """kills decode_attention_split_ref's online softmax rescaled the wrong way (`exp2(m_new - m)`), a split's
    log-sum-exp in natural log (`torch.log` for `torch.log2`), the merge weighted by the old max (`lse - m`), and
    the clamp of a row's length to the pool dropped (a length past it: the kernel clamps, the mutant fails on an
    empty tile). fp32: the splits and merge (20 splits of 64: two merge tiles of 16) are the plain attention within
    rounding."""
    g = torch.Generator().manual_seed(11)
    kp, vp = torch.randn(3, 2, 1280, 8, generator=g), torch.randn(3, 2, 1280, 8, generator=g)
    q = torch.randn(4, 4, 8, generator=g) * 3
    slots, lengths = torch.tensor([0, 1, 2, 0]), torch.tensor([1280, 100, 64, 1])
    got = decode_attention_split_ref(q, kp, vp, slots, lengths, 0.3, 64)
    torch.testing.assert_close(got, decode_attention_ref(q, kp, vp, slots, lengths, 0.3), rtol=1e-5, atol=1e-5)
    past = decode_attention_split_ref(q[:1], kp, vp, slots[:1], torch.tensor([5000]), 0.3, 64)
    assert torch.equal(past, got[:1])


def test_the_fixed_split_reference_rounds_p_to_the_kv_dtype_before_v():
    """kills decode_attention_split_ref's `p.to(v.dtype)` dropped. Two keys with P = 1 and 0.999 (bf16: 1.0) and V
    +1 and -1: rounded, the two cancel exactly (as the kernel's and HF's bf16 P do); unrounded, 5e-4 is left."""
    q = torch.zeros(1, 1, 8, dtype=torch.bfloat16)
    q[0, 0, 0] = 1
    kp = torch.zeros(1, 1, 2, 8, dtype=torch.bfloat16)
    kp[0, 0, 1, 0] = -0.001  # score -0.001 x log2(e): P = 2**-0.00144 = 0.999
    vp = torch.ones(1, 1, 2, 8, dtype=torch.bfloat16)
    vp[0, 0, 1] = -1
    args = (q, kp, vp, torch.tensor([0]), torch.tensor([2]), 1.0)
    assert decode_attention_ref(*args).eq(0).all()  # HF's rounding: probs 0.50025, 0.49975 -> 0.5, 0.5
    assert decode_attention_split_ref(*args, 64).eq(0).all()


def test_the_chunk_reference_zeroes_padding_rows_of_a_given_output():
    """kills chunk_attention_ref's `out[row0:row0 + rows] = 0` for a negative slot dropped: the padding rows of a
    mixed step's output (torch.empty_like in the runner) kept whatever memory held."""
    q, kp, vp, _, _, _, _ = _mixed_case()
    out = torch.full_like(q, float("nan"))
    pieces = torch.tensor([[0, 3, -1, 0], [3, 4, 2, 5]], dtype=torch.int32)
    got = K.chunk_attention(q, kp, vp, pieces, 0.3, out=out, use_triton=False)
    assert got is out and out[:3].eq(0).all() and out[3:7].isfinite().all() and out[7:].isnan().all()


# --- engine/runner.py: the GEMV choice ---


@pytest.fixture(scope="module")
def tiny():
    return load_model(ModelSpec("tiny", "float32", 0))


def _runner(model, **kw) -> StepRunner:
    pool = KVPool(CacheGeometry.from_config(model.config, torch.float32), torch.device("cpu"), slots=2, max_seq=32)
    return StepRunner(model, pool, **kw)


def test_auto_times_the_gemv_only_with_rows_for_it_and_outside_deterministic_mode(tiny, monkeypatch):
    """kills runner.py's deterministic-mode branch dropped (`torch.are_deterministic_algorithms_enabled()`: a timing
    would pick the kernels, and two processes could differ in bits) and `rows and` dropped from `not (rows and
    self.use_triton)` (--gemv auto with gemv_rows 0 timed the GEMV for nothing: a CUDA graph per projection at start;
    on CPU it fails). pick_gemv is a stand-in: it times nothing here."""
    calls = []
    monkeypatch.setattr(runner_mod, "pick_gemv", lambda r, rows: calls.append(rows) or dict.fromkeys(PROJECTIONS, 7))
    assert _runner(tiny, use_triton=True, gemv="auto").gemv_rows == dict.fromkeys(PROJECTIONS, 7)
    assert calls == [K.GEMV_MAX_ROWS]
    assert _runner(tiny, use_triton=True, gemv="auto", gemv_rows=0).gemv_rows == dict.fromkeys(PROJECTIONS, 0)
    on, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        rows = _runner(tiny, use_triton=True, gemv="auto").gemv_rows
    finally:
        torch.use_deterministic_algorithms(on, warn_only=warn)
    assert rows == dict.fromkeys(PROJECTIONS, 0) and calls == [K.GEMV_MAX_ROWS]


def test_pick_gemv_keeps_the_gemv_only_where_it_wins_by_the_margin_over_every_timed_layer(monkeypatch):
    """kills pick_gemv's `gemv < cublas * (1 - GEMV_MARGIN)` -> `gemv < cublas` (a near-tie flips from start to
    start) and its comparison inverted, the layers timed cut to one (`runner.layers[:1]`: min(8, layers) are timed,
    more bytes than L2 holds) and the o projection timed without its bias. The timer is a stand-in that runs the
    calls and prices each (weight, max_rows): cuBLAS 100, the GEMV 96 (inside the margin) for qkv, 94 for o, 120
    for gate_up, 50 for down and lm_head."""
    g = torch.Generator().manual_seed(0)

    def w(n, k):
        return torch.randn(n, k, generator=g)
    layers = [SimpleNamespace(qkv=w(12, 8), qkv_bias=torch.zeros(12), o=w(8, 8), o_bias=torch.zeros(8),
                              gate_up=w(16, 8), down=w(8, 8)) for _ in range(10)]
    runner = SimpleNamespace(layers=layers, lm_head=w(20, 8), device=torch.device("cpu"))
    name = {}
    for lw in layers:
        name.update({id(lw.qkv): "qkv", id(lw.o): "o", id(lw.gate_up): "gate_up", id(lw.down): "down"})
    name[id(runner.lm_head)] = "lm_head"
    gemv_us = {"qkv": 96.0, "o": 94.0, "gate_up": 120.0, "down": 50.0, "lm_head": 50.0}
    timed = []

    def linear(x, weight, bias=None, *, max_rows=None, **kw):
        timed.append((name[id(weight)], bias, max_rows))

    def gate_up_silu(x, weight, *, max_rows=None, **kw):
        timed.append((name[id(weight)], None, max_rows))

    def graph_us(calls, device):
        start = len(timed)
        calls()
        return sum(gemv_us[n] if rows else 100.0 for n, _, rows in timed[start:])
    monkeypatch.setattr(runner_mod.kernels, "linear", linear)
    monkeypatch.setattr(runner_mod.kernels, "gate_up_silu", gate_up_silu)
    monkeypatch.setattr(runner_mod, "graph_us", graph_us)
    picked = runner_mod.pick_gemv(runner, 4)
    assert picked == {"qkv": 0, "o": 4, "gate_up": 0, "down": 4, "lm_head": 4}
    per = {n: sum(1 for t in timed if t[0] == n) for n in PROJECTIONS}
    assert per == {"qkv": 16, "o": 16, "gate_up": 16, "down": 16, "lm_head": 2}  # 8 layers, cuBLAS then the GEMV
    for proj in ("qkv", "o"):  # each layer's own bias, as the step passes it
        biases = [b for n, b, _ in timed if n == proj]
        assert all(b is getattr(lw, proj + "_bias") for b, lw in zip(biases, layers[:8] * 2, strict=True))


# --- engine/engine.py: the options, the local prefill's route, what the engine keeps from the model ---


def test_the_options_accept_their_bounds_and_refuse_one_past():
    """kills check_options' `prefill_chunk < 2 * max_batch` -> `<=` and `mixed_max_rows < 2 * prefill_chunk` ->
    `<=` (each bound itself refused), `mixed_max_rows < 0` loosened, and EngineOptions' `max_batch < 1` -> `< 0`,
    its host tier allowed without the prefix cache and its block count allowed without a block size."""
    check_options(max_batch=8, prefill_chunk=16, mixed_prefill=True, mixed_max_rows=32)  # both bounds exactly
    with pytest.raises(ValueError, match="2 x --max-batch"):
        check_options(max_batch=8, prefill_chunk=15, mixed_prefill=True, mixed_max_rows=0)
    with pytest.raises(ValueError, match="2 x --prefill-chunk"):
        check_options(max_batch=8, prefill_chunk=16, mixed_prefill=True, mixed_max_rows=31)
    with pytest.raises(ValueError, match="--mixed-max-rows must be >= 0"):
        check_options(max_batch=8, prefill_chunk=16, mixed_prefill=True, mixed_max_rows=-1)
    EngineOptions(max_batch=1)
    for bad, why in (({"max_batch": 0}, "not resolved"), ({"host_cache_gib": 1.0}, "needs the prefix cache"),
                     ({"kv_blocks": 8}, "a block count needs")):
        with pytest.raises(ValueError, match=why):
            EngineOptions(**bad)
    EngineOptions(host_cache_gib=1.0, prefix_cache=True)
    EngineOptions(kv_blocks=8, kv_block_tokens=16)


class _Scheduler:
    """What DecodeEngine.prefill asks of the scheduler: whether a row decodes, and the two ways in."""

    def __init__(self, active: bool = False):
        self.busy = active

    def active(self) -> bool:
        return self.busy

    def submit(self, job):
        return ("whole", job)

    def submit_mixed(self, mp):
        return ("mixed", mp.start, mp.ids.shape[0])


@pytest.mark.parametrize("n, start, invariant, active, route", [
    (8, 0, False, False, "whole"),  # fits one chunk, nothing decodes: the prefill worker's forward, bit for bit
    (9, 0, False, False, "mixed"),  # longer than a chunk
    (8, 0, False, True, "mixed"),  # a row decodes: in the steps
    (8, 3, False, False, "mixed"),  # after a reused prefix: in the steps
    (4, 0, True, False, "mixed"),  # batch-invariant: always in the steps
])
def test_a_local_prefill_takes_the_whole_forward_only_when_it_fits_one_chunk_alone(n, start, invariant, active,
                                                                                   route):
    """kills DecodeEngine.prefill's `len(token_ids) > o.prefill_chunk` -> `>=` (a prompt of exactly one chunk, alone,
    no longer bit-identical to a disaggregated one), and `start` or `o.batch_invariant` dropped from its condition
    (a reused prefix or the invariant mode prefilled by the whole-prompt forward)."""
    opts = EngineOptions(max_batch=4, prefill_chunk=8, mixed_prefill=True, batch_invariant=invariant)
    fake = SimpleNamespace(options=opts, scheduler=_Scheduler(active), m=SimpleNamespace(device=torch.device("cpu")),
                           prefill_job=lambda *a: "job")
    got = DecodeEngine.prefill(fake, list(range(n)), "lease", False, start=start)
    assert got[0] == route
    if route == "mixed":
        assert got[1:] == (start, n)


@pytest.fixture(scope="module")
def engine_eos():
    """An engine over its own tiny copy whose config lists two end-of-sequence ids."""
    model = load_model(ModelSpec("tiny", "float32", 0))
    model.config.eos_token_id = [3, 7]
    lm = SimpleNamespace(model=model, geometry=CacheGeometry.from_config(model.config, torch.float32),
                         device=torch.device("cpu"))
    e = DecodeEngine(lm, EngineOptions(max_batch=2, max_seq_len=64, cuda_graphs=False))
    yield e
    e.close()


def test_the_engine_ends_on_every_eos_id_of_a_list_and_digests_only_when_asked(engine_eos):
    """kills the engine's `(eos or [])` -> `[]` (a model listing its eos ids, as Llama 3 does, never ended a
    sequence), and a local prefill's digest computed when not asked for (`logits_digest(logits) if want_digest`)."""
    assert engine_eos.eos == frozenset({3, 7})
    lease = engine_eos.pool.try_lease()
    try:
        plain = engine_eos.prefill(list(range(10, 20)), lease, False).result(timeout=30)
        lease2 = engine_eos.pool.try_lease()
        digested = engine_eos.prefill(list(range(10, 20)), lease2, True).result(timeout=30)
        lease2.release()
    finally:
        lease.release()
    assert plain.digest == "" and digested.digest and plain.first == digested.first


# --- engine/pool_copies.py ---

GEO = CacheGeometry(num_layers=2, kv_heads=2, head_dim=4, dtype=torch.float32)


def test_a_view_is_of_one_to_page_positions():
    """kills views' `0 < seq_len` -> `0 <=` (an empty view handed to a transport) and `seq_len > self.page` loosened
    (a view past its block's end: fewer positions than asked, silently)."""
    fixed = KVPool(GEO, torch.device("cpu"), slots=2, max_seq=8)
    assert fixed.views(1, 8)[0][0].shape == (1, 2, 8, 4)
    with pytest.raises(ValueError, match="do not fit"):
        fixed.views(1, 0)
    paged = KVPool(GEO, torch.device("cpu"), slots=2, max_seq=16, page=4)
    lease = paged.try_lease(16)
    assert paged.views(lease.slot, 4)[1][1].shape == (1, 2, 4, 4)
    with pytest.raises(ValueError, match="span several"):
        paged.views(lease.slot, 5)


def test_positions_past_a_rows_blocks_are_refused_as_a_value_error():
    """kills _index's `len(rows) * self.page < p1` -> `< p1 - 1` and write_layer's `len(ids) < full + (1 if rest
    else 0)` -> `< full` (an IndexError from the block list instead of the ValueError that names the slot)."""
    pool = KVPool(GEO, torch.device("cpu"), slots=2, max_seq=16, page=4)
    lease = pool.try_lease(8)  # two blocks: positions 0..7
    pool.read(lease.slot, 0, 8)
    with pytest.raises(ValueError, match="holds 8 positions, not 9"):
        pool.read(lease.slot, 0, 9)
    k = torch.randn(1, 2, 10, 4)
    with pytest.raises(ValueError, match="holds 8 positions, not 10"):
        pool.write_layer(lease.slot, 0, 0, k, k)


def test_the_slot_layout_reads_writes_and_copies_exactly_the_positions_asked():
    """kills read's permute in the slot layout reordered (layers and k/v swapped in the token-major copy the host tier
    stores), write's likewise, and copy_prefix copying the whole row instead of its first n positions."""
    pool = KVPool(GEO, torch.device("cpu"), slots=3, max_seq=8)
    pool.kv.copy_(torch.randn(pool.kv.shape))
    got = pool.read(1, 2, 5)  # (3, layers, 2, kv_heads, head_dim)
    for i in range(2):
        for kv in range(2):
            assert torch.equal(got[:, i, kv], pool.kv[i, kv, 1, :, 2:5].transpose(0, 1))
    data = torch.randn(3, 2, 2, 2, 4)
    pool.write(2, 4, data)
    assert torch.equal(pool.read(2, 4, 7), data)
    before = pool.kv.clone()
    pool.copy_prefix(0, 2, 3)
    assert torch.equal(pool.kv[:, :, 2, :, :3], before[:, :, 0, :, :3])
    assert torch.equal(pool.kv[:, :, 2, :, 3:], before[:, :, 2, :, 3:])


# --- determinism.py ---


def test_enable_deterministic_sets_every_switch(monkeypatch):
    """kills enable_deterministic's workspace size changed (cuBLAS is deterministic only with ":4096:8" or
    ":16:8"; the mode pins the larger), `use_deterministic_algorithms(False)` and `cudnn.benchmark = True` (a
    timing picks cuDNN's algorithm). The process's switches are put back after."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    on, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    bench = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        determinism.enable_deterministic()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.benchmark
    finally:
        torch.use_deterministic_algorithms(on, warn_only=warn)
        torch.backends.cudnn.benchmark = bench
