"""The offload tiers and xPyD launcher half of the mutation pass whose benchmark-figures half is
tests/test_bench_stats_mutants.py (its docstring gives the pass's counts): bench/measure/tiers.py's pure parts (the
one-copy span, the copies, which cache a tier takes for the one it prepared for; nothing that needs a GPU) and
deploy/launch_xpyd.py (its ordered stop, its exit status, how it starts its children, its start-up wait). Each test
here failed on a one-line change that test_tiers.py, test_deploy_launch.py, test_newuser_router.py and
test_loopback.py let through; its docstring names the change it kills ("kills ..."), and each was seen failing with
that change planted and passing on the clean code. Of 16 changes (tiers.py 6, launch_xpyd.py 10), 4 were caught
before, 11 only here, and one is equivalent (the child environment merged the other way round: see the other file).

Why without processes: the launcher's real runs (a 1P1D launch stopped by SIGTERM, a 2P2D one on loopback) reach
only the happy path, where every child starts, serves and exits 0; a child killed while loading, a start-up
failure, a death while serving, the process group and the parent-death signal do not show there. Here the children
are stand-in processes that have already exited, Popen, prctl and the health check are recorders, and the clock is
a counter: nothing is started and nothing waits. The tiers' cases are byte checks on views of one small CPU tensor.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from bench.measure.tiers import MemoryTier, contiguous_span, copy_layers, flat_views
from deploy import launch_xpyd
from deploy.xpyd_plan import ROOT, Child

# --- the offload bench's tiers (bench/measure/tiers.py) ---


def _block() -> torch.Tensor:
    return torch.arange(64, dtype=torch.float32)


def test_a_span_starts_at_the_first_tensor_and_needs_no_gap():
    """kills contiguous_span starting its span at the storage's first byte instead of the first tensor's, and taking
    tensors of one storage with a gap between them for one span."""
    base = _block()
    span = contiguous_span([(base[4:12].view(2, 4), base[12:20].view(2, 4))])
    assert span is not None and torch.equal(span.view(torch.float32), base[4:20])
    assert contiguous_span([(base[0:8], base[8:16]), (base[24:32], base[32:40])]) is None


def test_a_span_is_copied_once_not_again_per_tensor():
    """kills copy_layers copying a source that is one span, then each tensor again (an offload timed at twice its
    copies). The per-tensor views here are over a second buffer, which a span's copy must leave as it was."""
    base = _block()
    layers = [(base[0:8], base[8:16])]
    dst, other = torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    copy_layers(dst, flat_views(other, layers), layers, contiguous_span(layers), non_blocking=False)
    assert torch.equal(dst.view(torch.float32), base[:16]) and not other.any()


def test_a_cache_sharing_one_tensor_with_the_prepared_one_is_copied_as_itself():
    """kills Tier taking a cache for the one it prepared for when any one tensor is the same (`any` for `all`): it
    copied the prepared cache's span instead. Both caches are (K, V) views of one block each; they share K."""
    a, b = _block(), -_block()
    k0 = a[0:8]
    prepared = [(k0, a[8:16]), (a[16:24], a[24:32])]
    other = [(k0, b[8:16]), (b[16:24], b[24:32])]
    tier = MemoryTier("pageable", "cpu")
    tier.prepare(prepared)
    try:
        tier.offload(other)
        back = tier.reload()
        assert all(torch.equal(x, y) for kv, kv2 in zip(back, other) for x, y in zip(kv, kv2))
    finally:
        tier.close()


# --- the xPyD launcher (deploy/launch_xpyd.py): its stop, its exit status, how it starts the children ---


class _Proc:
    """A child process that has already exited with `code`."""

    def __init__(self, code: int | None, pid: int = 4242):
        self.returncode, self.pid = code, pid

    def poll(self):
        return self.returncode

    def terminate(self):
        pass


def _children(codes: dict[str, int | None]) -> list[Child]:
    role = lambda name: name.split("-")[0]  # noqa: E731
    return [Child(name, role(name), "m", [], f"127.0.0.1:{9000 + i}", proc=_Proc(code))
            for i, (name, code) in enumerate(codes.items())]


def _launcher(codes: dict[str, int | None], tmp_path) -> launch_xpyd.Launcher:
    ns = SimpleNamespace(stop_grace_s=1.0, start_timeout_s=1.0, transport="grpc", model="tiny", check_tls_ca=None)
    return launch_xpyd.Launcher(_children(codes), ns, str(tmp_path))


def test_a_child_stopped_by_sigterm_before_its_handler_is_a_clean_stop(tmp_path, capsys):
    """kills stop() counting -SIGTERM (a child stopped while still loading, before it set its handler) as unclean:
    a stop requested during a model load then exits 1."""
    assert _launcher({"prefill-0": -signal.SIGTERM, "decode-0": 0, "router": 0}, tmp_path).stop()
    assert not _launcher({"prefill-0": 1, "decode-0": 0, "router": 0}, tmp_path).stop()
    out = capsys.readouterr().out
    assert out.index("stopped router") < out.index("stopped decode-0") < out.index("stopped prefill-0")


def test_a_start_up_failure_or_a_death_exits_1_however_cleanly_the_rest_stop(tmp_path, monkeypatch, capsys):
    """kills run() exiting 0 when a child died during start-up (or did not start in time) and the rest stopped
    cleanly (`clean` alone, not `requested and clean`), and 0 when a child died while serving."""
    monkeypatch.setattr(launch_xpyd.signal, "signal", lambda *a: None)  # the test process keeps its handlers
    launcher = _launcher({"prefill-0": None, "decode-0": None, "router": None}, tmp_path)
    launcher.spawn, launcher.stop = (lambda: None), (lambda: True)
    launcher.wait_serving = lambda: "decode-0 (pid 1) exited 1 during start-up"
    assert launcher.run() == 1
    launcher.wait_serving = lambda: None
    launcher.children[1].proc.returncode = 1  # decode-0 dies once serving
    assert launcher.run() == 1
    assert "decode-0 (pid 4242) exited 1 unexpectedly" in capsys.readouterr().err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_children_get_sigterm_when_the_launcher_dies(monkeypatch):
    """kills _pdeathsig calling prctl with an option other than PR_SET_PDEATHSIG (1)."""
    calls = []
    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **kw: SimpleNamespace(prctl=lambda *args: calls.append(args)))
    launch_xpyd._pdeathsig()()
    assert calls == [(1, int(signal.SIGTERM))]


def test_each_child_starts_in_its_own_process_group_from_the_repository(tmp_path, monkeypatch):
    """kills spawn() leaving the children in the launcher's process group (a terminal's Ctrl-C would reach them
    all at once, not in the launcher's order)."""
    started = []
    monkeypatch.setattr(launch_xpyd.subprocess, "Popen", lambda argv, **kw: started.append((argv, kw)) or _Proc(None))
    launcher = _launcher({"prefill-0": None, "router": None}, tmp_path)
    launcher.children[0].env = {"NCCL_NVLS_ENABLE": "0"}
    launcher.spawn()
    assert [argv[-1] for argv, _ in started] == ["m", "m"]
    for argv, kw in started:
        assert kw["process_group"] == 0 and kw["cwd"] == ROOT and kw["stdin"] == subprocess.DEVNULL
        assert kw["env"]["PYTHONPATH"].split(":")[0] == ROOT and kw["env"]["PYTHONUNBUFFERED"] == "1"
    assert started[0][1]["env"]["NCCL_NVLS_ENABLE"] == "0"


def test_two_workers_on_one_gpu_are_told_to_share_it(tmp_path, monkeypatch, capsys):
    """kills main() noting a shared GPU only from three workers on it (`> 2` for `> 1`)."""
    monkeypatch.setattr(launch_xpyd, "Launcher", lambda children, ns, log_dir: SimpleNamespace(run=lambda: 0))
    assert launch_xpyd.main(["--prefill", "1", "--decode", "1", "--transport", "grpc", "--device-prefill", "cuda:0",
                             "--device-decode", "cuda:0", "--log-dir", str(tmp_path)]) == 0
    assert "note: 2 workers share cuda:0" in capsys.readouterr().out


def test_start_up_waits_for_the_start_timeout(tmp_path, monkeypatch):
    """kills wait_serving() giving up after --stop-grace-s instead of --start-timeout-s (a model that loads for
    longer than the stop grace reported as not starting). The clock is a stand-in, 1 s a read; no child answers."""
    import grpc
    from grpc_health.v1 import health_pb2_grpc

    checks, now = [], iter(range(1000))

    def check(request, timeout):
        checks.append(request)
        raise grpc.RpcError()
    monkeypatch.setattr(launch_xpyd, "time", SimpleNamespace(monotonic=lambda: float(next(now)), sleep=lambda s: None))
    monkeypatch.setattr(grpc, "insecure_channel", lambda addr: SimpleNamespace(close=lambda: None))
    monkeypatch.setattr(health_pb2_grpc, "HealthStub", lambda channel: SimpleNamespace(Check=check))
    launcher = _launcher({"decode-0": None}, tmp_path)
    launcher.ns.start_timeout_s = 10.0
    assert launcher.wait_serving().startswith("not serving after --start-timeout-s 10: decode-0")
    assert len(checks) == 10  # read at 1, 2, .. 10 s; at 11 s it is past the deadline of 0 + 10
