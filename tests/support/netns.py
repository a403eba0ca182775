"""Two test hosts on one machine: network namespaces joined by a veth pair (root + iproute2)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Host:
    ns: str
    ifname: str
    addr: str

    @property
    def prefix(self) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.ns)

    def run(self, *cmd: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run([*self.prefix, *cmd], capture_output=True, text=True, **kw)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"kvt-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as e:
        return f"`ip netns add` failed: {e.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


@contextmanager
def two_hosts(tag: str = ""):
    """Yields (a, b): two namespaces with 10.231.x.1 and 10.231.x.2 on a veth pair, loopback up."""
    n = os.getpid() % 200
    a = Host(f"kvt-a{n}{tag}", f"kva{n}{tag}"[:15], f"10.231.{n}.1")
    b = Host(f"kvt-b{n}{tag}", f"kvb{n}{tag}"[:15], f"10.231.{n}.2")
    for h in (a, b):
        subprocess.run(["ip", "netns", "del", h.ns], capture_output=True)
    try:
        _ip("netns", "add", a.ns)
        _ip("netns", "add", b.ns)
        _ip("link", "add", a.ifname, "netns", a.ns, "type", "veth", "peer", "name", b.ifname, "netns", b.ns)
        for h in (a, b):
            _ip("-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", h.ifname)
            _ip("-n", h.ns, "link", "set", h.ifname, "up")
            _ip("-n", h.ns, "link", "set", "lo", "up")
        yield a, b
    finally:
        for h in (a, b):
            subprocess.run(["ip", "netns", "del", h.ns], capture_output=True)


def set_link(host: Host, up: bool) -> None:
    """Down or up the host's end of the veth (fault injection)."""
    _ip("-n", host.ns, "link", "set", host.ifname, "up" if up else "down")


def wait_for_line(path: str, text: str, procs, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(path) as f:
            if text in f.read():
                return
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a server exited before {text!r}")
        time.sleep(0.2)
    raise TimeoutError(f"{text!r} not in {path} after {timeout} s")
