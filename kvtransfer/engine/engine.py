"""The decode worker's device side: the KV pool, the batched step and the scheduler, built once at start.

Why one object: the servicer needs four things from the device: a slot, a local prefill into
that slot (colocated, recompute), a digest of a slot's cache, and decoding. All device work runs
on the scheduler's one thread; the servicer only awaits futures and reads sinks.

A local prefill runs exactly the prefill worker's forward (`kvtransfer.model.prefill.prefill`: the
fused prefill for supported models, same kernels), and copies each layer into the slot as it is
made: the same one device-local copy per layer that a transport's landing does, so colocated and
disaggregated requests reach the step with byte-identical caches.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from kvtransfer.engine.chunk_attention import chunk_attention_on
from kvtransfer.engine.graphs import Step
from kvtransfer.engine.mixed import MixedPrefill
from kvtransfer.engine.pool import KVPool, Lease
from kvtransfer.engine.prefix_cache import PrefixCache
from kvtransfer.engine.reload_rule import measure
from kvtransfer.engine.runner import GEMV_CHOICES, StepRunner
from kvtransfer.engine.sampler import SamplingParams, first_token
from kvtransfer.engine.scheduler import Job, Scheduler
from kvtransfer.engine.sequence import LocalPrefill
from kvtransfer.model.loaded import LoadedModel
from kvtransfer.model.fused_prefill import chunk_cache
from kvtransfer.model.prefill import logits_digest, prefill, random_prompt
from kvtransfer.model.streaming import StreamingCache, cache_digest

log = logging.getLogger("kvtransfer.decode.engine")


def check_options(*, max_batch: int, prefill_chunk: int, mixed_prefill: bool | None, mixed_max_rows: int) -> None:
    """The engine's option combinations, checked in this one place, in the flags' words: by EngineOptions (every
    value known), and by the decode server's config at parse time (max_batch 0, prefill_chunk -1 and
    mixed_prefill None mean "chosen at start", and the checks that need them wait for EngineOptions)."""
    if mixed_max_rows < 0:
        raise ValueError("--mixed-max-rows must be >= 0 (0: steps of --prefill-chunk rows only)")
    if mixed_max_rows and not mixed_prefill:
        raise ValueError("--mixed-max-rows sizes the steps of --mixed-prefill: add --mixed-prefill, or drop "
                         "--mixed-max-rows")
    if mixed_prefill and prefill_chunk == 0:
        raise ValueError("--mixed-prefill needs --prefill-chunk N (the rows of a step, decode rows included)")
    if mixed_prefill and prefill_chunk > 0 and max_batch > 0:  # room for prompt rows beside a full batch
        if prefill_chunk < 2 * max_batch:
            raise ValueError(f"--prefill-chunk {prefill_chunk} with --mixed-prefill is the rows of a step, decode "
                             f"rows included: it must be >= 2 x --max-batch ({2 * max_batch})")
        if mixed_max_rows and mixed_max_rows < 2 * prefill_chunk:
            raise ValueError(f"--mixed-max-rows {mixed_max_rows} must be >= 2 x --prefill-chunk ({2 * prefill_chunk}):"
                             " the larger steps are 2, 4 .. x --prefill-chunk rows (0: --prefill-chunk only)")


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    max_batch: int = 16  # pool slots = sequences decoded together
    max_seq_len: int = 4096  # tokens per slot (prompt + generated)
    cuda_graphs: bool = True  # capture the step per bucketed batch size (CUDA only)
    gemv: str = "auto"  # batch-1 Triton GEMV per projection: auto (timed at start), on, off (runner.py)
    batch_invariant: bool = False  # a row's logits the same bits in any batch (runner.py; needs mixed_prefill)
    prefill_chunk: int = 0  # local prefill: tokens per piece between decode steps (0: the whole prompt at once)
    mixed_prefill: bool = False  # prompt chunks ride in the decode steps' forward (mixed.py); prefill_chunk is then
    # the rows of such a step, decode rows included (>= 2 x max_batch, check_options)
    mixed_max_rows: int = 0  # mixed: steps of 2, 4 .. x prefill_chunk rows too, up to this (0: prefill_chunk only)
    fail_scheduler_after_steps: int = -1  # fault injection: the scheduler thread dies after this many steps
    prefix_cache: bool = False  # finished requests' KV stays in free slots for later prompts (prefix_cache.py)
    host_cache_gib: float = 0.0  # with prefix_cache: a pinned host tier of this size for evicted slots (0: none)
    kv_block_tokens: int = 0  # the pool's page: positions per KV block (0: one block of max_seq_len per slot)
    kv_blocks: int = 0  # with kv_block_tokens: blocks in the pool (0: a whole context for every slot)

    def __post_init__(self):
        if self.host_cache_gib < 0 or (self.host_cache_gib and not self.prefix_cache):
            raise ValueError("--host-cache-gib must be >= 0, and needs the prefix cache (drop --no-prefix-cache)")
        if self.kv_block_tokens < 0 or self.kv_blocks < 0 or (self.kv_blocks and not self.kv_block_tokens):
            raise ValueError("--kv-block-tokens and the pool's block count must be >= 0; a block count needs "
                             "--kv-block-tokens")
        if self.batch_invariant and not self.mixed_prefill:
            raise ValueError("--batch-invariant prefills through the decode step (--mixed-prefill with a "
                             "--prefill-chunk): drop --no-mixed-prefill")
        if self.gemv not in GEMV_CHOICES:
            raise ValueError(f"--gemv {self.gemv!r}: choose one of {', '.join(GEMV_CHOICES)}")
        if self.max_batch < 1 or self.prefill_chunk < 0:
            raise ValueError(f"engine options not resolved: max_batch {self.max_batch}, prefill_chunk "
                             f"{self.prefill_chunk} (decode_server/sizing.py chooses them)")
        check_options(max_batch=self.max_batch, prefill_chunk=self.prefill_chunk, mixed_prefill=self.mixed_prefill,
                      mixed_max_rows=self.mixed_max_rows)


class DecodeEngine:
    def __init__(self, loaded: LoadedModel, options: EngineOptions, on_step=None, on_fatal=None):
        """`on_fatal(what, error)`: called once if the scheduler thread dies (the server must then stop)."""
        self.m, self.options = loaded, options
        self.pool = KVPool(loaded.geometry, loaded.device, options.max_batch, options.max_seq_len,
                           options.kv_block_tokens, options.kv_blocks)
        self.runner = StepRunner(loaded.model, self.pool, gemv=options.gemv, invariant=options.batch_invariant)
        self.step = Step(self.runner, options.max_batch, options.cuda_graphs,
                         options.prefill_chunk if options.mixed_prefill else 0, options.mixed_max_rows)
        self.scheduler = Scheduler(self.step, loaded.device, on_step, on_fatal, options.fail_scheduler_after_steps)
        self.cache = PrefixCache(self.pool, options.host_cache_gib) if options.prefix_cache else None
        if self.cache is not None and self.cache.host is not None:
            probe = min(512, options.max_seq_len - 1)
            vocab = loaded.model.config.vocab_size
            self.cache.speeds = measure(self.cache.host, lambda n: prefill(loaded.model, random_prompt(
                vocab, n, device=loaded.device)), loaded.geometry.bytes_per_token, probe)
            log.info("prefix cache: host tier %s", self.cache.speeds.describe())
        if loaded.device.type == "cuda":  # first uses at start, not beside the first streams
            warm_local_prefill(loaded.model, loaded.device, 0 if options.mixed_prefill else options.prefill_chunk,
                               options.max_seq_len)
        eos = getattr(loaded.model.config, "eos_token_id", None)
        self.eos = frozenset([eos] if isinstance(eos, int) else (eos or []))
        log.info("decode engine: batch <= %d, %d tokens per slot, step %s%s%s", options.max_batch,
                 options.max_seq_len, "Triton kernels" if self.runner.use_triton else "torch reference ops",
                 " (batch-invariant: a row's logits the same bits in any batch)" if options.batch_invariant else "",
                 f", CUDA graphs for batch {','.join(map(str, self.step.buckets))}" if self.step.graphs else ", eager")

    def prefill_job(self, token_ids: list[int], lease: Lease, want_digest: bool,
                    sampling: SamplingParams | None = None, start: int = 0) -> Job:
        """Prefill the prompt into the leased slot; returns LocalPrefill (its first token chosen by `sampling`, at
        position len(token_ids), as the prefill worker chooses it; None: greedy).

        Whole (prefill_chunk 0, or a prompt no longer than a chunk): one forward, exactly the prefill worker's.
        Chunked (Sarathi-Serve): one chunk per `next()`, so the scheduler runs a decode step between two chunks;
        each later chunk attends over the cache so far (lower-right causal), padded to `chunk` tokens (`pad_chunk`;
        the job's first piece is not: a prefix hit's short suffix keeps its own size). The pieces, and a suffix after
        a reused prefix, run on the fused ops into one block for the whole prompt (fused_prefill.chunk_cache); a model
        those cannot run takes the HF forward with chunk_attention.py's attention. Chunked
        logits and cache then equal the whole prefill's only within a tolerance (other kernel shapes;
        tests/test_chunked_prefill.py). Either way the first token is read back one `next()` after the last forward:
        read in the same one, it would hold back the tokens of the step queued before that forward, and the running
        streams would wait two chunks in one gap. The job holds the lease while it writes, so a request that gives
        up meanwhile cannot free the slot under it."""
        lease.hold()
        try:
            n, chunk = len(token_ids), self.options.prefill_chunk or len(token_ids)
            pool, slot = self.pool, lease.slot
            # No wait for the device here: the step queued before this job runs on while the host launches the
            # job's first piece behind it (a synchronize, or a pageable copy of the ids, would hold the host until
            # that step is done). On CUDA the job's time runs between two events, stamped when the device reaches
            # them: from its first work to the event after its last forward's.
            t0, c0 = time.perf_counter(), time.thread_time()
            began = timed_event(self.m.device)
            ids = to_device(token_ids, self.m.device)  # (1, seq)
            cache = None  # the next piece's past: none before a whole prompt's one forward
            if start or n > chunk:  # pieces after a past: into one block on the fused ops where they run, else HF's
                past = pool.layers_of(slot, start) if start else None
                room = n + chunk - 1 if n - start > chunk else n  # the last piece's pads end by n - 1 + chunk
                cache = chunk_cache(self.m.model, room, past, self.m.device)
                cache = cache if cache is not None or not start else past_cache(self.m.model.config, past)

            def land(i: int, k: torch.Tensor, v: torch.Tensor) -> None:  # k, v: (1, kv_heads, end, head_dim) so far
                pool.write_layer(slot, i, start, k[:, :, start:end], v[:, :, start:end])
            first = start  # the job's first piece is never padded (a whole prompt, a reused prefix's suffix)
            while start < n:
                end = min(n, start + chunk)
                piece, row = pad_chunk(ids[:, start:end], chunk) if start > first else (ids[:, start:end], -1)
                with chunk_attention_on(self.m.model) if start and not cache.fused else nullcontext():  # HF's path
                    cache, logits = prefill(self.m.model, piece, on_layer=land, cache=cache, row=row)
                start = end
                if start < n:
                    yield
            # The first token (and the logits to digest) leave on the way to the host, and are read in the next gap:
            # a read now would wait for this last chunk before the scheduler hands out the step queued ahead of it,
            # so the running streams would see two chunks in one gap (the stall at a chunked prefill's end).
            out, ready = to_host([first_token(logits, sampling, n).view(1), *([logits] if want_digest else [])],
                                 self.m.device)
            ms, cpu = (time.perf_counter() - t0) * 1e3, (time.thread_time() - c0) * 1e3  # CPU: the work is done
            yield
            if ready is not None:
                ready.synchronize()  # this job's own work only, not the step queued after it
                ms = began.elapsed_time(ready)  # not the scheduler's pass between the yield and here
            log.debug("local prefill of %d tokens: %.1f ms, %.1f ms of thread CPU", n, ms, cpu)
            return LocalPrefill(int(out[0][0]), logits_digest(out[1]) if want_digest else "", ms, cpu)
        finally:
            lease.release()

    def prefill(self, token_ids: list[int], lease: Lease, want_digest: bool, sampling: SamplingParams | None = None,
                start: int = 0):
        """Future -> LocalPrefill, run on the device thread between decode steps; with --mixed-prefill, in them
        (one chunk per step), unless the prompt fits one chunk and nothing decodes: then exactly the prefill
        worker's forward, so a request alone stays bit-identical to a disaggregated one. `sampling` chooses the
        first token (None: greedy). `start`: prompt tokens already in the slot (a reused prefix). Batch-invariant:
        always in the steps, whose every row attends as a decode row (the whole-prompt forward sums otherwise)."""
        o = self.options
        if o.mixed_prefill and (o.batch_invariant or start or len(token_ids) > o.prefill_chunk
                                or self.scheduler.active()):
            ids = torch.tensor(token_ids, dtype=torch.long).to(self.m.device)  # (n,)
            return self.scheduler.submit_mixed(MixedPrefill(ids, lease, want_digest, sampling=sampling, start=start))
        return self.scheduler.submit(self.prefill_job(token_ids, lease, want_digest, sampling, start))

    def digest(self, slot: int, seq_len: int):
        """Future -> digest of the slot's cache, byte for byte as the transports' cache_digest of the same cache."""
        return self.scheduler.call(lambda: cache_digest(self.pool.layers_of(slot, seq_len)))

    def close(self) -> None:
        self.scheduler.close()


def pad_chunk(piece: torch.Tensor, chunk: int) -> tuple[torch.Tensor, int]:
    """A later chunk (1, m) -> (1, chunk): its last token repeated after it, and the row of its last real token
    (whose logits are the first token's).

    Why: a prompt's last chunk is mostly shorter than the others, a row count the server may never have run. Its
    first use of the kernels for that shape (cuBLAS's and flash attention's picks, loaded lazily) held the running
    streams about twice as long as any other chunk (bench/results/stall-h100-2026-12-07). Padded, every chunk
    after a job's first is one shape (the first is not padded: a whole prompt, or a reused prefix's suffix, whose
    work padding would multiply). The pads come after every real token, so under the causal mask no real row
    attends to them; their K/V stay in the chunk's own cache, after the prompt (the pool gets positions start..end
    only), and each takes the last real token's RoPE position, so none passes the prompt's."""
    m = piece.shape[1]
    if m == chunk:
        return piece, -1
    return torch.cat([piece, piece[:, -1:].expand(1, chunk - m)], dim=1), m - 1  # (1, chunk)


def warm_local_prefill(model, device: torch.device, chunk: int, max_seq: int) -> None:
    """Run the local prefill's paths once on throwaway ids, before the server serves: a whole prompt (the fused
    prefill) and, with `chunk` (a chunked local prefill: --prefill-chunk without --mixed-prefill), a prompt of up to
    1.5 chunks on the chunk path, its second piece padded as prefill_job pads it. No longer than a slot's prompt
    (`max_seq` - 1), and no chunk part where no prompt can take two pieces.

    Why: on CUDA a kernel's first use costs its module's lazy loading, cuBLAS's setup for the shape and Triton's
    compile (or its disk cache's load). Left to the first requests, those costs land on the serving thread beside
    running streams: a fresh process's first chunk, and the first padded chunk, each held the streams well past its
    device time (bench/results/stall-h100-2026-12-07, call 11). Nothing reaches the pool."""
    vocab = model.config.vocab_size
    prefill(model, random_prompt(vocab, min(16, max_seq - 1), device=device))  # (1, 16): a whole prompt
    n = min(chunk + max(1, chunk // 2), max_seq - 1)  # the prompt a slot holds, its answer's first token after it
    if chunk and n > chunk:
        ids = random_prompt(vocab, n, seed=1, device=device)  # (1, n)
        cache = chunk_cache(model, n + chunk - 1, None, device)  # as prefill_job's room for several pieces
        if cache is not None:  # a model the fused ops cannot run takes HF's forward, which has no such block
            cache, _ = prefill(model, ids[:, :chunk], cache=cache)
            piece, row = pad_chunk(ids[:, chunk:], chunk)
            prefill(model, piece, cache=cache, row=row)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def to_device(token_ids: list[int], device: torch.device) -> torch.Tensor:
    """token_ids -> (1, n) int64 on `device`, without waiting for the device: from pinned memory on CUDA."""
    ids = torch.tensor([token_ids], dtype=torch.long)
    if device.type != "cuda":
        return ids.to(device)
    return ids.pin_memory().to(device, non_blocking=True)


def to_host(tensors: list[torch.Tensor], device: torch.device) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """Host copies of `tensors` on their way (pinned on CUDA), and the event after them: read the copies once that
    event is done (None on CPU: the tensors are already the host's). Waiting on the event waits for the work queued
    so far, never for work queued after it (a `.item()` or `.cpu()` later would wait for the whole stream)."""
    if device.type != "cuda":
        return [t.detach() for t in tensors], None
    out = []
    for t in tensors:
        out.append(torch.empty(t.shape, dtype=t.dtype, pin_memory=True))
        out[-1].copy_(t.detach(), non_blocking=True)
    ready = torch.cuda.Event(enable_timing=True)
    ready.record()
    return out, ready


def timed_event(device: torch.device) -> torch.cuda.Event | None:
    """An event recorded now on CUDA (a start for `elapsed_time` against `to_host`'s), None elsewhere."""
    if device.type != "cuda":
        return None
    began = torch.cuda.Event(enable_timing=True)
    began.record()
    return began


def past_cache(config, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> StreamingCache:
    """A cache holding a slot's positions 0..n - 1 (layers: per layer (k, v), each (1, kv_heads, n, head_dim), views
    of the pool or gathered copies), for a prefill that continues after them: each layer's update concatenates onto
    copies, never into the pool."""
    cache = StreamingCache(config=config)
    for layer, (k, v) in zip(cache.layers, layers):
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
        if hasattr(layer, "cumulative_length"):  # a sliding-window layer counts its positions apart from its keys:
            layer.cumulative_length = k.shape[-2]  # left at 0, the next piece's RoPE would start at position 0
    return cache
