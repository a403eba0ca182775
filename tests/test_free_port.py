"""The tests' and the bench's free ports (bench/measure/launch.free_port): below the kernel's ephemeral range, and
never the same port to two processes while a server may still be starting on it.

Why: a server binds its port seconds after free_port checked it (a start imports torch), and every bind(0) and
outgoing connection on the machine draws from the ephemeral range meanwhile: in CI run 53 a gRPC server of another
test process held an API front's port (15 errors). Below the range only free_port picks, and a registry file under a
lock keeps what it handed out, for every process (xdist workers, their children, another test run).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

import bench.measure.launch as launch


@pytest.fixture
def registry(tmp_path, monkeypatch):
    path = str(tmp_path / "ports.json")
    monkeypatch.setattr(launch, "REGISTRY", path)
    return path


def test_free_ports_are_below_the_ephemeral_range_free_and_not_repeated(registry):
    low = launch._ephemeral_low()
    if low - launch.PORT_FLOOR < 1024:
        pytest.skip(f"the ephemeral range starts at {low}: free_port takes the kernel's pick here")
    ports = [launch.free_port() for _ in range(300)]
    assert all(launch.PORT_FLOOR <= p < low for p in ports), ports
    assert len(set(ports)) == len(ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # free: nothing took it
    assert set(json.load(open(registry))) == {str(p) for p in ports}


CHILD = """
import json, os, sys, time
import bench.measure.launch as L
L.REGISTRY, L.PORT_FLOOR = sys.argv[1], int(sys.argv[2])
L._ephemeral_low = lambda: L.PORT_FLOOR + 1024
while not os.path.exists(sys.argv[4]):  # both start drawing together
    time.sleep(0.001)
print(json.dumps([L.free_port() for _ in range(int(sys.argv[3]))]))
"""


def test_two_processes_drawing_at_once_never_get_the_same_port(registry, tmp_path):
    """Two processes (as an xdist worker's children: the same environment, each its own memory) draw 450 ports each
    from the same 1,024 at the same time: no port twice. Drawn at random they would share ~200; with the registry but
    no lock, their reads and writes interleave and lose each other's ports."""
    floor, go = 24000, tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, registry, str(floor), "450", str(go)],
                              stdout=subprocess.PIPE, text=True, cwd=launch.ROOT) for _ in range(2)]
    time.sleep(1.0)  # both imported and waiting (a late one only draws after the other: still no port twice)
    go.touch()
    drawn = [set(json.loads(p.communicate(timeout=120)[0])) for p in procs]
    assert [len(d) for d in drawn] == [450, 450] and not drawn[0] & drawn[1]


def test_a_port_in_use_is_skipped_and_the_longest_held_comes_back_last(registry, monkeypatch):
    floor = 26000
    monkeypatch.setattr(launch, "PORT_FLOOR", floor)
    monkeypatch.setattr(launch, "_ephemeral_low", lambda: floor + 1024)
    held = []
    try:
        for port in range(floor + 1, floor + 1024):  # every port but the first taken
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            held.append(s)
        first = launch.free_port()
        assert first == floor
        assert launch.free_port() == floor  # all taken and handed out: the longest held again, as it is free
    finally:
        for s in held:
            s.close()
