"""Form checks for flags whose mistakes would otherwise show only later (at bind, the handshake, the rendezvous).

Why at start: `--listen 127.0.0.1:70000` used to start on another port, and a rendezvous URL of a
scheme torch does not know failed only once the peer answered. Each check raises ValueError
naming the flag, which the servers turn into one line and exit status 2.
"""

from __future__ import annotations

import ipaddress
import re

_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,62}))*\.?$")
DIST_SCHEMES = ("env://", "tcp://", "file://")


def split_address(flag: str, value: str, allow_port_zero: bool = True) -> tuple[str, int]:
    """HOST:PORT (HOST a name, an IPv4 address or a bracketed IPv6 one; PORT 0..65535) -> (host, port)."""
    low = 0 if allow_port_zero else 1
    want = f"expected HOST:PORT with PORT {low}..65535 (IPv6 as [::1]:PORT)"
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{flag} {value!r}: {want}")
    if not low <= int(port) <= 65535:
        raise ValueError(f"{flag} {value!r}: port {int(port)} is outside {low}..65535")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ValueError(f"{flag} {value!r}: {host} is not an IPv6 address") from None
    elif not _HOSTNAME.match(host):
        raise ValueError(f"{flag} {value!r}: {host!r} is not a host name or address; {want}")
    return host.strip("[]"), int(port)


def check_address(flag: str, value: str, allow_port_zero: bool = True) -> None:
    split_address(flag, value, allow_port_zero)


def check_dist_init(flag: str, value: str) -> None:
    """A torch.distributed rendezvous URL: env://, tcp://HOST:PORT or file:///path."""
    if value == "env://":
        return
    if value.startswith("tcp://"):
        split_address(flag, value[len("tcp://"):].split("?", 1)[0], allow_port_zero=False)
        return
    if value.startswith("file://") and len(value) > len("file://"):
        return
    raise ValueError(f"{flag} {value!r}: use env://, tcp://HOST:PORT or file:///PATH")


def check_device(flag: str, value: str) -> None:
    """auto, cpu, cuda or cuda:N (whether CUDA is there is checked when the device is picked)."""
    if value in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", value):
        return
    raise ValueError(f"{flag} {value!r}: use auto, cpu, cuda or cuda:N")


MAX_SECONDS = 1e7  # ~116 days: the longest time a flag may give; gRPC's deadlines overflow past ~1e9 s (a request
# then failed DEADLINE_EXCEEDED at once), and nothing here needs to wait longer


def check_positive(config, *names: str) -> None:
    """Each named field must be > 0, and a time (a name ending in _s) at most MAX_SECONDS; the message names the
    flag."""
    for name in names:
        v = getattr(config, name)
        if not v > 0:
            raise ValueError(f"--{name.replace('_', '-')} {v}: must be > 0")
        check_seconds(config, name)


def check_seconds(config, *names: str) -> None:
    """Each named time (s) is a number at most MAX_SECONDS: not nan, not inf (a flag's 0 is its own meaning, and
    its sign is checked where that is said)."""
    for name in names:
        v = getattr(config, name)
        if name.endswith("_s") and not v <= MAX_SECONDS:
            raise ValueError(f"--{name.replace('_', '-')} {v}: give a number of seconds, at most {MAX_SECONDS:g}")
