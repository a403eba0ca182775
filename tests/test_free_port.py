"""The tests' and the bench's free ports (bench/measure/launch.free_port): never from the kernel's ephemeral range.

Why: a server binds its port seconds after free_port checked it (a start imports torch), and every bind(0) and
outgoing connection on the machine draws from the ephemeral range meanwhile: in CI run 53 a gRPC server of another
test process held an API front's port (15 errors). Below the range only another free_port picks, and two
pytest-xdist workers draw from disjoint bands.
"""

from __future__ import annotations

import socket

import bench.measure.launch as launch


def test_free_ports_are_below_the_ephemeral_range_free_and_not_repeated():
    low = launch._ephemeral_low()
    ports = [launch.free_port() for _ in range(50)]
    assert all(launch.PORT_FLOOR <= p < low for p in ports), ports
    assert len(set(ports)) == len(ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # free: nothing took it


def test_two_xdist_workers_draw_from_disjoint_bands(monkeypatch):
    drawn = {}
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        drawn[worker] = {launch.free_port() for _ in range(20)}
    width = (launch._ephemeral_low() - launch.PORT_FLOOR) // launch.BANDS
    assert {(p - launch.PORT_FLOOR) // width for p in drawn["gw0"]} == {0}  # one band each
    assert {(p - launch.PORT_FLOOR) // width for p in drawn["gw1"]} == {1}


def test_a_port_in_use_is_skipped(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    width = (launch._ephemeral_low() - launch.PORT_FLOOR) // launch.BANDS
    band = range(launch.PORT_FLOOR + 3 * width, launch.PORT_FLOOR + 4 * width)
    held = []
    try:
        for port in band[1:]:  # every port of the band but its first taken
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            held.append(s)
        monkeypatch.setattr(launch, "_given", set())
        assert launch.free_port() == band[0]
    finally:
        for s in held:
            s.close()
