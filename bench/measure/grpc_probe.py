"""Loopback throughput probe for the bench's `link` command: the gRPC backend beside a raw TCP socket.

Why both at once: the gRPC target is relative (>= 80% of a raw TCP socket measured in the
same run), so the two are measured back to back on the same machine. The sender runs in
this process and the receivers in a spawned child (two interpreters, two GILs, as with a
prefill and a decode worker). gRPC time is open -> `finish()` returned, which includes the
receiver's acknowledgement; TCP time is first byte -> the receiver's byte count back.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import socket
import struct
import threading

import torch

from bench.measure.stats import median, spread_ms, timed
from kvtransfer.transport import TransferError, TransferHeader, registry
from kvtransfer.transport.layout import byte_view
from kvtransfer.transport.options import CHECKSUMS, Checksum, GrpcOptions

HEAD_DIM = 128  # float32, one kv head: a layer of `seq` tokens is 2 * seq * 512 bytes


def measure_loopback(bytes_total: int = 1 << 30, channels: int = 4, chunk_bytes: int = 4 << 20, layers: int = 8,
                     repeats: int = 3, checksum: Checksum = Checksum.NONE, device: str = "cpu") -> dict:
    """Move ~bytes_total over gRPC (the real backend) and over one raw TCP socket, `repeats` times each
    after one warm-up. Returns {"grpc": {...}, "socket": {...}, ...}, each with median_ms, min_ms,
    max_ms, runs, gbps and bytes_ok (the receiver acknowledged every byte).

    device "cuda" sources the cache from the GPU, so the gRPC figure includes the staged D2H copy.
    """
    seq = max(bytes_total // layers // (2 * HEAD_DIM * 4), 1)
    block = torch.zeros((layers, 2, 1, 1, seq, HEAD_DIM), dtype=torch.float32, device=device)  # (L, 2, b, h, s, d)
    nbytes = block.nbytes
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_receiver_main, args=(there, nbytes), daemon=True)
    child.start()
    try:
        if not here.poll(120):
            raise TransferError("timeout", "probe receiver did not start within 120 s")
        grpc_addr, tcp_port = here.recv()
        name = {v: k for k, v in CHECKSUMS.items()}[Checksum(checksum)]
        link = registry.sender_link("grpc", device, GrpcOptions(channels=channels, chunk_bytes=chunk_bytes,
                                                                checksum=name), address=grpc_addr)
        try:
            grpc_s = _timed(lambda rid: _send_grpc(link, block, rid), repeats)
        finally:
            link.close()
        with socket.create_connection(("127.0.0.1", tcp_port), timeout=120) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            host = byte_view(block.cpu())
            tcp_s = _timed(lambda _rid: _send_tcp(sock, host), repeats)
    finally:
        child.terminate()
        child.join(timeout=10)
    return {"bytes": nbytes, "channels": channels, "chunk_bytes": chunk_bytes, "checksum": Checksum(checksum).name,
            "device": device, "grpc": _stats(grpc_s, nbytes), "socket": _stats(tcp_s, nbytes),
            "grpc_vs_socket": median(tcp_s) / median(grpc_s)}


def _timed(fn, repeats: int) -> list[float]:
    """Seconds per run; a failed run raises (TransferError), so a finished run moved every byte."""
    rids = itertools.count(1)  # the warm-up (connections, pinned staging, page faults) is request 1
    return timed(lambda: fn(next(rids)), runs=repeats, warmup=1)


def _stats(seconds: list[float], nbytes: int) -> dict:
    return spread_ms(seconds) | {"runs": len(seconds), "gbps": nbytes / median(seconds) / 1e9, "bytes_ok": True}


def _send_grpc(link, block: torch.Tensor, request_id: int) -> None:
    L, _, b, h, s, d = block.shape
    hdr = TransferHeader(request_id=request_id, seq_len=s, num_layers=L, kv_heads=h, head_dim=d,
                         dtype=block.dtype, batch=b)
    sender = link.open(hdr)
    for i in range(L):
        sender.send_layer(i, block[i, 0], block[i, 1])
    sender.finish(timeout=300)


def _send_tcp(sock: socket.socket, data: memoryview) -> None:
    sock.sendall(struct.pack("<Q", len(data)))
    sock.sendall(data)
    got = sock.recv(8, socket.MSG_WAITALL)
    if len(got) != 8 or struct.unpack("<Q", got)[0] != len(data):
        raise TransferError("peer", f"probe TCP receiver acknowledged {got!r}, not {len(data)} bytes")


# --- child process: both receivers ---

def _receiver_main(conn, nbytes: int) -> None:
    link = registry.receiver_link("grpc", "cpu", GrpcOptions(), address="127.0.0.1:0", max_bytes=nbytes + (1 << 20))
    srv = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_tcp_sink, args=(srv, nbytes), daemon=True).start()
    conn.send((link.address, srv.getsockname()[1]))
    while True:
        r = link.accept(timeout=600)
        try:
            r.finish(timeout=300)
        except TransferError:
            pass  # the sender sees the same failure through its status code


def _tcp_sink(srv: socket.socket, nbytes: int) -> None:
    buf = memoryview(bytearray(nbytes))
    conn, _ = srv.accept()
    with conn:
        while True:
            head = conn.recv(8, socket.MSG_WAITALL)
            if len(head) < 8:
                return
            (n,) = struct.unpack("<Q", head)
            got = 0
            while got < n:
                k = conn.recv_into(buf[got:n])
                if k == 0:
                    return
                got += k
            conn.sendall(struct.pack("<Q", got))
