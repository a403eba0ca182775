"""The cuda_ipc control channel: whole typed messages over one local socket.

Why a socket of our own: the data moves GPU to GPU through shared memory, so all that
crosses between the two processes is small control traffic (memory and event handles
once per connection; per request a header, one 17-byte "landed" message per layer and a
trailer; a release per slot reuse). Reads take a deadline (poll), so a silent peer is a
timeout, never a hang; writes are whole frames under a lock, from any thread.
Addresses are `unix:/path/to.sock` or `tcp://127.0.0.1:PORT` (port 0 picks one).
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time

from kvtransfer.transport.base import TransferError
from kvtransfer.transport.cuda_ipc.messages import (
    FRAME,
    MAGIC,
    MAX_PAYLOAD,
    ROLE_SENDER,
    VERSION,
    Hello,
    Message,
    decode,
    encode,
)


class Channel:
    """One connected socket: whole messages out (thread-safe), whole messages in with a deadline."""

    def __init__(self, sock: socket.socket):
        sock.setblocking(True)
        self.sock = sock
        self._buf = bytearray()
        self._wlock = threading.Lock()
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)

    def send(self, m: Message) -> None:
        self.send_frame(encode(m))

    def send_frame(self, data: bytes) -> None:
        try:
            with self._wlock:
                self.sock.sendall(data)
        except OSError as e:
            raise TransferError("peer", f"control channel write failed: {e}") from None

    def recv(self, deadline: float | None) -> Message | None:
        """The next message; None once `deadline` (time.monotonic) passes; TransferError on EOF or garbage."""
        while True:
            if len(self._buf) >= FRAME.size:
                tag, n = FRAME.unpack_from(self._buf)
                if n > MAX_PAYLOAD:
                    raise TransferError("protocol", f"control message of {n} bytes exceeds {MAX_PAYLOAD}")
                if len(self._buf) >= FRAME.size + n:
                    payload = bytes(self._buf[FRAME.size:FRAME.size + n])
                    del self._buf[:FRAME.size + n]
                    return decode(tag, payload)
            wait_ms = None
            if deadline is not None:
                wait_ms = int((deadline - time.monotonic()) * 1000) + 1
                if wait_ms <= 0:
                    return None
            if not self._poll.poll(wait_ms):
                continue  # the deadline is checked again above
            try:
                chunk = self.sock.recv(65536)
            except OSError as e:
                raise TransferError("peer", f"control channel read failed: {e}") from None
            if not chunk:
                raise TransferError("peer", "control channel closed by the peer (process exited or link closed)")
            self._buf += chunk

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a reader blocked in poll()
        except OSError:
            pass  # already disconnected
        self.sock.close()


def _parse(address: str) -> tuple[int, object]:
    if address.startswith("unix:"):
        return socket.AF_UNIX, address[len("unix:"):]
    if address.startswith("tcp://"):
        host, _, port = address[len("tcp://"):].rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"address {address!r}: expected tcp://HOST:PORT")
        return socket.AF_INET, (host, int(port))
    raise ValueError(f"address {address!r}: expected unix:/path/to.sock or tcp://127.0.0.1:PORT")


def listen(address: str) -> tuple[socket.socket, str]:
    """A listening socket and its concrete address (the chosen port when PORT is 0)."""
    family, where = _parse(address)
    sock = socket.socket(family, socket.SOCK_STREAM)
    if family == socket.AF_UNIX:
        if os.path.exists(where):
            os.unlink(where)  # a stale socket file from an earlier run
    else:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(where)
    sock.listen(1)
    if family == socket.AF_UNIX:
        return sock, address
    host, port = sock.getsockname()[:2]
    return sock, f"tcp://{host}:{port}"


def accept(listener: socket.socket, deadline: float | None) -> socket.socket:
    listener.settimeout(None if deadline is None else max(deadline - time.monotonic(), 0.001))
    try:
        sock, _ = listener.accept()
    except TimeoutError:
        raise TransferError("timeout", "no sender connected to the control channel in time") from None
    _tune(sock)
    return sock


def connect(address: str, deadline: float) -> socket.socket:
    """Connect, retrying while the receiver is not listening yet, until `deadline`."""
    family, where = _parse(address)
    while True:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.connect(where)
        except (FileNotFoundError, ConnectionRefusedError) as e:
            sock.close()
            if time.monotonic() > deadline:
                raise TransferError("timeout", f"no receiver listening at {address}: {e}") from None
            time.sleep(0.05)
            continue
        _tune(sock)
        return sock


def _tune(sock: socket.socket) -> None:
    sock.settimeout(None)
    if sock.family == socket.AF_INET:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def expect(chan: Channel, cls: type[Message], deadline: float | None, what: str) -> Message:
    """The next message, which must be a `cls` (handshake steps)."""
    m = chan.recv(deadline)
    if m is None:
        raise TransferError("timeout", f"handshake: no {what} from the peer in time")
    if not isinstance(m, cls):
        raise TransferError("protocol", f"handshake: expected {what}, got {type(m).__name__}")
    return m


def check_hello(m: Hello, role: int) -> None:
    if (m.magic, m.version, m.role) != (MAGIC, VERSION, role):
        raise TransferError("protocol", f"peer is not a cuda_ipc {'sender' if role == ROLE_SENDER else 'receiver'} "
                            f"of protocol version {VERSION}: {m.magic!r} v{m.version} role {m.role}")
