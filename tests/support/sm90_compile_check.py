"""Compile every kernel variant the GPU tests and bench use for sm_90, on a machine with no GPU.

Why: GPU time is scarce; the Triton interpreter checks the logic but not what the compiler
accepts. This goes through the real JIT binder (argument specialization, divisibility) with
a stand-in driver that reports an sm_90 target, compiles to cubin with the ptxas bundled in
the triton wheel, and stops before any launch. It relies on Triton 3.6 internals
(driver.set_active, triton.compiler.compile); run it in its own process:
`python tests/support/sm90_compile_check.py` (tests/test_kernels_sm90_compile.py does).
Prints one line per compiled kernel (shared memory, warps, stages) and exits non-zero on error.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.compiler
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

SM90 = GPUTarget("cuda", 90, 32)


class _Sm90Driver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return SM90

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


class _Compiled(Exception):
    """Raised after a kernel compiled, instead of launching it."""


def _install() -> list[str]:
    driver.set_active(_Sm90Driver())
    done: list[str] = []
    real_compile = triton.compiler.compile

    def compile_only(src, target=None, options=None, _env_vars=None):
        kernel = real_compile(src, target=SM90, options=options, _env_vars=_env_vars)
        md = kernel.metadata
        done.append(src.name)
        print(f"ok {src.name}: shared={md.shared} B warps={md.num_warps} stages={md.num_stages}", flush=True)
        raise _Compiled()

    triton.compiler.compile = compile_only
    return done


def _keys() -> list[tuple[str, str]]:
    """After _install: each compile's (kernel name, source key: signature, specializations, constants), in order.
    Two launches bind one kernel iff their keys are equal (the compile-once tests)."""
    compile_only, keys = triton.compiler.compile, []

    def keyed(src, target=None, options=None, _env_vars=None):
        keys.append((src.name, src.hash()))
        return compile_only(src, target=target, options=options, _env_vars=_env_vars)

    triton.compiler.compile = keyed
    return keys


def _run(fn) -> None:
    try:
        fn()
    except _Compiled:
        pass


def _attention(ta, tas, hq, hkv, d, dtype, batch, max_seq, splits=None) -> None:
    q = torch.empty(batch, hq, d, dtype=dtype)
    pool = torch.empty(batch + 1, hkv, max_seq, d, dtype=dtype)
    idx = torch.zeros(batch, dtype=torch.int64)
    _run(lambda: ta.decode_attention_triton(q, pool, pool, idx, idx, 0.1, num_splits=splits))  # stage 1
    ns = splits or ta.choose_num_splits(batch, hkv, triton.cdiv(hq // hkv, ta.BLOCK_H), max_seq, 132)
    mid_o, mid_lse = torch.empty(batch, hq, ns, d), torch.empty(batch, hq, ns)
    out = torch.empty(batch, hq, d, dtype=dtype)
    _run(lambda: tas.merge_splits(mid_o, mid_lse, idx, out, max_seq, ta.BLOCK_N))  # stage 2
    _run(lambda: tas.merge_splits(mid_o, mid_lse, idx, out, max_seq, ta.BLOCK_N, 1, 7))  # the probe's launch


def _attention_fixed(ta, tas, hq, hkv, d, dtype, batch, max_seq, page=None) -> None:
    """The batch-invariant mode's two kernels: stage 1 with SPLIT_SIZE, the fixed-tile merge."""
    q, idx = torch.empty(batch, hq, d, dtype=dtype), torch.zeros(batch, dtype=torch.int64)
    if page is None:
        pool, table = torch.empty(batch + 1, hkv, max_seq, d, dtype=dtype), None
    else:
        pool = torch.empty(4096, hkv, page, d, dtype=dtype)
        table = torch.zeros(batch + 1, max_seq // page, dtype=torch.int32)
    split = tas.INVARIANT_SPLIT_SIZE
    _run(lambda: ta.decode_attention_triton(q, pool, pool, idx, idx, 0.1, block_table=table, split_size=split))
    ns = triton.cdiv(max_seq, split)
    mid_o, mid_lse = torch.empty(batch, hq, ns, d), torch.empty(batch, hq, ns)
    _run(lambda: tas.merge_fixed_splits(mid_o, mid_lse, idx, q, max_seq, split))


def _sample(ts, dtype, n: int, vocab: int) -> int:
    """The draw's launches (six; the round kernel twice, one variant a round) one at a time: sample_triton runs
    again and again, each launch whose variant compiled before skipped, until a call compiles nothing. Returns
    how many compiled."""
    seen: set[tuple] = set()
    from kvtransfer.kernels import triton_sample_passes as tp
    kernels = [tp.range_kernel, tp.round_kernel, tp.compact_kernel, ts._search_kernel, ts._draw_kernel]
    real = {k: k.run for k in kernels}

    def skip_seen(k):
        def run(*args, **kwargs):
            key = (k.fn.__name__, kwargs.get("ROUND"))
            if key in seen:
                return None
            seen.add(key)
            return real[k](*args, **kwargs)  # compiles, then raises _Compiled
        return run

    for k in kernels:
        k.run = skip_seen(k)
    try:
        logits, f, i = torch.empty(n, vocab, dtype=dtype), torch.ones(n), torch.zeros(n, dtype=torch.int64)
        for _ in range(10):
            before = len(seen)
            _run(lambda: ts.sample_triton(logits, f, f * 0.9, i, i, i))
            if len(seen) == before:
                break
    finally:
        for k in kernels:
            k.run = real[k]
    return len(seen)


def main() -> int:
    done = _install()
    from kvtransfer.kernels import triton_attention as ta
    from kvtransfer.kernels import triton_attention_split as tas
    from kvtransfer.kernels import triton_norm as tn
    from kvtransfer.kernels import triton_rope as tr

    ta._upcast_dots = lambda q: q.dtype == torch.float32  # what CUDA tensors get
    bf16 = torch.bfloat16
    for cfg in [(28, 4, 128, bf16, 1, 32768), (28, 4, 128, torch.float32, 1, 32768), (28, 4, 128, bf16, 64, 1024),
                (4, 2, 16, bf16, 7, 1000), (4, 2, 16, torch.float16, 7, 1000), (4, 2, 16, torch.float32, 7, 1000),
                (9, 3, 64, bf16, 7, 1000), (4, 4, 64, bf16, 3, 800), (40, 2, 128, bf16, 3, 800)]:
        _attention(ta, tas, *cfg)
    _attention(ta, tas, 28, 4, 128, bf16, 8, 8192, splits=1)
    for cfg in [(28, 4, 128, bf16, 64, 32768), (28, 4, 128, torch.float32, 1, 32768), (4, 2, 16, bf16, 7, 1024)]:
        _attention_fixed(ta, tas, *cfg)
    _attention_fixed(ta, tas, 28, 4, 128, bf16, 64, 8192, page=16)
    for batch, hq, hkv, d in ((64, 28, 4, 128), (2, 4, 1, 16)):
        q, k = torch.empty(batch, hq, d, dtype=bf16), torch.empty(batch, hkv, d, dtype=bf16)
        cs, pool = torch.empty(batch, d), torch.empty(batch + 1, hkv, 1024, d, dtype=bf16)
        idx, pos = torch.zeros(batch, dtype=torch.int64), torch.zeros(batch, dtype=torch.int32)
        _run(lambda: tr.rope_store_triton(q, k, k, cs, cs, pool, pool, idx, pos))
    from kvtransfer.kernels import triton_chunk_attention as tc
    for hq, hkv, d, dtype in ((28, 4, 128, bf16), (28, 4, 128, torch.float32), (9, 3, 64, bf16)):
        pool = torch.empty(3, hkv, 1024, d, dtype=dtype)
        _run(lambda: tc.chunk_attention_triton(torch.empty(224, hq, d, dtype=dtype), pool, pool,
                                               torch.zeros(4, 4, dtype=torch.int32), 0.1))
    for page in (16, 64):  # the paged pool: a table load per position (page < BLOCK_N) or per tile
        q, pool = torch.empty(64, 28, 128, dtype=bf16), torch.empty(4096, 4, page, 128, dtype=bf16)
        idx, table = torch.zeros(64, dtype=torch.int64), torch.zeros(65, 8192 // page, dtype=torch.int32)
        _run(lambda: ta.decode_attention_triton(q, pool, pool, idx, idx, 0.1, block_table=table))  # stage 1
    pool = torch.empty(4096, 4, 16, 128, dtype=bf16)
    _run(lambda: tc.chunk_attention_triton(torch.empty(224, 28, 128, dtype=bf16), pool, pool,
                                           torch.zeros(4, 4, dtype=torch.int32), 0.1, block_table=table))
    q, k = torch.empty(64, 28, 128, dtype=bf16), torch.empty(64, 4, 128, dtype=bf16)
    cs, pos = torch.empty(64, 128), torch.zeros(64, dtype=torch.int32)
    _run(lambda: tr.rope_store_triton(q, k, k, cs, cs, pool, pool, idx, pos, block_table=table))
    from kvtransfer.kernels import triton_mixed_attention as tm
    for page, tbl in ((0, None), (16, table)):  # the fused mixed step (64 decode rows + 448 prompt rows), slots / paged
        pool = torch.empty(4096, 4, page, 128, dtype=bf16) if page else torch.empty(65, 4, 1024, 128, dtype=bf16)
        _run(lambda: tm.mixed_attention_triton(torch.empty(512, 28, 128, dtype=bf16), pool, pool, 64, idx, idx,
                                               torch.zeros(4, 4, dtype=torch.int32), 0.1, block_table=tbl))
    x, w = torch.empty(64, 3584, dtype=bf16), torch.empty(3584, dtype=bf16)
    _run(lambda: tn.rms_norm_triton(x, w, 1e-6))
    _run(lambda: tn.rms_norm_triton(x, w, 1e-6, residual=x))
    _run(lambda: tn.silu_mul_triton(torch.empty(64, 2 * 18944, dtype=bf16)))
    from kvtransfer.kernels import triton_sample as ts
    sampled = _sample(ts, bf16, 64, 152064) + _sample(ts, torch.float32, 1, 152064)  # P 4 and Q 4; P 32 and Q 4
    if sampled != 12:
        print(f"the draw: {sampled} of 12 launches ran to a compile")
    expected = 3 * 10 + 2 + 3 + 3 + 12 + 4 + 2 * 4 + 2  # 3 * 10: stage 1, its merge and the probe's merge launch
    # + 4: the paged decode (two pages), chunk and rope+store; + 2: the fused mixed kernel (slots, paged)
    # + 2 * 4: the fixed-split mode's stage 1 and merge (bf16, fp32, D 16, paged)
    print(f"compiled {len(done)} of {expected} kernels for sm_90")
    return 0 if len(done) == expected else 1


if __name__ == "__main__":
    sys.exit(main())
