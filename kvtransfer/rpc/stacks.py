"""Python stack dumps for hangs: a process that stops making progress says where it is stuck.

Why: the one two-GPU run so far hung in a handshake, and a timeout with no stacks left only NCCL's watchdog
to say which wait it was. So:
- servers (`enable_stack_dumps`): `kill -USR1 PID` writes every thread's stack to stderr (the server's log)
  and the server goes on serving; a fatal signal (segfault, abort) dumps them too;
- bench drivers (`exit_on_sigterm`, what `timeout` sends): the driver's own stacks, then an orderly exit, so
  the servers it started that still run (a hung one: `timeout` signals them too) are asked for theirs
  (`bench.measure.launch.stop`) and stopped rather than orphaned.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys

DUMP_SIGNAL = signal.SIGUSR1
_TERMINATED: list[int] = []  # the signal exit_on_sigterm's handler took, once it has run


def enable_stack_dumps() -> bool:
    """Fatal signals and DUMP_SIGNAL write all threads' Python stacks to stderr (the process keeps running).
    False, and nothing changed, where stderr has no file descriptor (an in-memory capture such as capsys)."""
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return False
    faulthandler.enable(all_threads=True)
    signal.signal(DUMP_SIGNAL, _dump)
    return True


def _dump(_signum, _frame) -> None:
    """DUMP_SIGNAL's handler: a Python one, so it runs on the main thread holding the GIL and no other thread's
    frames change while it reads them. faulthandler.register's C handler read them from inside the signal while
    those threads ran, and once crashed the server it asked (a segfault in CI while the scheduler thread was in a
    torch op). The main thread is the server's event loop, which a signal wakes."""
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)


def exit_on_sigterm() -> None:
    """SIGTERM: this process's stacks on stderr, then SystemExit(143) so `finally` blocks stop the servers."""
    def handler(signum, _frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # `timeout` signals the child, then its group: once is enough
        _TERMINATED.append(signum)
        faulthandler.dump_traceback(all_threads=True)
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, handler)


def terminated() -> int | None:
    """The signal exit_on_sigterm's handler took, or None while it has not run."""
    return _TERMINATED[0] if _TERMINATED else None


def exit_status(main) -> int:
    """main()'s return value, as a driver's exit status; 128 + the signal once exit_on_sigterm's handler has run,
    also where its SystemExit was lost: raised inside a library's callback (grpc's asyncio poller swallows what its
    callbacks raise), the run then fails on what the signal stopped (`timeout` signals the servers too) and would
    otherwise exit 1 with that error instead of saying it was terminated."""
    try:
        return main()
    except Exception as e:  # any failure: after the signal it is the stop's consequence, said, not hidden
        if terminated() is None:
            raise
        print(f"stopped on signal {terminated()} (the run then failed: {type(e).__name__}: {e})", file=sys.stderr)
        return 128 + terminated()


def catches_dump_signal(pid: int) -> bool:
    """Whether `pid` has a handler for DUMP_SIGNAL (Linux: SigCgt in /proc); its default action is to exit, so a
    server still importing (before `enable_stack_dumps`) must not get it. False where it cannot be told."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration, ValueError):
        return False
    return bool(caught >> (DUMP_SIGNAL - 1) & 1)


def request_dump(pid: int) -> bool:
    """Ask a process started with `enable_stack_dumps` for its stacks; False when it is gone or has no handler."""
    if not catches_dump_signal(pid):
        return False
    try:
        os.kill(pid, DUMP_SIGNAL)
    except ProcessLookupError:
        return False
    return True
