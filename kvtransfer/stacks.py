"""Python stack dumps for hangs: a process that stops making progress says where it is stuck.

Why: the one two-GPU run so far hung in a handshake, and a timeout with no stacks left only NCCL's watchdog
to say which wait it was. So:
- servers (`enable_stack_dumps`): `kill -USR1 PID` writes every thread's stack to stderr (the server's log)
  and the server goes on serving; a fatal signal (segfault, abort) dumps them too;
- bench drivers (`exit_on_sigterm`, what `timeout` sends): the driver's own stacks, then an orderly exit, so
  the servers it started are asked for theirs (`bench.launch.stop`) and stopped rather than orphaned.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys

DUMP_SIGNAL = signal.SIGUSR1


def enable_stack_dumps() -> bool:
    """Fatal signals and DUMP_SIGNAL write all threads' Python stacks to stderr (the process keeps running).
    False, and nothing changed, where stderr is no file (a caller's capture, e.g. pytest's)."""
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return False
    faulthandler.enable(all_threads=True)
    faulthandler.register(DUMP_SIGNAL, all_threads=True, chain=False)
    return True


def exit_on_sigterm() -> None:
    """SIGTERM: this process's stacks on stderr, then SystemExit(143) so `finally` blocks stop the servers."""
    def handler(signum, _frame):
        faulthandler.dump_traceback(all_threads=True)
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, handler)


def request_dump(pid: int) -> bool:
    """Ask a process started with `enable_stack_dumps` for its stacks; False when it is gone."""
    try:
        os.kill(pid, DUMP_SIGNAL)
    except ProcessLookupError:
        return False
    return True
