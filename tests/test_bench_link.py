"""`kvtransfer-bench link` smoke test on CPU: every probe runs (gloo p2p, host copies, socket, gRPC,
disk), CUDA-only ones are skipped with a reason, the JSON line and the files are written."""

from __future__ import annotations

import contextlib
import io
import json
import struct

import pytest

from bench.cli import main
from bench.runs import link
from bench.runs.link import size
from support.harness import forked_pairs


@pytest.fixture(scope="module")
def link_run(tmp_path_factory):
    """The CLI in this process (its p2p pair still two processes, forked: support.harness.forked_pairs), forced
    onto the CPU path."""
    out = tmp_path_factory.mktemp("link")
    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(stdout), forked_pairs():
        mp.setattr(link, "gpu_count", lambda: 0)
        rc = main(["link", "--bytes", "2MiB", "--layers", "4", "--warmup", "1", "--out", str(out)])
    assert rc == 0, stdout.getvalue()[-3000:]
    return json.loads(stdout.getvalue().strip().splitlines()[-1]), out


def test_link_json(link_run):
    result, _ = link_run
    assert result["kind"] == "link" and result["ok"] and result["failures"] == []
    assert result["bytes"] == 2 << 20 and result["layers"] == 4 and result["layer_bytes"] == 2 << 18
    links = result["links"]
    for name in ("p2p_whole", "p2p_layer", "socket", "grpc", "grpc_backend", "h2d_pageable", "d2h_pageable",
                 "device_clone", "disk_write", "disk_write_fsync", "disk_read"):
        assert links[name]["available"] and links[name]["gbps"] > 0, name
        assert links[name]["min_ms"] <= links[name]["median_ms"] <= links[name]["max_ms"], name
    assert links["p2p_whole"]["backend"] == "gloo" and links["p2p_layer"]["pattern"].startswith("4 x")
    assert links["socket"]["bytes_ok"] and links["grpc"]["bytes_ok"]
    for name in ("peer_copy", "h2d_pinned", "d2h_pinned"):
        assert not links[name]["available"] and links[name]["skip_reason"], name


def test_link_files(link_run):
    result, out = link_run
    assert json.load(open(out / "result.json"))["links"].keys() == result["links"].keys()
    png = (out / "links.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24])[0] > 100
    assert "![Raw link speeds](links.png)" in (out / "report.md").read_text()


def test_size_parser():
    assert size("64MiB") == 64 << 20 and size("1.75GiB") == int(1.75 * 2**30) and size("500MB") == 500 * 10**6
    assert size("4096") == 4096 and size("8k") == 8192
    with pytest.raises(ValueError):
        size("lots")


def test_backend_probe_entry(monkeypatch):
    """The transport's probe is called with the cache's geometry; its figures land under grpc_backend."""
    from bench.measure import grpc_probe
    calls = []

    def probe(bytes_total, channels, chunk_bytes, layers, repeats):
        calls.append((bytes_total, channels, chunk_bytes, layers, repeats))
        stats = {"median_ms": 4.0, "min_ms": 3.0, "max_ms": 5.0, "runs": repeats, "bytes_ok": True}
        return {"bytes": bytes_total, "channels": channels, "grpc": stats | {"gbps": 0.25},
                "socket": stats | {"gbps": 0.5}, "grpc_vs_socket": 0.5}

    monkeypatch.setattr(grpc_probe, "measure_loopback", probe)
    r = link.run_link(link.LinkConfig(bytes=1 << 20, layers=7, chunk_bytes=1 << 18, probes=("backend",)))
    assert r["ok"] and calls == [(1 << 20, 1, 1 << 18, 7, 5)]
    g = r["links"]["grpc_backend"]
    assert g["gbps"] == 0.25 and g["vs_socket"] == 0.5 and "50% of a TCP socket" in g["note"]
