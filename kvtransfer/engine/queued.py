"""One decode step queued on the device and not yet delivered: how the scheduler runs one step ahead.

Why apart: queueing a step without waiting for the device is the scheduler's hot path and has its
own invariants (next tokens gathered on the device from the step still in flight; every row's slot
held until delivery; a prompt chunk riding along, --mixed-prefill), and so has its delivery (`hand_out`, then
`release_delivered`: a row that hit EOS while still queued in the next step keeps its slot until that step is
delivered); scheduler.py decides who runs, and when a step is delivered.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from kvtransfer.engine.graphs import Step
from kvtransfer.engine.mixed import Chunk, MixedPrefill
from kvtransfer.engine.sampler import Draws, first_token, next_tokens
from kvtransfer.engine.sequence import LocalPrefill, Sequence, Token
from kvtransfer.model.prefill import logits_digest

log = logging.getLogger("kvtransfer.decode.scheduler")


@dataclass(frozen=True)
class StepStats:
    """What one delivered step did, for the metrics."""

    rows: int  # decode rows (sequences advanced)
    prompt_rows: int  # prompt tokens that rode along (--mixed-prefill)
    step_rows: int  # the mixed step's size in rows, padding included (0: a plain decode step)
    device_s: float  # its device time from CUDA events, s (0 on CPU)
    staging_s: float = 0.0  # of it, before the graph's replay: the inputs' copies, and the device waiting on the
    # host's launches when the host fell behind (0 on CPU and for eager steps)


@dataclass
class QueuedStep:
    """One step queued on the device and not yet delivered: its rows, their next tokens (device, and the pinned
    host copy on its way), the event after that copy, and the logits rows kept for digests."""

    batch: list[Sequence]
    next: torch.Tensor  # (n,) int64 on the device
    host: torch.Tensor  # (n,) int64 [+ a finished prompt's first token], pinned on CUDA
    event: torch.cuda.Event | None
    rows: dict[int, torch.Tensor]
    left: list[int]  # each row's tokens still to make after this step
    after: list = field(default_factory=list)  # (sequence, Token | Ended) to end once this step is delivered
    chunk_tasks: list[MixedPrefill] = field(default_factory=list)  # prompts with a chunk in this step: their slots
    # are held until delivery
    first_tasks: list[MixedPrefill] = field(default_factory=list)  # ... whose last chunk it was: the host copy ends
    # with their first tokens, in this order
    first_logits: list[torch.Tensor | None] = field(default_factory=list)  # (vocab,) each, kept when a digest is wanted
    start: torch.cuda.Event | None = None  # recorded just before the step's launch: start -> event is its device time
    replayed: torch.cuda.Event | None = None  # recorded just before its graph's replay (graphs.Step._replay)
    prompt_rows: int = 0  # prompt tokens that rode in this step
    step_rows: int = 0  # the mixed step's size (Step.rows_for; 0: a plain step, or eager)

    def device_s(self) -> float:
        """The step's device time, s (0 on CPU); call after `event` completed."""
        return self.start.elapsed_time(self.event) / 1e3 if self.start is not None else 0.0

    def staging_s(self) -> float:
        """Of `device_s`, the time before the graph's replay, s (0: CPU or an eager step); after `event`."""
        if self.start is None or self.replayed is None:
            return 0.0
        return self.start.elapsed_time(self.replayed) / 1e3


def queue_step(step: Step, dev: torch.device, batch: list[Sequence], prev: QueuedStep | None,
               pieces: list[tuple[MixedPrefill, Chunk]] = ()) -> QueuedStep:
    """Queue one step for `batch` without waiting for the device. A row that was in the step still in flight
    reads its next input token from that step's choice on the device (sampler.py); a row joining now reads it from
    the host.
    Positions and slots are the host's. Each row's lease is held until this step has been delivered, so no
    slot is handed to another request while a queued step may still write into it. With pieces (prompt chunks),
    one forward runs the decode rows and those chunks together (mixed.py); each chunk's slot is held the same
    way, and a prompt's first token travels with the step's tokens when its last chunk rode in it."""
    n = len(batch)
    where = {id(s): j for j, s in enumerate(prev.batch)} if prev is not None else {}
    fresh = [s for s in batch if id(s) not in where]
    host_tokens = torch.tensor([s.last_token for s in fresh], dtype=torch.long).to(dev, non_blocking=True)
    if len(fresh) == n:
        tokens = host_tokens  # (n,)
    else:  # rows of prev: prev.next[j]; fresh rows: host_tokens[i], gathered from one (len(prev) + fresh,) vector
        src = torch.cat([prev.next, host_tokens])
        k = iter(range(len(prev.batch), len(prev.batch) + len(fresh)))
        gather = [where[id(s)] if id(s) in where else next(k) for s in batch]
        tokens = src[torch.tensor(gather, dtype=torch.long).to(dev, non_blocking=True)]
    positions = torch.tensor([s.length for s in batch], dtype=torch.long).to(dev, non_blocking=True)
    slots = torch.tensor([s.slot for s in batch], dtype=torch.long).to(dev, non_blocking=True)
    done = [j for j, (_, c) in enumerate(pieces) if c.last]  # prompts whose first token this step makes
    lasts, chunks = None, [c for _, c in pieces]
    prompt_rows = sum(c.ids.shape[0] for c in chunks)
    start = None
    if dev.type == "cuda":  # from here to `event`: the step's launch (a replay; eager: its launches too) and work
        start = torch.cuda.Event(enable_timing=True)
        start.record()
    if not pieces:
        logits = step(tokens, positions, slots)  # (n, vocab): the graph's buffer, overwritten by the next step
    else:
        logits, lasts = step.mixed(tokens, positions, slots, chunks)  # (n, vocab), (P, vocab)
        for task, _ in pieces:
            task.lease.hold()
    firsts = [pieces[j][0] for j in done]
    # each row's draw position: the tokens before the one drawn (a decode row's input sits at index s.length)
    draws = Draws.of([s.sampling for s in batch] + [t.sampling for t in firsts],
                     [s.length + 1 for s in batch] + [t.ids.shape[0] for t in firsts])
    if draws is None:  # every row greedy: argmax, nothing of the sampler runs
        nxt = next_tokens(logits)  # (n,) on the device
        rows_out = torch.cat([nxt, *(first_token(lasts[j]).view(1) for j in done)])  # (n + finished prompts,)
    else:  # the decode rows and the finished prompts' last rows in one draw (captured per bucket on CUDA)
        drawn = torch.cat([logits, *(lasts[j:j + 1] for j in done)]) if done else logits  # (n + len(done), vocab)
        rows_out = step.sampler(drawn, draws)  # (n + len(done),): a view into the sampler's buffer on CUDA
        nxt = rows_out[:n]
    rows = {j: logits[j].clone() for j, s in enumerate(batch) if s.want_digest}  # (vocab,) each, kept
    host = torch.empty(rows_out.shape[0], dtype=torch.long, pin_memory=dev.type == "cuda")
    host.copy_(rows_out, non_blocking=True)
    event = None
    if dev.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
    for s in batch:
        s.lease.hold()
        s.length += 1
        s.remaining -= 1
    return QueuedStep(batch, nxt, host, event, rows, [s.remaining for s in batch],
                    chunk_tasks=[task for task, _ in pieces], first_tasks=firsts,
                    first_logits=[lasts[j].clone() if t.want_digest else None for j, t in zip(done, firsts)],
                    start=start, replayed=step.replayed, prompt_rows=prompt_rows,
                    step_rows=step.rows_for(n, prompt_rows) if pieces and step.mixed_graphs else 0)


def let_go(pending: QueuedStep | None, end) -> None:
    """After a failure or at shutdown: wait for a queued step (its writes) and drop its holds; `end(seq, item)`
    ends the sequences whose last token it held. Returns None (the caller's `pending` is then gone)."""
    if pending is not None:
        if pending.event is not None:
            try:
                pending.event.synchronize()
            except Exception:  # noqa: BLE001 - the device failed; the slots are released regardless
                log.exception("waiting for the last queued step")
        for s in pending.batch:
            s.lease.release()
        for task in pending.chunk_tasks:
            task.lease.release()
            if not task.future.done():
                task.future.set_exception(RuntimeError("the decode step with its chunk failed"))
        for s, item in pending.after:
            end(s, item)  # a last token stays valid: only the row queued after it failed
        pending.batch, pending.after, pending.chunk_tasks = [], [], []  # let go once
    return None


def hand_out(done: QueuedStep, newer: QueuedStep | None, tokens: list[int], t: float) -> list[tuple[Sequence, Token]]:
    """A delivered step's tokens (`tokens`, its host copy; `t`, when it came) to its rows' sinks. A row whose last
    token it is is marked over; its token waits: in `newer.after` when `newer` still holds the row (it hit EOS
    here: its stream ends once that step frees its slot), else in the list returned, for `release_delivered`."""
    ends: list[tuple[Sequence, Token]] = []
    queued = {id(s) for s in newer.batch} if newer is not None else set()
    for j, s in enumerate(done.batch):
        if s.over:  # ended at an earlier step (EOS, stopped): this row ran ahead of that news
            continue
        s.index += 1
        s.last_token = tokens[j]
        if s.tokens is not None:  # what a swap would store (preempt.py)
            s.tokens.append(tokens[j])
        last = done.left[j] == 0 or tokens[j] in s.eos
        tok = Token(s.index, tokens[j], logits_digest(done.rows[j]) if s.want_digest else "", t, last)
        if not last:
            s.sink(tok)
            continue
        s.over = True
        (newer.after if id(s) in queued else ends).append((s, tok))
    return ends


def release_delivered(done: QueuedStep, tokens: list[int], t: float, ends: list[tuple[Sequence, Token]],
                      end) -> None:
    """After `hand_out`: the step's holds on its rows' and chunks' slots let go, each prompt it finished told its
    first token, then `end(seq, item)` for the sequences that ended with it (`done.after`, then `ends`)."""
    for s in done.batch:
        s.lease.release()  # the step's own hold
    for task in done.chunk_tasks:
        task.lease.release()  # the chunk's hold on its prompt's slot
    for j, (task, first_logits) in enumerate(zip(done.first_tasks, done.first_logits)):
        digest = logits_digest(first_logits) if first_logits is not None else ""
        task.future.set_result(LocalPrefill(tokens[len(done.batch) + j], digest, (t - task.t0) * 1e3))
    for s, item in done.after + ends:
        end(s, item)
