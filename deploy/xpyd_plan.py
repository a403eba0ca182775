"""What deploy/launch_xpyd.py starts: its flags -> each process's command line, address, device and environment.

Why apart from the launcher: the plan is pure (ports, address lists in the same order for every decode worker,
one rendezvous per prefill worker for nccl/gloo, devices dealt round-robin, the flags refused because the launcher
sets them itself), so `--dry-run` and the tests read it without starting anything; launch_xpyd.py starts, watches
and stops what it says.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository (children import from it)
PROG = "launch_xpyd"
TRANSPORTS = ("auto", "nccl", "gloo", "grpc", "cuda_ipc")
PROCESS_GROUP = ("auto", "nccl", "gloo")  # transports joined through a torch.distributed rendezvous (--dist-init)
DEVICE = re.compile(r"auto|cpu|cuda|cuda:\d+")
# flags the launcher sets itself: given again through --*-args they would contradict its lists
OWN_FLAGS = {
    "prefill": ("--listen", "--device", "--transport", "--dist-init", "--model", "--dtype"),
    "decode": ("--listen", "--device", "--transport", "--dist-init", "--model", "--dtype", "--prefill-addr",
               "--colocated"),
    "router": ("--listen", "--worker"),
}

@dataclass
class Child:
    name: str  # prefill-0, decode-1, router
    role: str  # prefill, decode, router
    module: str
    args: list[str]
    addr: str  # where its gRPC (and health) answers
    device: str = ""
    tls: bool = False  # its front door serves TLS (health is checked over TLS)
    log: str = ""
    proc: subprocess.Popen | None = None
    serving: bool = False
    env: dict = field(default_factory=dict)

    def command(self) -> list[str]:
        return [sys.executable, "-m", self.module, *self.args]

    def last_line(self) -> str:
        try:
            with open(self.log, errors="replace") as f:
                lines = [ln.strip() for ln in f.read()[-8000:].splitlines() if ln.strip()]
        except OSError:
            return ""
        return lines[-1] if lines else ""


class Refused(Exception):
    """A bad combination of flags: one line, exit 2."""


class Parser(argparse.ArgumentParser):
    """A bad flag: one line naming it, exit 2 (as the servers do), not the whole usage. The --*-args strings may be
    a lone flag (`--router-args "--no-prefix-affinity"`), which argparse would take for an option of its own."""

    PASSED = ("--prefill-args", "--decode-args", "--router-args")

    def parse_known_args(self, args=None, namespace=None):
        given, out = list(sys.argv[1:] if args is None else args), []
        while given:
            a = given.pop(0)
            out.append(f"{a}={given.pop(0)}" if a in self.PASSED and given else a)  # its value, whatever it is
        return super().parse_known_args(out, namespace)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill workers")
    p.add_argument("--decode", type=int, default=1, metavar="M", help="decode workers (behind the router)")
    p.add_argument("--model", default="tiny", help="a preset or a local Hugging Face directory (all workers)")
    p.add_argument("--dtype", default="auto", help="weights and KV dtype (all workers)")
    p.add_argument("--device-prefill", default="auto", metavar="LIST",
                   help="comma-separated devices dealt round robin to the prefill workers (auto, cpu, cuda, cuda:N)")
    p.add_argument("--device-decode", default="auto", metavar="LIST",
                   help="the same for the decode workers")
    p.add_argument("--transport", default="auto", choices=TRANSPORTS,
                   help="data plane between prefill and decode (auto: nccl on cuda, gloo on cpu)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address every worker binds and is reached at (loopback unless told otherwise)")
    p.add_argument("--base-port", type=int, default=0,
                   help="prefill i at B+i, decode j at B+N+j, rendezvous i at B+N+M+i (0: free ports)")
    p.add_argument("--router-listen", default="", metavar="HOST:PORT",
                   help="the router's front door, what clients call (default HOST:50050; port 0: a free one)")
    p.add_argument("--metrics-base-port", type=int, default=0, metavar="P",
                   help="Prometheus /metrics of each process: prefill i at P+i, decode j at P+N+j, the router at "
                        "P+N+M (0: none)")
    p.add_argument("--prefill-args", default="", metavar='"..."', help="extra flags for every prefill worker")
    p.add_argument("--decode-args", default="", metavar='"..."', help="extra flags for every decode worker")
    p.add_argument("--router-args", default="", metavar='"..."', help="extra flags for the router")
    p.add_argument("--log-dir", default="", help="one log per process here (default: a new temp directory)")
    p.add_argument("--start-timeout-s", type=float, default=600.0,
                   help="every process must report SERVING within this, s")
    p.add_argument("--stop-grace-s", type=float, default=30.0,
                   help="on stop: each group gets this long after SIGTERM before SIGKILL, s (above the servers' "
                        "--shutdown-grace-s, 20 by default)")
    p.add_argument("--check-tls-ca", default="",
                   help="CA (PEM) verifying the processes' TLS (--tls-cert in --prefill-args, --decode-args or "
                        "--router-args) for the launcher's health checks")
    p.add_argument("--check-tls-cert", default="",
                   help="client certificate for those checks (processes with --tls-ca, mTLS)")
    p.add_argument("--check-tls-key", default="", help="private key of --check-tls-cert")
    p.add_argument("--dry-run", action="store_true", help="print each process's command line and exit")
    return p


def split_list(flag: str, value: str) -> list[str]:
    items = [v.strip() for v in value.split(",")]
    if not value.strip() or any(not v for v in items):
        raise Refused(f"{flag} {value!r}: expected a comma-separated list without empty items")
    return items


def split_addr(flag: str, value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise Refused(f"{flag} {value!r}: expected HOST:PORT with PORT 0..65535 (IPv6 as [::1]:PORT)")
    return host, int(port)


def visible_gpus() -> int:
    """GPUs the workers would see, without loading torch: CUDA_VISIBLE_DEVICES when set, else `nvidia-smi -L`."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return len([d for d in env.split(",") if d.strip() and not d.strip().startswith("-")])
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines()) if out.returncode == 0 else 0


def deal(flag: str, value: str, count: int, first: int, gpus) -> list[str]:
    """`count` devices from `value` round robin; `auto` alone: the visible GPUs in turn, from the `first`-th on."""
    items = split_list(flag, value)
    for d in items:
        if not DEVICE.fullmatch(d):
            raise Refused(f"{flag}: {d!r} is not a device; use auto, cpu, cuda or cuda:N")
    if items == ["auto"]:
        n = gpus()
        return [f"cuda:{(first + i) % n}" for i in range(count)] if n else ["cpu"] * count
    return [items[i % len(items)] for i in range(count)]


def own_flag(args: list[str], role: str) -> str | None:
    for a in args:
        name = a.split("=", 1)[0]
        if name in OWN_FLAGS[role]:
            return name
    return None


class Ports:
    """Free ports (held until all are chosen, so none repeats) or consecutive ones from --base-port."""

    def __init__(self, host: str, base: int):
        self.host, self.base, self.next, self.held = host, base, base, []

    def take(self) -> int:
        if self.base:
            port, self.next = self.next, self.next + 1
            if port > 65535:
                raise Refused(f"--base-port {self.base}: the layout runs past port 65535")
            return port
        s = socket.socket(socket.AF_INET6 if ":" in self.host.strip("[]") else socket.AF_INET)
        try:
            s.bind((self.host.strip("[]"), 0))
        except OSError:
            s.close()
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
        self.held.append(s)
        return s.getsockname()[1]

    def release(self) -> None:
        for s in self.held:
            s.close()
        self.held = []


def plan(ns: argparse.Namespace, gpus=visible_gpus) -> list[Child]:
    """Every process, in start order (prefill workers, decode workers, the router); raises Refused on bad input."""
    n, m = ns.prefill, ns.decode
    if n < 1 or m < 1:
        raise Refused(f"--prefill {n} --decode {m}: need at least one of each")
    if not 0 <= ns.base_port <= 65535:
        raise Refused(f"--base-port {ns.base_port}: must be 0 (free ports) or a port")
    if ns.start_timeout_s <= 0 or ns.stop_grace_s < 0:
        raise Refused("--start-timeout-s must be > 0 and --stop-grace-s >= 0")
    host = ns.host.strip()
    split_addr("--host", f"{host}:1")
    extra = {}
    for role in ("prefill", "decode", "router"):
        try:
            extra[role] = shlex.split(getattr(ns, f"{role}_args"))
        except ValueError as e:
            raise Refused(f"--{role}-args: {e}") from None
        if (flag := own_flag(extra[role], role)) is not None:
            raise Refused(f"--{role}-args sets {flag}, which the launcher sets for every {role} process; "
                          f"use the launcher's own flags (--host, --base-port, --device-*, --transport, --model, "
                          f"--dtype, --router-listen)")
    if bool(ns.check_tls_cert) != bool(ns.check_tls_key):
        raise Refused("--check-tls-cert and --check-tls-key go together")
    for path in (ns.check_tls_ca, ns.check_tls_cert, ns.check_tls_key):
        if path and not os.path.isfile(path):
            raise Refused(f"{path}: no such file")
    tls = {role: any(a.split("=", 1)[0] == "--tls-cert" for a in extra[role]) for role in OWN_FLAGS}
    if any(tls.values()) and not ns.check_tls_ca:
        on = ", ".join(f"--{r}-args" for r, t in tls.items() if t)
        raise Refused(f"--tls-cert in {on}: give --check-tls-ca (the launcher checks each process's health over its "
                      "TLS front door)")
    if tls["decode"] and not any(a.split("=", 1)[0] == "--worker-tls-ca" for a in extra["router"]):
        raise Refused("--tls-cert in --decode-args: give the router --worker-tls-ca (and --worker-tls-cert/-key "
                      "when the decode workers require client certificates) in --router-args")
    p_dev = deal("--device-prefill", ns.device_prefill, n, 0, gpus)
    d_dev = deal("--device-decode", ns.device_decode, m, n, gpus)
    kinds = {"cpu" if d == "cpu" else "auto" if d == "auto" else "cuda" for d in p_dev + d_dev}
    if ns.transport in ("nccl", "cuda_ipc") and "cpu" in kinds:
        raise Refused(f"--transport {ns.transport} needs CUDA devices; a cpu worker pairs over gloo or grpc")
    if ns.transport == "auto" and {"cpu", "cuda"} <= kinds:
        raise Refused("--transport auto with both cpu and cuda workers would pick gloo on one side and nccl on the "
                      "other; name --transport (gloo or grpc)")
    if ns.router_listen:
        r_host, r_port = split_addr("--router-listen", ns.router_listen)
    else:
        r_host, r_port = host, 50050
    ports = Ports(host, ns.base_port)
    try:
        p_ports = [ports.take() for _ in range(n)]
        d_ports = [ports.take() for _ in range(m)]
        r_ports = [ports.take() for _ in range(n)] if ns.transport in PROCESS_GROUP else []
        if r_port == 0:
            r_port = _free(r_host)
    finally:
        ports.release()
    if r_port in p_ports + d_ports + r_ports:
        raise Refused(f"router port {r_port} is also a worker's in the --base-port {ns.base_port} layout; move "
                      "--router-listen or --base-port")
    fmt = (lambda h, p: f"[{h}]:{p}" if ":" in h and not h.startswith("[") else f"{h}:{p}")
    p_addrs = [fmt(host, p) for p in p_ports]
    d_addrs = [fmt(host, p) for p in d_ports]
    dist = [f"tcp://{fmt(host, p)}" for p in r_ports]
    common = ["--model", ns.model, "--dtype", ns.dtype, "--transport", ns.transport]
    env = {"NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0")} if ns.transport in ("nccl", "auto") else {}
    if not 0 <= ns.metrics_base_port <= 65535 - n - m:
        raise Refused(f"--metrics-base-port {ns.metrics_base_port}: must be 0 (none) or a port with room for "
                      f"{n + m + 1} after it")

    def metrics(k: int) -> list[str]:
        return ["--metrics-port", str(ns.metrics_base_port + k)] if ns.metrics_base_port else []
    children = []
    for i in range(n):
        args = [*common, "--device", p_dev[i], "--listen", p_addrs[i], *(["--dist-init", dist[i]] if dist else []),
                *metrics(i), *extra["prefill"]]
        children.append(Child(f"prefill-{i}", "prefill", "prefill_server", args, p_addrs[i], p_dev[i],
                              tls["prefill"], env=env))
    for j in range(m):
        args = [*common, "--device", d_dev[j], "--listen", d_addrs[j], "--prefill-addr", ",".join(p_addrs),
                *(["--dist-init", ",".join(dist)] if dist else []), *metrics(n + j), *extra["decode"]]
        children.append(Child(f"decode-{j}", "decode", "decode_server", args, d_addrs[j], d_dev[j], tls["decode"],
                              env=env))
    r_addr = fmt(r_host, r_port)
    children.append(Child("router", "router", "router", ["--listen", r_addr, "--worker", ",".join(d_addrs),
                                                         *metrics(n + m), *extra["router"]], r_addr,
                          tls=tls["router"]))
    return children


def _free(host: str) -> int:
    ports = Ports(host, 0)
    try:
        return ports.take()
    finally:
        ports.release()
