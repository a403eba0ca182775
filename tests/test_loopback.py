"""Everything a one-box deployment starts listens on loopback only (issue #36, item 5): a 2P2D launch on CPU over
gloo (deploy/launch_xpyd.py, as deploy/README.md runs it), every pair joined, then every listening socket of the
launcher and of each process it started, read from /proc, must be on 127.0.0.0/8 or ::1.

Why /proc and not `ss`: the socket inodes in /proc/PID/fd tie each listener to its process (no psutil in the
venv, and `ss -p` needs privileges on some machines). Why wait for every pair: the gloo groups' own listeners
exist only once a pair has joined; the rendezvous store (torch's TCPStore, which listens on every interface
unless handed a bound socket) from the prefill worker's start.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import time

from bench.measure.launch import free_port
from test_deploy_launch import LINE, START_S, STOP_S, Lines, alive, launcher, logs


def socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            out.add(target[len("socket:["):-1])
    return out


def _address(field: str) -> tuple[str, int]:
    """/proc/net/tcp{,6}'s HEX_ADDR:HEX_PORT (each 32-bit word in host order, little-endian here)."""
    hexaddr, hexport = field.split(":")
    raw = bytes.fromhex(hexaddr)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    ip = ipaddress.ip_address(socket.inet_ntop(family, words))
    return str(getattr(ip, "ipv4_mapped", None) or ip), int(hexport, 16)  # ::ffff:127.0.0.1 is 127.0.0.1


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket of `pid` in LISTEN state."""
    inodes, out = socket_inodes(pid), []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            next(f)
            for line in f:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: TCP_LISTEN
                    out.append(_address(cols[1]))
    return out


def loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback  # 127.0.0.0/8, ::1


def children(pid: int) -> list[int]:
    """Every live descendant of `pid`."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, parent in parents.items() if parent == p]
        out += kids
        todo += kids
    return out


def test_a_2p2d_launch_listens_on_loopback_only(tmp_path):
    n = m = 2
    log_dir, router_addr = tmp_path / "logs", f"127.0.0.1:{free_port()}"
    proc = launcher("--prefill", str(n), "--decode", str(m), "--model", "tiny", "--dtype", "float32",
                    "--transport", "gloo", "--device-prefill", "cpu", "--device-decode", "cpu",
                    "--router-listen", router_addr, "--log-dir", str(log_dir), "--start-timeout-s", str(START_S - 10),
                    "--stop-grace-s", "10", "--decode-args", "--max-batch 4")
    out, pids = Lines(proc), {}
    try:
        out.until("ready:", START_S)
        for line in out.seen:
            if hit := LINE.match(line):
                pids[hit.group(1)] = int(hit.group(2))
        assert len(pids) == n + m + 1, out.seen
        deadline = time.monotonic() + 120  # ready means one pair per worker; the others join in the background
        while sum((log_dir / f"prefill-{i}.log").read_text().count("paired with decode instance")
                  for i in range(n)) < n * m:
            assert time.monotonic() < deadline, logs(log_dir)
            time.sleep(0.2)
        started = [proc.pid, *children(proc.pid)]
        assert set(pids.values()) <= set(started), (pids, started)
        found = {pid: listening(pid) for pid in started}
        names = {pid: name for name, pid in pids.items()} | {proc.pid: "launcher"}
        wild = {names.get(pid, pid): [a for a in addrs if not loopback(a[0])] for pid, addrs in found.items()}
        assert not any(wild.values()), f"listening beyond loopback: {wild}\nall: {found}"
        # what was looked at: the router's door, each decode worker's, each prefill worker's door, its rendezvous
        # store and its gloo listeners
        assert ("127.0.0.1", int(router_addr.rsplit(":", 1)[1])) in found[pids["router"]]
        assert all(len(found[pids[f"prefill-{i}"]]) >= 2 + m for i in range(n)), found
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=STOP_S) == 0, "\n".join(out.rest())
    except BaseException as e:
        raise AssertionError(f"{e}\n{logs(log_dir)}") from e
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        for pid in pids.values():  # only what this launcher started
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
