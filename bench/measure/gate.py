"""A loopback TCP port that forwards to another address, but only once opened: a server pointed at it waits.

Why: to time what a worker does once it can reach its peer, without its own start-up (seconds of imports and
model load, longer still on a busy machine) in the figure: the worker is started early against the closed gate,
and the clock starts when the gate opens (bench/probes/abandoned_handshake.py).
"""

from __future__ import annotations

import socket
import threading

from bench.measure.launch import free_port


class Gate:
    def __init__(self, target: str):
        """`target`: HOST:PORT that connections go on to once open()."""
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self._listener: socket.socket | None = None
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()

    def open(self) -> None:
        """Listen from now on; each connection is joined to a new one to the target."""
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(64)
        self._listener = s
        threading.Thread(target=self._accept, name="gate-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self._listener.accept()
            except OSError:  # closed
                return
            try:
                up = socket.create_connection(self.target, timeout=10)
                up.settimeout(None)
            except OSError:
                down.close()
                continue
            with self._lock:
                self._sockets += [down, up]
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=_pump, args=(a, b), name="gate-pump", daemon=True).start()

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            for s in self._sockets:
                s.close()
            self._sockets.clear()

    def __enter__(self) -> "Gate":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Bytes from `src` to `dst` until either end closes; then the other direction is told (shutdown)."""
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
        try:
            s.shutdown(how)
        except OSError:
            pass
