"""Run `target(rank, *args)` in two spawned processes (ranks 0 and 1) and collect each rank's result.

Why one harness: the transport tests and the p2p bench both need two real processes joined
by a link, and a side must stay alive until both have reported (a sender's data may still
be in flight when it returns). A side either returns, raises (its traceback is reported)
or calls `exit_now` (a side that dies mid-transfer); nothing waits forever.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import traceback
from collections.abc import Callable

ROLES = ("sender", "receiver")
_report: Callable | None = None  # in a child: puts this rank's report on the parent's queue


class PairError(RuntimeError):
    """A rank failed, or did not report in time."""


def exit_now(result=None) -> None:
    """From inside a child: report `result` as this rank's and exit at once, without waiting for the other."""
    _report(None, result)
    os._exit(0)


def _child(target: Callable, rank: int, args: tuple, q, done) -> None:
    global _report

    def report(err, result):
        q.put((rank, err, result))
        q.close()
        q.join_thread()  # the report must leave before the process does

    _report = report
    try:
        result = target(rank, *args)
        q.put((rank, None, result))
    except BaseException:  # reported to the parent; the child exits below either way
        q.put((rank, traceback.format_exc(), None))
    finally:
        done.wait(timeout=60)
        os._exit(0)


def run_pair(target: Callable, args: tuple = (), timeout: float = 90, what: str = "two processes") -> list:
    """[rank 0's result, rank 1's]. Waits up to `timeout` s for each report; raises PairError naming the
    lowest rank that failed (ROLES: 0 sends, 1 receives), or the ranks heard from on a timeout."""
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_child, args=(target, rank, args, q, done)) for rank in (0, 1)]
    for p in procs:
        p.start()
    errors, results = {}, {}
    try:
        for _ in procs:
            rank, err, result = q.get(timeout=timeout)
            errors[rank], results[rank] = err, result
    except queue.Empty:
        raise PairError(f"{what}: a side did not finish in {timeout} s; got {errors}") from None
    finally:
        done.set()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    for rank, err in sorted(errors.items()):
        if err is not None:
            raise PairError(f"{what}: rank {rank} ({ROLES[rank]}) failed:\n{err}")
    return [results[0], results[1]]
