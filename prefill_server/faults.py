"""Fault injection for the fault tests: hold a transfer mid-stream (a typed option, never an env var).

Why a stall and not a crash: a test needs a transfer that is certainly *in flight* when it
does the real damage (kill -9 a worker, down a link, restart the peer), on a machine of any
speed. Holding the device thread after N layers makes that moment certain; the log line
says when it has come.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("kvtransfer.prefill")


class StallFault:
    """Hold each of the first `requests` transfers for `stall_s` before layer `after_layers` leaves."""

    def __init__(self, after_layers: int, stall_s: float, requests: int):
        self.after_layers, self.stall_s, self.left = after_layers, stall_s, requests
        self._lock = threading.Lock()

    def wrap(self, request_id: int, num_layers: int, send):
        """`send` itself, or a send_layer that stalls once, at layer min(after_layers, num_layers - 1)."""
        with self._lock:
            if self.left <= 0:
                return send
            self.left -= 1
        at = min(self.after_layers, num_layers - 1)

        def held(i, k, v):
            if i == at:
                log.warning("request %d: fault injection: holding the transfer %.1f s after %d layers", request_id,
                            self.stall_s, i)
                time.sleep(self.stall_s)
                log.warning("request %d: fault injection: transfer released", request_id)
            send(i, k, v)
        return held
