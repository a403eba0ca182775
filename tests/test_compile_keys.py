"""A new prompt length must not compile a new Triton kernel: the launch's constexprs may not follow the slot's length.

Why: the fused prefill writes a prompt's K/V into a one-slot block of the prompt's own length
(kvtransfer/model/fused_prefill.py) through rope+store, the decode pool's kernel. A constexpr is part of a compiled
kernel's key, and the slot layout's positions were one (PAGE): every prompt of a length not seen before compiled
rope+store again, ~0.2 s on the serving thread (a 32k prompt's first chunk stalled 32 decoding streams 247 ms;
bench/results/stall-h100-2026-12-07/ call 11). Through Triton's own binder and compiler (sm_90, no GPU):
tests/test_kernels_sm90_compile.py::test_rope_store_compiles_for_sm90_once_for_every_block_length; on a GPU, counting
compiled kernels: tests/test_kernels_gpu.py::test_the_fused_prefill_compiles_nothing_for_a_new_prompt_length.
Runs on CPU: the kernel is replaced by a recorder of its launch arguments.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvtransfer.kernels import triton_rope  # noqa: E402
from kvtransfer.kernels.triton_paging import table_args  # noqa: E402


class _Launches:
    """Stands in for a @triton.jit kernel: kernel[grid](*args, **constexprs) records the constexprs."""

    def __init__(self):
        self.constexprs: list[dict] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.constexprs.append(kwargs)


def _rope_store_on_a_block(positions: int, rows: int = 3, hq: int = 4, hkv: int = 2, d: int = 16) -> None:
    q = torch.zeros(rows, hq, d, dtype=torch.bfloat16)
    k, v = (torch.zeros(rows, hkv, d, dtype=torch.bfloat16) for _ in range(2))
    cos, sin = torch.ones(rows, d), torch.zeros(rows, d)
    k_block, v_block = (torch.zeros(1, hkv, positions, d, dtype=torch.bfloat16) for _ in range(2))
    to_slot0, pos = torch.zeros(rows, dtype=torch.long), torch.arange(rows)
    triton_rope.rope_store_triton(q, k, v, cos, sin, k_block, v_block, to_slot0, pos)


def test_rope_store_on_a_block_of_any_length_launches_the_same_constexprs(monkeypatch):
    launches = _Launches()
    monkeypatch.setattr(triton_rope, "_rope_store_kernel", launches)
    for positions in (1535, 32511, 2048, 17):  # n + chunk - 1 for a 1k and a 32k prompt; even; short
        _rope_store_on_a_block(positions)
    assert len(launches.constexprs) == 4
    assert all(c == launches.constexprs[0] for c in launches.constexprs), launches.constexprs


@pytest.mark.parametrize("paged", [False, True])
def test_table_args_give_a_rows_positions_as_width_times_page(paged):
    pool = torch.zeros(5, 2, 64 if paged else 1535, 16)
    table = torch.zeros(3, 7, dtype=torch.int32) if paged else None
    _, _, width, page, is_paged = table_args(table, pool)
    assert is_paged == paged
    assert width * page == (7 * 64 if paged else 1535)
    assert page == (64 if paged else 1)  # the slot layout's length is a runtime int, never a constexpr
