"""The mixed step the probes build and time: decode rows beside prompt chunks, as the engine lays them out.

Why apart: profile_mixed.py profiles one such step and step_curve.py times many sizes of it; both build it here, as
the scheduler builds it with --mixed-prefill (kvtransfer/engine/mixed.py, graphs.py), and time it the same way
(median of synchronized steps after warm-up).
"""

from __future__ import annotations

import time

import torch

from bench.measure.stats import summarize
from kvtransfer.engine.graphs import Step, buckets
from kvtransfer.engine.mixed import MAX_PIECES, Chunk
from kvtransfer.engine.pool import KVPool
from kvtransfer.engine.runner import StepRunner
from kvtransfer.engine.side_stream import SideStream
from kvtransfer.geometry import CacheGeometry
from kvtransfer.model.spec import DTYPES, ModelSpec, load_model


def build(a, model=None):
    """The step for `a` (this probe's arguments) on `model` (None: --model loaded here): (Step, the decode rows'
    bucket, their tokens, positions and slots, the prompt chunks)."""
    dev = torch.device(a.device)
    dtype = a.dtype or ("bfloat16" if dev.type == "cuda" else "float32")
    model = model if model is not None else load_model(ModelSpec(a.model, dtype, 0), dev)
    b = next((x for x in buckets(a.max_batch) if x >= a.batch), 0)  # the engine's bucket for --batch decode rows
    # the prompt tokens: the rows after the bucket, or (fill_bucket, as a served step lays them out: mixed.lay_out)
    # every row after the decode rows, the bucket's free ones first
    prompt = a.mixed - (a.batch if getattr(a, "fill_bucket", False) else b)
    if not 1 <= a.batch <= a.max_batch or 2 * b > a.mixed or not 1 <= a.pieces <= min(MAX_PIECES, prompt):
        raise SystemExit(f"--batch 1..--max-batch, --mixed {a.mixed} >= 2 x the bucket ({b}) of --batch {a.batch}, "
                         f"--pieces 1..{MAX_PIECES}")
    sizes = [prompt // a.pieces + (j < prompt % a.pieces) for j in range(a.pieces)]
    if a.prompt_start + max(sizes) > a.prompt_len:
        raise SystemExit(f"a chunk of {max(sizes)} rows from position {a.prompt_start} runs past --prompt-len")
    max_seq = max(a.context, a.prompt_len)
    # pool_seq (> max_seq, paged): rows of a server's --max-seq-len, only the blocks these rows use (the kernels'
    # grids follow the rows' length: the decode kernel's splits, whether the mixed step's attention fuses)
    pool_seq = max(getattr(a, "pool_seq", 0) or 0, max_seq) if a.page else max_seq
    blocks = (a.batch + a.pieces) * -(-max_seq // a.page) if pool_seq > max_seq else 0
    pool = KVPool(CacheGeometry.from_config(model.config, DTYPES[dtype]), dev, a.batch + a.pieces, pool_seq, a.page,
                  blocks)
    leases = [pool.try_lease(max_seq) for _ in range(a.batch + a.pieces)]
    pool.kv.normal_()
    runner = StepRunner(model, pool, gemv="off")  # the batch-1 GEMV never runs in a step of >= 2 rows
    if getattr(a, "no_side_stream", False):  # the prompt rows' attention after the decode rows', one stream
        runner.side = SideStream(dev, on=False)
    # staged (off CUDA graphs): the eager step in the graphs' padded layout, as a graph lays the rows out
    st = Step(runner, b, dev.type == "cuda" and not a.eager, chunk=a.mixed, sampling=False,
              staged=getattr(a, "staged", False))
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    tok = torch.randint(3, vocab, (a.batch,), generator=g).to(dev)
    pos = torch.full((a.batch,), a.context - 1, dtype=torch.long, device=dev)
    slots = torch.tensor([x.slot for x in leases[:a.batch]], dtype=torch.long, device=dev)
    chunks = [Chunk(torch.randint(3, vocab, (c,), generator=g).to(dev), x.slot, a.prompt_start,
                    a.prompt_start + c == a.prompt_len) for c, x in zip(sizes, leases[a.batch:])]
    return st, b, tok, pos, slots, chunks


def timed(body, dev: torch.device, n: int) -> tuple[float, float]:
    """(median step ms: device time on CUDA, wall on CPU; median ms for the host to return from body)."""
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for _ in range(3):
        body()
    sync()
    step, host = [], []
    for _ in range(n):
        a = b = None
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t0 = time.perf_counter()
        body()
        host.append(time.perf_counter() - t0)
        if b is not None:
            b.record()
        sync()
        step.append(a.elapsed_time(b) / 1e3 if a is not None else time.perf_counter() - t0)
    return summarize(step, 1e3)["median"], summarize(host, 1e3)["median"]
