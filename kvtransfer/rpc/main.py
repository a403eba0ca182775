"""A server process's frame: flags -> config, logging, one event loop, the device's worker thread, the exit code.

Why shared: every server (the two workers, the router) starts, logs, runs and ends the same way; a setting that
only shows at start-up exits 2 with one line saying which, and a fatal failure exits 70 (kvtransfer.rpc.lifecycle).
No torch here (the device's thread is kvtransfer/rpc/device_thread.py), so a front that must not load it (the
router) runs in this frame too.
"""

from __future__ import annotations

import asyncio
import logging


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (it is a dependency), else the default loop."""
    try:
        import uvloop
        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover - uvloop is a declared dependency
        return asyncio.new_event_loop()


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s %(message)s")


def run_main(config_cls, argv, description: str, serve, logger: logging.Logger, prog: str | None = None,
             parse=None) -> None:
    """A server's `main`: flags -> config (validated), logging, one uvloop loop running `serve(config)`.
    `parse(argv)`: the config from the flags, when configargs' one-flag-per-field does not fit (the router's
    repeated --worker); else `config_cls`'s flags.

    A setting that only shows at start-up (device, certificate, token file, port) exits 2
    with one line saying which. `serve` returns after a SIGTERM/SIGINT (kvtransfer.rpc.lifecycle): exit 0.

    Why the process ends with `os._exit` once `serve` is over: by then every request has ended and the
    ports are closed, but threads may still be blocked in a transport (a gloo receive the peer has not
    closed yet, a rendezvous); the interpreter would wait for them at exit (up to --dist-timeout-s), or
    finalize torch under them ("terminate called without an active exception", exit -6).
    """
    import os
    import sys

    from kvtransfer.rpc.configargs import from_args
    from kvtransfer.rpc.lifecycle import EXIT_FATAL, FatalStop
    from kvtransfer.rpc.stacks import enable_stack_dumps
    config = parse(argv) if parse is not None else from_args(config_cls, argv, description, prog)
    enable_stack_dumps()  # kill -USR1 PID: every thread's stack in the log
    configure_logging(config.log_level)
    logger.info("config %s", config.one_line())
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    code = 0
    try:
        loop.run_until_complete(serve(config))
    except KeyboardInterrupt:
        pass
    except ValueError as e:
        logger.error("cannot start: %s", e)
        code = 2
    except FatalStop as e:  # its traceback was logged when it happened
        logger.error("exiting %d: %s", EXIT_FATAL, e)
        code = EXIT_FATAL
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
