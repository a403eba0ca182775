"""A server's life after start: one outcome per request, and a graceful stop on SIGTERM/SIGINT.

Why one place for the outcome: a request can end in many ways (answered, refused, aborted deep
inside, cancelled by its client, past its deadline, ended by a shutdown) and `kvt_requests_total`
must count each exactly once. So the servicers never count; `RunningRequests.request` does, when the
handler leaves, from the status the handler set (`context.code()`) or, when none was set, from
how it was left (cancelled: CANCELLED or DEADLINE_EXCEEDED; an exception: UNKNOWN).

Why this stop: Kubernetes sends SIGTERM and waits terminationGracePeriodSeconds. Health turns
NOT_SERVING at once (probes take the replica out), new calls are refused with UNAVAILABLE,
requests in flight get --shutdown-grace-s to finish, the rest end UNAVAILABLE "server shutting
down", then the process exits 0 with one log line.

Why a fatal stop too: a server whose engine died must never look healthy. When a thread or task it
depends on dies (the decode scheduler, the receive loop, the pairing), `Stop.fail` logs the traceback
once and wakes the server: health turns NOT_SERVING, every waiting or in-flight request ends INTERNAL
with the cause, and the process exits EXIT_FATAL, so a supervisor (systemd, Kubernetes) restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc

SHUTTING_DOWN = "server shutting down"
# A call cancelled this close to its deadline counts as DEADLINE_EXCEEDED: the client's clock starts before the
# server's, so a client giving up at its deadline reaches a handler that still sees a few ms left.
DEADLINE_SLACK_S = 0.05
DEADLINE_MARGIN_S = 0.1  # a server ends a request this far (at most a quarter of the time left) before the client's
END_WAIT_S = 10.0  # after the grace: how long requests told to end get to send their status
EXIT_FATAL = 70  # EX_SOFTWARE: a thread the server depends on died (a signal stop exits 0, a bad flag 2)

log = logging.getLogger("kvtransfer")


class FatalStop(Exception):
    """`serve` ends with this after a fatal stop: the process exits EXIT_FATAL."""


def request_budget(remaining: float | None, limit: float) -> float:
    """Seconds a server gives a request: its own limit, or the client's time left less a margin.

    At the client's deadline gRPC itself ends the call; a server timing out at that same instant races it, and
    the status it then sends fails inside grpc core (a logged ExecuteBatchError, and the client never sees the
    reason). Ending a little earlier sends DEADLINE_EXCEEDED with its reason while the call is still open.
    """
    if remaining is None:
        return limit
    return min(limit, max(remaining - min(DEADLINE_MARGIN_S, remaining / 4), 0.0))


def outcome(context, error: BaseException | None) -> str:
    """The one `kvt_requests_total` outcome of a handler that ended with `error` (None: it returned)."""
    if error is None:
        return "OK"
    code = context.code()
    if code is not None and code != grpc.StatusCode.OK:
        return code.name
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):  # the client went, or its deadline passed
        left = context.time_remaining()
        return "DEADLINE_EXCEEDED" if left is not None and left <= DEADLINE_SLACK_S else "CANCELLED"
    return "UNKNOWN"


@dataclass(eq=False)
class Request:
    # A weak reference: a handler left at a `yield` by a cancelled call is closed when it is no longer
    # referenced; a strong one would tie it into a cycle (task -> traceback -> handler -> this) that only the
    # cyclic GC breaks, holding its slot and its --max-inflight place meanwhile.
    task_ref: weakref.ref
    at_yield: bool = False  # suspended at a `yield` (then cancelling its task would leave its client waiting)
    ending: bool = False    # told to end (shutdown): it aborts UNAVAILABLE at its next step
    end_code: grpc.StatusCode | None = None  # ... or with this status and message (a fatal stop: INTERNAL)
    end_message: str = ""
    seq: object = field(default=None)  # the decode side's Sequence, once it runs in the batch
    prompt_tokens: int = 0  # the decode side's prompt length, once admitted (its load report counts it waiting)

    @property
    def task(self) -> asyncio.Task | None:
        return self.task_ref()


class RunningRequests:
    """The requests a server is running, each counted once when it ends; drained at shutdown."""

    def __init__(self, metrics):
        self.metrics = metrics
        self.requests: set[Request] = set()
        self.draining = False

    @contextmanager
    def request(self, context):
        r = Request(weakref.ref(asyncio.current_task()))
        self.requests.add(r)
        error = None
        try:
            yield r
        except BaseException as e:
            error = e
            raise
        finally:
            self.requests.discard(r)
            self.metrics.finished(outcome(context, error))

    async def drain(self, grace_s: float, end) -> tuple[int, int]:
        """Wait up to `grace_s` for the requests in flight; then `end(r)` each one left. Returns (in flight, ended)."""
        self.draining = True
        count = len(self.requests)
        if tasks := self._tasks(self.requests):
            await asyncio.wait(tasks, timeout=grace_s)
        left = list(self.requests)
        for r in left:
            r.ending = True
            end(r)
        if tasks := self._tasks(left):
            await asyncio.wait(tasks, timeout=END_WAIT_S)
        return count, len(left)

    @staticmethod
    def _tasks(requests) -> set[asyncio.Task]:
        return {t for r in requests if (t := r.task) is not None and not t.done()}


def end_by_cancel(r: Request) -> None:
    """End a request waiting in the server's own code; one at a `yield` sees `ending` when it resumes."""
    if not r.at_yield and (task := r.task) is not None:
        task.cancel()


class Stop:
    """Set by the first SIGTERM or SIGINT (installed on the running loop), or by `fail` from any thread."""

    def __init__(self):
        self.event = asyncio.Event()
        self.signal = ""
        self.fatal = ""  # set by `fail`: why the server must stop and exit non-zero
        self._lock = threading.Lock()
        self._loop = loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on, sig)

    def fail(self, what: str, error: BaseException) -> None:
        """`what` died of `error` (any thread, once: later calls are ignored): its traceback logged, the server
        woken to stop. Health goes NOT_SERVING at once through `on_fatal`, which the server installs."""
        with self._lock:
            if self.fatal:
                return
            self.fatal = f"{what} died: {type(error).__name__}: {error}"
        log.error("%s; the server stops and exits %d", self.fatal, EXIT_FATAL,
                  exc_info=(type(error), error, error.__traceback__))
        try:
            self._loop.call_soon_threadsafe(self._fail_now)
        except RuntimeError:  # the loop is closed: the process is exiting already
            pass

    def _fail_now(self) -> None:
        if self.on_fatal is not None:
            self.on_fatal(self.fatal)
        self.event.set()

    on_fatal = None  # the server's immediate reaction on its loop (health NOT_SERVING, requests ended)

    def _on(self, sig: signal.Signals) -> None:
        if not self.event.is_set():
            self.signal = sig.name
            self.event.set()

    async def wait_or(self, work) -> bool:
        """Run `work` (a coroutine) until it ends or a signal comes; True if it ended."""
        task = asyncio.ensure_future(work)
        stop = asyncio.ensure_future(self.event.wait())
        done, _ = await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            stop.cancel()
            task.result()
            return True
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        return False


async def shut_down(server: grpc.aio.Server, health, running: RunningRequests, stop: Stop, grace_s: float,
                    log: logging.Logger, role: str, end=end_by_cancel, before_stop=None) -> None:
    """Health NOT_SERVING, drain within the grace, end the rest, `before_stop()` (a coroutine function: what the
    server must close while it still answers), stop the server (its port is free after); one log line."""
    t0 = time.monotonic()
    if health is not None:
        await health.enter_graceful_shutdown()
    count, ended = await running.drain(grace_s, end)
    if before_stop is not None:
        await before_stop()
    await server.stop(1.0)
    log.info("%s stopped on %s in %.1f s: %d requests in flight, %d finished, %d ended UNAVAILABLE "
             "(--shutdown-grace-s %g)", role, stop.signal or ("a failure" if stop.fatal else "request"),
             time.monotonic() - t0, count,
             count - ended, ended, grace_s)
