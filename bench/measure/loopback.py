"""Raw loopback ceilings of the host network path: a plain TCP socket and raw-bytes gRPC.

Why: the gRPC data plane is judged against what the same machine can move at all
(docs/architecture.md, "Targets": gRPC >= 80% of a raw TCP socket measured in the same run). This is the gRPC
*library's* ceiling (a generic handler, identity serializers, no protobuf copy, client
streaming in chunks), beside which `bench link` puts kvtransfer's own transport probe
(bench.measure.grpc_probe.measure_loopback). The receiver runs in its own
process (`python -m bench.measure.loopback serve`): sender and receiver do not share one
interpreter lock, as in a real pair. A run ends when the receiver acknowledged the byte
count; a wrong count fails the run.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from bench.measure.stats import median, spread_ms, timed

PUSH = "/kvbench.Loopback/Push"  # stream-unary: raw chunks in, an 8-byte count back
COUNT = struct.Struct("<Q")
IO_TIMEOUT_S = 120.0


def _grpc_options(limit: int) -> list:
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit),
            ("grpc.use_local_subchannel_pool", 1)]  # one TCP connection per channel


def _recv_exact(conn: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


def _socket_peer(conn: socket.socket) -> None:
    """Per run: an 8-byte length, that many bytes into one buffer, the count back."""
    buf, head = bytearray(), bytearray(COUNT.size)
    with conn:
        while _recv_exact(conn, memoryview(head)):
            (n,) = COUNT.unpack(head)
            if len(buf) != n:
                buf = bytearray(n)
            ok = _recv_exact(conn, memoryview(buf))
            conn.sendall(COUNT.pack(n if ok else 0))


def serve(max_message: int) -> None:
    """The receiver process: prints `tcp_port grpc_port`, serves until stdin closes."""
    lsock = socket.create_server(("127.0.0.1", 0))

    def accept_loop():
        while True:
            conn, _ = lsock.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=_socket_peer, args=(conn,), daemon=True).start()

    def push(chunks, _context) -> bytes:
        return COUNT.pack(sum(len(c) for c in chunks))

    handler = grpc.method_handlers_generic_handler(PUSH.split("/")[1], {
        PUSH.split("/")[2]: grpc.stream_unary_rpc_method_handler(push)})  # no (de)serializers: raw bytes
    server = grpc.server(ThreadPoolExecutor(max_workers=64), handlers=[handler],
                         options=_grpc_options(max_message)[:2])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    threading.Thread(target=accept_loop, daemon=True).start()
    print(lsock.getsockname()[1], port, flush=True)
    sys.stdin.read()  # the parent closes stdin (or dies): stop
    server.stop(0)


def _start_receiver(max_message: int) -> tuple[subprocess.Popen, int, int]:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "bench.measure.loopback", "serve", str(max_message)], cwd=root,
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline() if ready else ""
    if len(line.split()) != 2:
        proc.kill()
        raise RuntimeError(f"loopback receiver did not start (exit {proc.poll()})")
    tcp, grpc_port = map(int, line.split())
    return proc, tcp, grpc_port


def _parallel(pool: ThreadPoolExecutor | None, jobs: list[Callable[[], int]]) -> list[int]:
    return [jobs[0]()] if pool is None else list(pool.map(lambda f: f(), jobs))


def _timed_runs(once: Callable[[], bool], runs: int, warmup: int, nbytes: int) -> dict:
    oks = []
    secs = timed(lambda: oks.append(once()), runs=runs, warmup=warmup)
    return spread_ms(secs) | dict(runs=runs, gbps=nbytes / median(secs) / 1e9, bytes=nbytes, bytes_ok=all(oks))


def measure_loopback(bytes_total: int, channels: int = 1, chunk_bytes: int = 4 << 20, runs: int = 5,
                     warmup: int = 2) -> dict:
    """`bytes_total` over `channels` connections: {"socket": stats, "grpc": stats}, GB/s from the median."""
    if bytes_total < channels or channels < 1 or chunk_bytes < 1:
        raise ValueError("need channels >= 1, chunk_bytes >= 1 and bytes_total >= channels")
    pattern = os.urandom(1 << 20)
    payload = (pattern * (bytes_total // len(pattern) + 1))[:bytes_total]
    view, per = memoryview(payload), -(-bytes_total // channels)
    parts = [view[i:i + per] for i in range(0, bytes_total, per)]  # one slice per connection
    chunked = [[bytes(p[j:j + chunk_bytes]) for j in range(0, len(p), chunk_bytes)] for p in parts]
    proc, tcp_port, grpc_port = _start_receiver(chunk_bytes + 4096)
    pool = ThreadPoolExecutor(len(parts)) if len(parts) > 1 else None
    socks, chans = [], []
    try:
        for _ in parts:
            s = socket.create_connection(("127.0.0.1", tcp_port), timeout=IO_TIMEOUT_S)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            socks.append(s)
            chans.append(grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=_grpc_options(chunk_bytes + 4096)))
        calls = [c.stream_unary(PUSH) for c in chans]  # identity serializers: bytes in, bytes out

        def sock_send(s: socket.socket, p: memoryview) -> bool:
            s.sendall(COUNT.pack(len(p)))
            s.sendall(p)
            ack = bytearray(COUNT.size)
            return _recv_exact(s, memoryview(ack)) and COUNT.unpack(ack)[0] == len(p)

        def grpc_send(call, chunks: list[bytes]) -> bool:
            return COUNT.unpack(call(iter(chunks), timeout=IO_TIMEOUT_S))[0] == sum(map(len, chunks))

        sock_jobs = [lambda s=s, p=p: sock_send(s, p) for s, p in zip(socks, parts)]
        grpc_jobs = [lambda c=c, ch=ch: grpc_send(c, ch) for c, ch in zip(calls, chunked)]
        out = {"socket": _timed_runs(lambda: all(_parallel(pool, sock_jobs)), runs, warmup, bytes_total),
               "grpc": _timed_runs(lambda: all(_parallel(pool, grpc_jobs)), runs, warmup, bytes_total)}
        for v in out.values():
            v |= dict(channels=len(parts))
        out["grpc"]["chunk_bytes"] = chunk_bytes
        return out
    finally:
        for s in socks:
            s.close()
        for c in chans:
            c.close()
        if pool is not None:
            pool.shutdown()
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "serve":
    serve(int(sys.argv[2]))
