"""A trace of the decode scheduler's passes inside a running server, for finding where a gap between two tokens goes.

Why a sitecustomize: the interference bench starts its own decode server; putting this folder first on PYTHONPATH
with KVT_TRACE=<file> set wraps, in that server, the scheduler's pieces (the job's piece, make_room, queue_step,
_deliver), the first token's `to_host`, each chunk's forward launch, the prefix cache's keep and the loop's Mailbox
(its drains and the event loop's lag), then appends JSON lines to <file>: host times (perf_counter, s) and, for
the job's piece and the step, CUDA event times (ms after the first event). Without KVT_TRACE it does nothing.
Read the file with `python -m bench.probes.sched_trace.report <file>`. (Call 9's KVT_CHUNK_NO_CUDNN variant is gone:
the chunks no longer run chunk_attention, and the variant was not adopted.)
"""

import atexit
import json
import os
import sys
import threading
import time

PATH = os.environ.get("KVT_TRACE")


def _install():  # noqa: C901 - one wrapper each, flat on purpose
    import torch

    import kvtransfer.engine.engine as E
    import kvtransfer.engine.scheduler as S

    recs, lock, base = [], threading.Lock(), []

    def ev():
        if not torch.cuda.is_available():
            return None
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        if not base:
            base.append(e)
        return e

    def put(**r):
        with lock:
            recs.append(r)

    def timed(name, fn, gpu=False, info=None):
        def wrapper(*a, **k):
            try:
                extra = info(a, k) if info else {}
            except Exception:  # noqa: BLE001 - another tree's signature
                extra = {}
            t0, e0 = time.perf_counter(), ev() if gpu else None
            try:
                out = fn(*a, **k)
            finally:
                put(k=name, t0=t0, t1=time.perf_counter(), e0=e0, e1=ev() if gpu else None, **extra)
            return out
        return wrapper

    S.Scheduler._advance = staticmethod(timed("advance", S.Scheduler._advance, gpu=True))
    S.queue_step = timed("queue_step", S.queue_step, gpu=True, info=lambda a, k: {"rows": len(a[2])})
    if hasattr(S, "make_room"):
        S.make_room = timed("make_room", S.make_room)
    S.Scheduler._deliver = timed("deliver", S.Scheduler._deliver, info=lambda a, k: {"rows": len(a[1].batch)})
    if hasattr(E, "to_host"):
        E.to_host = timed("to_host", E.to_host, gpu=True)
    E.prefill = timed("forward", E.prefill, gpu=True, info=lambda a, k: {"tokens": int(a[1].shape[1])})
    add = S.Scheduler.add
    S.Scheduler.add = lambda self, seq: (put(k="add", t0=time.perf_counter(), n=seq.length), add(self, seq))[1]
    try:
        import kvtransfer.engine.prefix_cache as P
        P.PrefixCache.keep = timed("keep", P.PrefixCache.keep, info=lambda a, k: {"n": len(a[2])})
    except (ImportError, AttributeError):
        pass
    try:
        import decode_server.streams as D
        init, drain = D.Mailbox.__init__, D.Mailbox._drain

        def mailbox_init(self, loop):
            init(self, loop)
            def tick(due):
                now = time.perf_counter()
                if now - due > 0.004:
                    put(k="loop_lag", t0=due, t1=now)
                loop.call_later(0.005, tick, now + 0.005)
            loop.call_soon_threadsafe(tick, time.perf_counter())
        D.Mailbox.__init__ = mailbox_init
        D.Mailbox._drain = timed("drain", drain, info=lambda a, k: {"items": len(a[0]._items)})
    except (ImportError, AttributeError):
        pass

    writing = threading.Lock()  # the exit's flush and the thread's never interleave; `lock` is held only to swap

    def flush():
        with writing:
            with lock:
                out, recs[:] = list(recs), []
            with open(PATH, "a") as f:  # waits on events outside `lock`: the traced threads never wait for it
                for r in out:
                    for key in ("e0", "e1"):
                        e = r.pop(key, None)
                        if e is not None:
                            e.synchronize()
                            r["g" + key[1]] = base[0].elapsed_time(e)
                    f.write(json.dumps(r) + "\n")

    def every_half_second():
        while True:
            time.sleep(0.5)
            flush()
    threading.Thread(target=every_half_second, daemon=True, name="sched-trace").start()
    atexit.register(flush)  # what the last half second recorded (a server stopped by SIGTERM exits normally)


def _wait_then_install():
    """Poll until the server's modules are whole (a client never imports them: this thread then just sleeps)."""
    def whole(module, last):
        return hasattr(sys.modules.get(module), last)
    while not (whole("kvtransfer.engine.engine", "past_cache") and whole("decode_server.streams", "TokenStream")
               and whole("kvtransfer.engine.scheduler", "Scheduler")):
        time.sleep(0.01)
    _install()


if PATH:
    threading.Thread(target=_wait_then_install, daemon=True, name="sched-trace-install").start()
