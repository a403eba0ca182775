"""The search's vocabulary, shared by the draw's launches (triton_sample.py): value keys, the uniform, pivots.

Why apart: the draw is six kernels that must agree to the bit on what a value's key is, which uniform a row draws
and where a bracket's pivots fall; one definition each, here, keeps them from drifting.

Keys: a value's bits in the logits' dtype as a signed integer in value order (sign-magnitude to two's complement;
-0.0 and +0.0 share key 0), 16 bits for bf16/fp16, 32 for fp32, so a search over values is a search over
integers and closes exactly (hi = lo + 1). The uniform is `sampler.uniform` (SplitMix64 in uint64, its top 53
bits), hashed in the kernel so that a captured draw needs no host-made tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

INF_BITS = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00, torch.float32: 0x7F800000}  # +inf: NaNs are above


@triton.jit
def to_key(v, BITS: tl.constexpr, DT: tl.constexpr):
    """float32 values (exact in DT) -> int64 keys in value order: DT's bits, sign-magnitude to two's complement."""
    if BITS == 16:
        b = v.to(DT).to(tl.int16, bitcast=True).to(tl.int64)
        k = tl.where(b < 0, -(b & 0x7FFF), b)
    else:
        b = v.to(tl.int32, bitcast=True).to(tl.int64)
        k = tl.where(b < 0, -(b & 0x7FFFFFFF), b)
    return k


@triton.jit
def to_value(k, BITS: tl.constexpr, DT: tl.constexpr):
    """int64 keys -> their float32 values (the inverse of to_key)."""
    if BITS == 16:
        v = tl.where(k < 0, -k - 32768, k).to(tl.int16).to(DT, bitcast=True).to(tl.float32)
    else:
        v = tl.where(k < 0, -k - 2147483647 - 1, k).to(tl.int32).to(tl.float32, bitcast=True)
    return v


@triton.jit
def elem_key(x, BITS: tl.constexpr, INF_KEY: tl.constexpr):
    """A block of DT values -> int32 keys, NaN (either sign: torch's bf16 NaN is 0xFFFF) the largest, as torch's
    argmax takes it. The NaN test is on the bits: a magnitude past infinity's."""
    if BITS == 16:
        b = x.to(tl.int16, bitcast=True).to(tl.int32)
        mag = b & 0x7FFF
    else:
        b = x.to(tl.int32, bitcast=True)
        mag = b & 0x7FFFFFFF
    return tl.where(mag > INF_KEY, 2147483647, tl.where(b < 0, -mag, b))


@triton.jit
def mix64(z):
    """SplitMix64's finalizer on uint64 (products wrap mod 2**64)."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def uniform(seed, position):
    """int64 seed and position -> float64 in [0, 1): bit for bit `sampler.uniform`."""
    s = seed.to(tl.uint64, bitcast=True)
    p = position.to(tl.uint64, bitcast=True)
    z = mix64(mix64(s) + (p + 1) * 0x9E3779B97F4A7C15)
    return (z >> 11).to(tl.float64) * 1.1102230246251565e-16  # 2**-53


@triton.jit
def mixed_pivots(lo, hi, R: tl.constexpr, BITS: tl.constexpr, DT: tl.constexpr):
    """R keys in (lo, hi): half spread evenly over the values, half over the keys. Over the values, a crowded
    bracket's population shrinks fast (keys crowd near 0, where a logit body has few values); over the keys, it
    closes in a bounded number of rounds whatever the data. (_narrow needs no order among pivots.)"""
    j = tl.arange(0, R)
    half = j < R // 2
    f = ((j % (R // 2)) + 1).to(tl.float32) / (R // 2 + 1)
    lo_v, hi_v = to_value(lo, BITS, DT), to_value(hi, BITS, DT)
    v = lo_v * (1.0 - f) + hi_v * f  # no overflow at the float range's ends
    by_key = lo + ((hi - lo) * ((j % (R // 2)) + 1).to(tl.int64)) // (R // 2 + 1)
    finite = tl.abs(v) < float("inf")  # false for NaN too: an infinite end (a row with -inf logits)
    k = tl.where(half & finite, to_key(tl.where(finite, v, 0.0), BITS, DT), by_key)
    return tl.minimum(tl.maximum(k, lo + 1), hi - 1)
