"""Every Triton kernel variant compiles for sm_90 (H200) on a machine without a GPU.

Why: GPU time is scarce and the interpreter does not check what the compiler accepts. Runs
tests/support/sm90_compile_check.py in its own process (it swaps Triton's driver).
Skipped without triton, under the interpreter, and where CUDA is present (the GPU tests
compile for real there). The batch-invariant GEMM (kvtransfer/kernels/triton_matmul.py) is compiled by its own
test with the same stand-in driver, which also checks that M = 1, 7 and 200 bind one compiled kernel. The
fixed-split decode attention of the same mode (kvtransfer/kernels/triton_attention_split.py) is compiled by the main
check, and its own test checks that batch 1, 7 and 64 bind one compiled kernel of each of its two stages.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")
pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the GPU tests compile for real"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs the compiler, not the interpreter"),
]


SUPPORT = os.path.join(os.path.dirname(__file__), "support")


def _run_alone(*args: str, timeout: int = 600) -> None:
    """python ARGS in a process of its own (the check swaps Triton's driver), not under the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    res = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def test_all_kernels_compile_for_sm90():
    _run_alone(os.path.join(SUPPORT, "sm90_compile_check.py"), timeout=900)


# Through sm90_compile_check's stand-in driver; each compile's source key (signature, specializations, constants)
# recorded, so M = 1 (which Triton would specialize on) must bind the kernel M = 200 binds.
_INVARIANT_GEMM = """
import sys
import torch
sys.path.insert(0, sys.argv[1])
from sm90_compile_check import _install, _keys, _run
done = _install()
keys = _keys()
from kvtransfer.kernels.triton_matmul import matmul_triton
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for bias in (None, torch.empty(4608, dtype=dtype)):
        before = len(keys)
        for m in (1, 7, 200):
            _run(lambda: matmul_triton(torch.empty(m, 3584, dtype=dtype), torch.empty(4608, 3584, dtype=dtype), bias))
        if len(keys) - before != 3 or len(set(keys[before:])) != 1:
            sys.exit(f"{dtype} bias={bias is not None}: M = 1, 7, 200 bound {len(set(keys[before:]))} kernels")
sys.exit(0 if len(done) == 18 else f"compiled {len(done)} of 18")
"""


def test_invariant_gemm_compiles_for_sm90_once_for_every_row_count():
    _run_alone("-c", _INVARIANT_GEMM, SUPPORT)


# The fixed-split decode attention: batch 1 (which Triton would specialize on, were it an argument), 7 and 64 must
# bind one stage-1 and one merge kernel, slot and paged: nothing compiled may depend on the batch.
_INVARIANT_ATTENTION = """
import sys
import torch
sys.path.insert(0, sys.argv[1])
from sm90_compile_check import _attention_fixed, _install, _keys
done = _install()
keys = _keys()
from kvtransfer.kernels import triton_attention as ta, triton_attention_split as tas
ta._upcast_dots = lambda q: q.dtype == torch.float32  # what CUDA tensors get
for page in (None, 16):
    before = len(keys)
    for batch in (1, 7, 64):
        _attention_fixed(ta, tas, 28, 4, 128, torch.bfloat16, batch, 8192, page=page)
    if len(keys) - before != 6 or len(set(keys[before:])) != 2:
        sys.exit(f"page {page}: batch 1, 7, 64 bound {sorted(set(keys[before:]))}")
sys.exit(0 if len(done) == 12 else f"compiled {len(done)} of 12")
"""


def test_fixed_split_attention_compiles_for_sm90_once_for_every_batch():
    _run_alone("-c", _INVARIANT_ATTENTION, SUPPORT)


# rope+store into the fused prefill's one-slot block, whose length is the prompt's own: block lengths of different
# divisibility (Triton specializes ints on 16 | n) must bind one compiled kernel. A length that reached the kernel as
# a constexpr (the slot layout's PAGE, until 2026-12-07) compiled it again for every new prompt length.
_ROPE_BLOCK = """
import sys
import torch
sys.path.insert(0, sys.argv[1])
from sm90_compile_check import _install, _keys, _run
done = _install()
keys = _keys()
from kvtransfer.kernels import triton_rope as tr
rows, hq, hkv, d = 8, 28, 4, 128
q = torch.empty(rows, hq, d, dtype=torch.bfloat16)
k = torch.empty(rows, hkv, d, dtype=torch.bfloat16)
cs = torch.empty(rows, d, dtype=torch.float32)
to_slot0, pos = torch.zeros(rows, dtype=torch.long), torch.arange(rows)
for positions in (1535, 32511, 2048, 17):
    block = torch.empty(1, hkv, positions, d, dtype=torch.bfloat16)
    _run(lambda: tr.rope_store_triton(q, k, k, cs, cs, block, block, to_slot0, pos))
if len(keys) != 4 or len(set(keys)) != 1:
    sys.exit(f"block lengths 1535, 32511, 2048, 17 bound {len(set(keys))} kernels in {len(keys)} compiles")
sys.exit(0)
"""


def test_rope_store_compiles_for_sm90_once_for_every_block_length():
    _run_alone("-c", _ROPE_BLOCK, SUPPORT)
