"""Builders of decode-step inputs shared by the kernel tests and bench.

Why: every test and the benchmark need the same kind of batch (ragged rows in shuffled
slots, padded rows on a scratch slot, garbage past each row's length), built reproducibly
on any device; keeping it in one place keeps them comparable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DecodeCase:
    q: torch.Tensor  # (B, Hq, D)
    k_pool: torch.Tensor  # (S, Hkv, T, D)
    v_pool: torch.Tensor  # (S, Hkv, T, D)
    slots: torch.Tensor  # (B,)
    lengths: torch.Tensor  # (B,)
    scratch_slot: int

    @property
    def scale(self) -> float:
        return self.q.shape[-1] ** -0.5


def decode_case(
    lengths: list[int],
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    max_seq: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
    pad_rows: int = 0,
    garbage: float | None = float("nan"),
    q_scale: float = 1.0,
    shuffle: bool = True,
    index_dtype: torch.dtype = torch.int64,
) -> DecodeCase:
    """Rows with `lengths` in shuffled slots, then `pad_rows` rows of length 1 on the scratch
    slot (the last one). Pool positions at or past each slot's length hold `garbage`
    (None: leave the random values) so that reading them shows up in the output."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)  # bulk data, made on the device
    cpu_gen = torch.Generator().manual_seed(seed)  # small index data, made on the CPU
    real = len(lengths)
    num_slots = real + 1
    scratch = num_slots - 1
    shape = (num_slots, kv_heads, max_seq, head_dim)
    k_pool = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    v_pool = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    perm = torch.randperm(real, generator=cpu_gen) if shuffle else torch.arange(real)
    perm = perm.to(device)
    slots = torch.cat([perm, torch.full((pad_rows,), scratch, device=device, dtype=perm.dtype)])
    lens = torch.tensor(list(lengths) + [1] * pad_rows, device=device)
    if garbage is not None:
        slot_len = torch.ones(num_slots, dtype=torch.long, device=device)
        slot_len[slots] = lens  # scratch keeps length 1
        dead = torch.arange(max_seq, device=device)[None, :] >= slot_len[:, None]  # (S, T)
        dead = dead[:, None, :, None]
        k_pool.masked_fill_(dead, garbage)
        v_pool.masked_fill_(dead, garbage)
    q = (torch.randn((real + pad_rows, q_heads, head_dim), generator=gen, device=device) * q_scale).to(dtype)
    return DecodeCase(q, k_pool, v_pool, slots.to(index_dtype), lens.to(index_dtype), scratch)


def ragged_lengths(batch: int, max_len: int, seed: int = 0) -> list[int]:
    """`batch` lengths uniform in [max_len // 2, max_len], reproducible."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(max_len // 2, max_len + 1, (batch,), generator=gen).tolist()


def attention_gold(case: DecodeCase) -> torch.Tensor:
    """fp64 attention from the same (rounded) inputs, exact slices per row -> (B, Hq, D) fp32.

    fp64 so that no TF32 setting or matmul path can blur it."""
    q = case.q.double()
    groups = q.shape[1] // case.k_pool.shape[1]
    out = torch.empty_like(q)
    for b, (slot, length) in enumerate(zip(case.slots.tolist(), case.lengths.tolist())):
        k = case.k_pool[slot, :, :length].double().repeat_interleave(groups, dim=0)  # (Hq, L, D)
        v = case.v_pool[slot, :, :length].double().repeat_interleave(groups, dim=0)
        probs = torch.softmax((k @ q[b][:, :, None])[:, :, 0] * case.scale, dim=-1)  # (Hq, L)
        out[b] = (probs[:, None, :] @ v)[:, 0, :]
    return out.float()


def paged_copy(pool: torch.Tensor, page: int, seed: int = 0, spare: int = 3,
               width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same K or V as a slot pool (S, Hkv, T, D) laid out in blocks of `page` positions, in shuffled order.

    Returns (paged pool (S * T / page + spare, Hkv, page, D), table (S, width) int32): slot s's position n is block
    table[s, n // page] at offset n % page. The blocks of a slot are scattered (a random permutation of all
    blocks), `spare` blocks hold garbage no table names, and table columns past T / page (width > T / page) name
    a garbage block: a kernel that reads a wrong block, or past a row's length, shows up in its output."""
    slots, hkv, t, d = pool.shape
    if t % page:
        raise ValueError(f"{t} positions per slot are not a whole number of {page}-position blocks")
    per_slot = t // page
    width = width or per_slot
    gen = torch.Generator().manual_seed(seed)
    total = slots * per_slot + spare
    perm = torch.randperm(total, generator=gen)
    out = torch.full((total, hkv, page, d), float("nan"), dtype=pool.dtype, device=pool.device)
    table = torch.full((slots, width), int(perm[-1]) if spare else 0, dtype=torch.int32)
    blocks = pool.reshape(slots, hkv, per_slot, page, d).transpose(1, 2)  # (S, per_slot, Hkv, page, D)
    for s in range(slots):
        ids = perm[s * per_slot:(s + 1) * per_slot]
        out[ids.to(pool.device)] = blocks[s]
        table[s, :per_slot] = ids.to(torch.int32)
    return out, table.to(pool.device)
