# temporary microbenchmark (replaced by the kernel)
import math
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def k_max(X, Out, stride, vocab, seg, P, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    s0 = p * seg
    end = tl.minimum(s0 + seg, vocab)
    acc = tl.full([BLOCK], float("-inf"), tl.float32)
    for s in range(s0, end, BLOCK):
        idx = s + offs
        x = tl.load(X + row * stride + idx, mask=idx < end, other=float("-inf")).to(tl.float32)
        acc = tl.maximum(acc, x)
    tl.store(Out + row * P + p, tl.max(acc, 0))


@triton.jit
def k_hist(X, Out, H, stride, vocab, seg, P, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    s0 = p * seg
    end = tl.minimum(s0 + seg, vocab)
    acc = tl.full([BLOCK], float("-inf"), tl.float32)
    for s in range(s0, end, BLOCK):
        idx = s + offs
        ok = idx < end
        raw = tl.load(X + row * stride + idx, mask=ok, other=float("-inf"))
        b = raw.to(tl.int16, bitcast=True).to(tl.int32)
        k = tl.where(b < 0, -(b & 0x7FFF), b) + 32768
        tl.atomic_add(H + row * 65536 + k, 1, mask=ok, sem="relaxed")
        acc = tl.maximum(acc, raw.to(tl.float32))
    tl.store(Out + row * P + p, tl.max(acc, 0))


@triton.jit
def k_exp(X, Out, stride, vocab, seg, P, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    s0 = p * seg
    end = tl.minimum(s0 + seg, vocab)
    M = 10.0
    acc = tl.zeros([BLOCK], tl.int64)
    for s in range(s0, end, BLOCK):
        idx = s + offs
        x = tl.load(X + row * stride + idx, mask=idx < end, other=float("-inf")).to(tl.float32)
        w = tl.exp2((x - M) * 1.4426950408889634)
        acc += (w * 1099511627776.0).to(tl.int64)
    tl.store(Out + row * P + p, tl.sum(acc, 0).to(tl.float32))


@triton.jit
def k_exp_ge(X, Out, stride, vocab, seg, P, BLOCK: tl.constexpr):
    """exp, fixed point, int64 sums of the total and of x >= tau (the draw's mass pass)"""
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    s0 = p * seg
    end = tl.minimum(s0 + seg, vocab)
    M = 10.0
    acc = tl.zeros([BLOCK], tl.int64)
    for s in range(s0, end, BLOCK):
        idx = s + offs
        x = tl.load(X + row * stride + idx, mask=idx < end, other=float("-inf")).to(tl.float32)
        w = tl.exp2((x - M) * 1.4426950408889634)
        acc += tl.where(x >= -1.0, (w * 1099511627776.0).to(tl.int64), 0)
    tl.store(Out + row * P + p, tl.sum(acc, 0).to(tl.float32))


@triton.jit
def k_whist(X, Out, H, HM, stride, vocab, seg, P, BLOCK: tl.constexpr):
    """fp32-style: int32 count + int64 mass atomics per element"""
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    s0 = p * seg
    end = tl.minimum(s0 + seg, vocab)
    M = 10.0
    for s in range(s0, end, BLOCK):
        idx = s + offs
        ok = idx < end
        raw = tl.load(X + row * stride + idx, mask=ok, other=float("-inf"))
        b = raw.to(tl.int16, bitcast=True).to(tl.int32)
        k = tl.where(b < 0, -(b & 0x7FFF), b) + 32768
        w = tl.exp2((raw.to(tl.float32) - M) * 1.4426950408889634)
        tl.atomic_add(H + row * 65536 + k, 1, mask=ok, sem="relaxed")
        tl.atomic_add(HM + row * 65536 + k, (w * 1099511627776.0).to(tl.int64), mask=ok, sem="relaxed")
    tl.store(Out + row * P + p, 0.0)


@triton.jit
def k_tlhist(X, Out, stride, vocab, seg, P, BLOCK: tl.constexpr, BINS: tl.constexpr, SHIFT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    s0 = p * seg
    end = tl.minimum(s0 + seg, vocab)
    acc = tl.zeros([BINS], tl.int32)
    for s in range(s0, end, BLOCK):
        idx = s + offs
        ok = idx < end
        raw = tl.load(X + row * stride + idx, mask=ok, other=float("-inf"))
        b = raw.to(tl.int16, bitcast=True).to(tl.int32)
        k = tl.where(b < 0, -(b & 0x7FFF), b) + 32768
        acc += tl.histogram(k >> SHIFT, BINS, mask=ok)
    tl.store(Out + row * P + p, tl.sum(acc, 0).to(tl.float32))


@triton.jit
def k_cmp(X, Out, stride, vocab, seg, P, BLOCK: tl.constexpr, R: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    offs = tl.arange(0, BLOCK)[None, :]
    s0 = p * seg
    end = tl.minimum(s0 + seg, vocab)
    piv = (tl.arange(0, R).to(tl.float32) - 4.0)[:, None]
    M = 10.0
    acc_c = tl.zeros([R, BLOCK], tl.int32)
    acc_m = tl.zeros([R, BLOCK], tl.float32)
    for s in range(s0, end, BLOCK):
        idx = s + offs
        x = tl.load(X + row * stride + idx, mask=idx < end, other=float("-inf")).to(tl.float32)
        w = tl.exp2((x - M) * 1.4426950408889634)
        ge = x >= piv
        acc_c += ge.to(tl.int32)
        acc_m += tl.where(ge, w, 0.0)
    tl.store(Out + row * P + p, tl.sum(tl.sum(acc_m, 1), 0) + tl.sum(tl.sum(acc_c, 1), 0).to(tl.float32))


@triton.jit
def k_cmp64(X, Out, stride, vocab, seg, P, BLOCK: tl.constexpr, R: tl.constexpr, MASS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    offs = tl.arange(0, BLOCK)[None, :]
    s0 = p * seg
    end = tl.minimum(s0 + seg, vocab)
    piv = (tl.arange(0, R).to(tl.float32) * 0.5 - 4.0)[:, None]
    M = 10.0
    acc_c = tl.zeros([R, BLOCK], tl.int32)
    acc_m = tl.zeros([R, BLOCK], tl.int64)
    acc_z = tl.zeros([1, BLOCK], tl.int64)
    for s in range(s0, end, BLOCK):
        idx = s + offs
        x = tl.load(X + row * stride + idx, mask=idx < end, other=float("-inf")).to(tl.float32)
        W = (tl.exp2((x - M) * 1.4426950408889634) * 1099511627776.0).to(tl.int64)
        acc_z += W
        ge = x >= piv
        acc_c += ge.to(tl.int32)
        if MASS:
            acc_m += tl.where(ge, W, 0)
    tl.store(Out + row * P + p, (tl.sum(tl.sum(acc_m, 1), 0) + tl.sum(tl.sum(acc_z, 1), 0)).to(tl.float32) + tl.sum(tl.sum(acc_c, 1), 0).to(tl.float32))


def logits(n, vocab, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, vocab, generator=g, device="cuda") * 2.5 - 2.0
    for j in range(n):
        head = int(torch.randint(1, 400, (1,), generator=g, device="cuda"))
        ids = torch.randint(0, vocab, (head,), generator=g, device="cuda")
        x[j, ids] += 5.0 + 10.0 * torch.rand(head, generator=g, device="cuda")
    return x.to(torch.bfloat16)


def timeit(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    ts = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / reps)
    return sorted(ts)[3]


def main():
    vocab = 152064
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print("sms", sms, "triton", triton.__version__)
    for n in (1, 8, 32, 64):
        P = max(1, min(32, math.ceil(2 * sms / n)))
        seg = triton.cdiv(triton.cdiv(vocab, P), 512) * 512
        P = triton.cdiv(vocab, seg)
        x = logits(n, vocab)
        out = torch.empty(n * P, device="cuda")
        H = torch.zeros(n, 65536, dtype=torch.int32, device="cuda")
        HM = torch.zeros(n, 65536, dtype=torch.int64, device="cuda")
        res = {}
        g = (n, P)
        for nw, blk in ((4, 512), (8, 512), (8, 1024), (4, 256)):
            kw = dict(BLOCK=blk, num_warps=nw)
            res[f"exp{nw}/{blk}"] = timeit(lambda: k_exp[g](x, out, vocab, vocab, seg, P, **kw))
            for R in (4, 8, 16):
                if R * blk > 8192:
                    continue
                res[f"c{R}f{nw}/{blk}"] = timeit(lambda: k_cmp[g](x, out, vocab, vocab, seg, P, R=R, **kw))
                res[f"c{R}i{nw}/{blk}"] = timeit(lambda: k_cmp64[g](x, out, vocab, vocab, seg, P, R=R, MASS=True, **kw))
                res[f"c{R}n{nw}/{blk}"] = timeit(lambda: k_cmp64[g](x, out, vocab, vocab, seg, P, R=R, MASS=False, **kw))
        print(f"n={n} P={P} seg={seg}: " + ", ".join(f"{k} {v:.1f}" for k, v in res.items()))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
