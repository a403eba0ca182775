"""The mixed step's attention on one GPU: the chunk kernel's tiling, and the two kernels side by side (issue #39).

Why: in a 512-row mixed step (64 decode rows at 1k, 448 prompt rows at positions 512-959: the profile's case,
bench/probes/profile_mixed.py) attention took ~19% of the step, the prompt rows' kernel running far under the
tensor cores' rate and the decode rows' kernel alone on the GPU. This times, on Qwen2.5-7B's heads (28 q / 4 kv,
D 128, bf16, 64-token pages), each in a CUDA graph of LAYERS launches (as the step replays them):
  chunk   kernels.chunk_attention at each (BLOCK_M, warps, stages) of the sweep, its TFLOP/s (QK^T and PV of the
          causal rows), and its output against the module's default (max |diff| / max |out|);
  pair    the decode rows' kernel then the chunk rows' one on one stream, vs the chunk kernel on a side stream
          beside it (engine/side_stream.py), vs each alone;
  decode  with --decode-sweep: the decode rows' kernel at other launches (warps, stages, splits, BLOCK_N), its K/V read rate
          against the copy bandwidth measured in the same run, and the pair's time with that launch;
  pairs   with --pair-sweep: the pair at other launches (which kernel takes the side stream, the decode kernel's
          splits and stage-2 launch);
  splits  with --split-sweep ROWS@CONTEXT,...: only the decode kernel at each split count (re-tuning
          triton_attention.choose_num_splits).
Times are medians of REPLAYS replays. Run on the GPU machine: `python3 -m bench.probes.chunk_attention`; prints
one JSON line (and a line per row).
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.measure.kernel_inputs import paged_copy
from kvtransfer.engine.runner import graph_us
from kvtransfer.engine.side_stream import SideStream
from kvtransfer.kernels import ops as K
from kvtransfer.kernels import triton_chunk_attention as TC

HQ, HKV, D, PAGE = 28, 4, 128, 64
LAYERS = 28
REPLAYS = 7
SWEEP = [(64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 8, 2), (128, 8, 3), (32, 4, 2), (32, 2, 2)]


def graph_ms(calls, replays: int = REPLAYS) -> float:
    """Median GPU ms of one replay of `calls()` captured as a CUDA graph (the engine's own timer, runner.graph_us)."""
    return graph_us(calls, torch.device("cuda", torch.cuda.current_device()), replays) / 1e3


def case(decode: int, context: int, prompt_rows: int, prompt_start: int, seed: int = 0):
    """A paged pool of decode + 1 rows of `context + prompt_rows` positions, the decode rows' q at length `context`,
    one chunk of `prompt_rows` rows at prompt_start .. of the last row."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    seq = max(context, prompt_start + prompt_rows)
    seq = -(-seq // PAGE) * PAGE
    slots = decode + 1
    pools = [torch.randn(slots, HKV, seq, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2)]
    (kp, table), (vp, _) = (paged_copy(p, PAGE, seed=seed) for p in pools)
    q = torch.randn(decode + prompt_rows, HQ, D, device="cuda", generator=g).to(torch.bfloat16)
    rows = torch.arange(decode, device="cuda")
    lengths = torch.full((decode,), context, dtype=torch.int32, device="cuda")
    pieces = torch.tensor([[0, prompt_rows, decode, prompt_start], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0],
                           [prompt_rows, 0, -1, 0]], dtype=torch.int32, device="cuda")
    return q, kp, vp, table, rows, lengths, pieces


def causal_flops(rows: int, start: int) -> float:
    """QK^T and PV of `rows` rows at positions start.., each over its own past: 4 x Hq x D per (row, key)."""
    keys = rows * start + rows * (rows + 1) / 2
    return 4 * HQ * D * keys


def chunk_rows(q, kp, vp, table, pieces, decode, rows, start) -> list[dict]:
    qc, scale = q[decode:], D ** -0.5
    want = K.chunk_attention(qc, kp, vp, pieces, scale, block_table=table)
    out = []
    for bm, warps, stages in SWEEP:
        def calls():
            for _ in range(LAYERS):
                TC.chunk_attention_triton(qc, kp, vp, pieces, scale, table, block_m=bm, num_warps=warps,
                                          num_stages=stages)
        got = TC.chunk_attention_triton(qc, kp, vp, pieces, scale, table, block_m=bm, num_warps=warps,
                                        num_stages=stages)
        diff = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        ms = graph_ms(calls)
        row = {"rows": rows, "start": start, "block_m": bm, "warps": warps, "stages": stages,
               "ms_per_layer": ms / LAYERS, "tflops": causal_flops(rows, start) * LAYERS / (ms * 1e-3) / 1e12,
               "max_rel_diff_vs_default": diff}
        print("chunk", json.dumps(row), flush=True)
        out.append(row)
    return out


def pair_rows(q, kp, vp, table, rows_idx, lengths, pieces, decode) -> dict:
    scale, o = D ** -0.5, torch.empty_like(q)
    side = SideStream(q.device)

    def dec():
        K.decode_attention(q[:decode], kp, vp, rows_idx, lengths, scale, block_table=table, out=o[:decode])

    def chk():
        K.chunk_attention(q[decode:], kp, vp, pieces, scale, block_table=table, out=o[decode:])

    def serial():
        for _ in range(LAYERS):
            chk()
            dec()

    def beside():
        for _ in range(LAYERS):
            with side.fork():
                chk()
            dec()
            side.join()

    def decode_only():
        for _ in range(LAYERS):
            dec()

    def chunk_only():
        for _ in range(LAYERS):
            chk()
    res = {name: graph_ms(fn) for name, fn in (("serial_ms", serial), ("side_stream_ms", beside),
                                               ("decode_only_ms", decode_only), ("chunk_only_ms", chunk_only))}
    ref = o.clone()
    serial()
    torch.cuda.synchronize()
    res["side_equals_serial"] = bool(torch.equal(ref, o))
    print("pair", json.dumps(res), flush=True)
    return res


DECODE_SWEEP = [(4, 2, None, None), (4, 3, None, None), (4, 4, None, None), (8, 2, None, None), (8, 3, None, None),
                (4, 2, 2, None), (4, 2, 3, None), (4, 2, 6, None), (4, 2, 8, None), (4, 3, 8, None), (4, 2, 16, None),
                (4, 2, None, 32), (4, 3, None, 32), (2, 3, None, 32), (4, 2, None, 128), (8, 3, None, 128),
                (4, 3, 2, 128)]  # stage 1's (warps, stages, splits, BLOCK_N): None the engine's choice


def decode_rows(q, kp, vp, table, rows_idx, lengths, pieces, decode, context, bandwidth) -> list[dict]:
    """The decode rows' kernel at each launch of DECODE_SWEEP: alone (ms a layer, the K/V bytes it must read over
    that time against the copy bandwidth measured in this run, its output against the default launch's), and beside
    the chunk kernel on the side stream as the step runs them (pair_ms: the 28 layers of both)."""
    from kvtransfer.kernels.triton_attention import decode_attention_triton

    qd, qc, scale = q[:decode], q[decode:], D ** -0.5
    want = decode_attention_triton(qd, kp, vp, rows_idx, lengths, scale, block_table=table)
    kv_bytes = 2 * decode * context * HKV * D * qd.element_size()
    o, side = torch.empty_like(q), SideStream(q.device)
    out = []
    for warps, stages, splits, block_n in DECODE_SWEEP:
        def dec(dst=None):
            return decode_attention_triton(qd, kp, vp, rows_idx, lengths, scale, block_table=table,
                                           num_splits=splits, num_warps=warps, num_stages=stages, block_n=block_n,
                                           out=dst)

        def calls():
            for _ in range(LAYERS):
                dec()

        def beside():
            for _ in range(LAYERS):
                with side.fork():
                    K.chunk_attention(qc, kp, vp, pieces, scale, block_table=table, out=o[decode:])
                dec(o[:decode])
                side.join()
        got = dec()
        ms = graph_ms(calls) / LAYERS
        row = {"warps": warps, "stages": stages, "splits": splits or "default", "block_n": block_n or "default",
               "ms_per_layer": ms, "pair_ms": graph_ms(beside),
               "kv_gb_s": kv_bytes / (ms * 1e-3) / 1e9, "of_copy_bandwidth": kv_bytes / (ms * 1e-3) / bandwidth,
               "max_rel_diff_vs_default": ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()}
        print("decode", json.dumps(row), flush=True)
        out.append(row)
    return out


PAIR_SWEEP = [("chunk", None, None), ("decode", None, None), ("chunk", None, (1, 1)), ("chunk", None, (2, 1)),
              ("chunk", None, (4, 7)), ("chunk", None, (1, 7)), ("chunk", None, (4, 28)), ("chunk", 2, None),
              ("decode", 2, None), ("chunk", 2, (1, 7)), ("decode", 2, (1, 7)), ("decode", None, (1, 7))]
# --pair-sweep: (the kernel on the side stream, the decode kernel's splits, its stage-2 (warps, heads a program));
# None: the engine's choice


def pair_sweep(q, kp, vp, table, rows_idx, lengths, pieces, decode) -> list[dict]:
    """The two attention kernels of a mixed step at each variant of PAIR_SWEEP, 28 layers in one graph: which one
    goes on the side stream, and the decode kernel's split count and merge launch. Each variant's outputs are
    compared with the default launch at its split count (the merge's launch must not change a bit)."""
    from kvtransfer.kernels.triton_attention import decode_attention_triton

    qd, qc, scale = q[:decode], q[decode:], D ** -0.5
    side = SideStream(q.device)
    out = []
    for on_side, splits, stage2 in PAIR_SWEEP:
        o = torch.zeros_like(q)

        def dec():
            decode_attention_triton(qd, kp, vp, rows_idx, lengths, scale, block_table=table, num_splits=splits,
                                    stage2=stage2, out=o[:decode])

        def chk():
            K.chunk_attention(qc, kp, vp, pieces, scale, block_table=table, out=o[decode:])
        first, second = (chk, dec) if on_side == "chunk" else (dec, chk)

        def beside():
            for _ in range(LAYERS):
                with side.fork():
                    first()
                second()
                side.join()
        want = decode_attention_triton(qd, kp, vp, rows_idx, lengths, scale, block_table=table, num_splits=splits)
        beside()
        torch.cuda.synchronize()
        row = {"side": on_side, "splits": splits or "default", "stage2": stage2 or "default",
               "pair_ms": graph_ms(beside), "decode_bits_as_default": bool(torch.equal(o[:decode], want))}
        print("pairs", json.dumps(row), flush=True)
        out.append(row)
    return out


SPLITS = [None, 1, 2, 3, 4, 6, 8, 12, 16]  # --split-sweep: the decode kernel's split counts (None: choose_num_splits)
SPLITS_FEW_ROWS = [24, 32, 48, 64, 96, 128, 192]  # and these too at <= 16 rows, where the default goes past 16


def split_rows(decode: int, context: int) -> list[dict]:
    """The decode kernel alone (default launch) at each split count of SPLITS, `decode` rows of `context` positions
    each (paged), 28 layers in a graph: ms a layer and the K/V read rate. The split count is a runtime argument:
    one compiled kernel serves them all. A count swept runs without the per-split cap (LONG_CHUNK), so that many
    splits it is; the default arm is the kernel's own (the count, then the cap)."""
    from kvtransfer.kernels.triton_attention import decode_attention_triton, default_num_splits

    q, kp, vp, table, idx, lengths, _ = case(decode, context, 64, 0)
    qd, scale = q[:decode], D ** -0.5
    kv_bytes = 2 * decode * context * HKV * D * qd.element_size()
    chosen = default_num_splits(decode, HQ, HKV, table.shape[1] * PAGE, q.device)
    out = []
    for splits in SPLITS + (SPLITS_FEW_ROWS if decode <= 16 else []):
        if splits and splits > context // 64:
            continue  # a split shorter than one tile of keys
        def calls():
            for _ in range(LAYERS):
                decode_attention_triton(qd, kp, vp, idx, lengths, scale, block_table=table, num_splits=splits,
                                        **({"max_chunk": 0} if splits else {}))  # a count swept as it is
        ms = graph_ms(calls) / LAYERS
        row = {"decode": decode, "context": context, "splits": splits or f"default ({chosen})",
               "ms_per_layer": ms, "kv_gb_s": kv_bytes / (ms * 1e-3) / 1e9}
        print("splits", json.dumps(row), flush=True)
        out.append(row)
    return out  # the pools go with this frame


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--decode", type=int, default=64, help="decode rows")
    p.add_argument("--context", type=int, default=1024, help="the decode rows' length")
    p.add_argument("--cases", default="448@512,512@0,448@3584",
                   help="prompt chunks: ROWS@START, comma-separated (one chunk each)")
    p.add_argument("--no-chunk-sweep", action="store_true", help="skip the chunk kernel's tiling sweep")
    p.add_argument("--split-sweep", default="",
                   help="only the decode kernel's split counts (SPLITS) at ROWS@CONTEXT, comma-separated")
    p.add_argument("--pair-sweep", action="store_true",
                   help="also time the pair at each variant of PAIR_SWEEP (side stream, splits, merge launch)")
    p.add_argument("--decode-sweep", action="store_true",
                   help="also time the decode rows' kernel at other launches (DECODE_SWEEP), the first case's rows")
    return p


def main(argv=None) -> None:
    a = build_parser().parse_args(argv)
    if a.split_sweep:
        rows = []
        for spec in a.split_sweep.split(","):
            rows += split_rows(*map(int, spec.split("@")))
            torch.cuda.empty_cache()
        print(json.dumps({"bench": "decode_splits", "device": torch.cuda.get_device_name(), "layers": LAYERS,
                          "rows": rows}))
        return
    result = {"bench": "chunk_attention", "device": torch.cuda.get_device_name(), "layers": LAYERS,
              "defaults": {"block_m": TC.BLOCK_M, "warps": TC.NUM_WARPS, "stages": TC.NUM_STAGES}, "cases": []}
    for spec in a.cases.split(","):
        rows, start = map(int, spec.split("@"))
        q, kp, vp, table, idx, lengths, pieces = case(a.decode, a.context, rows, start)
        result["cases"].append({"rows": rows, "start": start, "decode": a.decode, "context": a.context,
                                "chunk": [] if a.no_chunk_sweep else chunk_rows(q, kp, vp, table, pieces, a.decode,
                                                                                rows, start),
                                "pair": pair_rows(q, kp, vp, table, idx, lengths, pieces, a.decode)})
        if a.pair_sweep and "pair_sweep" not in result:
            result["pair_sweep"] = pair_sweep(q, kp, vp, table, idx, lengths, pieces, a.decode)
        if a.decode_sweep and "decode_sweep" not in result:
            from bench.probes.kernels import copy_bandwidth

            bw = copy_bandwidth()
            result["copy_bandwidth_gb_s"] = bw / 1e9
            result["decode_sweep"] = decode_rows(q, kp, vp, table, idx, lengths, pieces, a.decode, a.context, bw)
        del q, kp, vp, table
        torch.cuda.empty_cache()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
