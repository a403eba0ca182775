"""bench/probes/gemm_rows.py's logic on CPU: which row counts a larger one beats, and the row list it parses (the
timing itself needs CUDA and is refused elsewhere with the flag named)."""

from __future__ import annotations

import pytest

from bench.probes import gemm_rows


def test_a_row_count_slower_than_a_larger_one_is_listed_with_the_fastest_larger():
    times = {256: 100.0, 384: 150.0, 448: 400.0, 512: 180.0, 576: 390.0, 640: 230.0, 768: 170.0, 1024: 360.0}
    bad = gemm_rows.slower_than_larger(times)
    assert [b["rows"] for b in bad] == [448, 512, 576, 640]
    assert bad[0] == {"rows": 448, "us": 400.0, "pad_to": 768, "pad_us": 170.0}  # the fastest larger, not the next
    assert [b["pad_to"] for b in bad[1:]] == [768, 768, 768]


def test_within_the_margin_is_not_listed():
    assert gemm_rows.slower_than_larger({16: 10.4, 32: 10.0}) == []  # 4% over: noise
    assert gemm_rows.slower_than_larger({16: 10.6, 32: 10.0})[0]["rows"] == 16
    assert gemm_rows.slower_than_larger({16: 1.0, 32: 2.0, 48: 3.0}) == []  # rising: nothing to gain


def test_rows_parse_ranges_and_lists():
    assert gemm_rows.parse_rows("16:64:16") == [16, 32, 48, 64]
    assert gemm_rows.parse_rows("512,448,512") == [448, 512]
    for bad in ("0,16", "16:64:0", ""):
        with pytest.raises(ValueError):
            gemm_rows.parse_rows(bad)


def test_off_cuda_it_is_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as e:
        gemm_rows.main(["--device", "cpu", "--rows", "16,32"])
    assert e.value.code == 2 and "--device cpu" in capsys.readouterr().err


def test_time_rows_times_one_replay_of_the_captured_calls_per_call():
    import contextlib

    import torch

    launched = []

    class Graph:
        def replay(self):
            launched.append("replay")

    def loop_us(fn, calls, reps):  # the timer: one replay a rep -> 120 us for the graph
        assert calls == 1
        fn()
        return 120.0

    x, w = torch.zeros(2, 3), torch.zeros(4, 3)
    us = gemm_rows.time_rows(lambda x, w: launched.append("gemm"), x, w, 8, 5, loop_us, graph=Graph,
                             capture=lambda g: contextlib.nullcontext())
    assert us == 120.0 / 8  # per GEMM, not per replay
    assert launched == ["gemm"] * 3 + ["gemm"] * 8 + ["replay"]  # 3 eager warm-ups, 8 captured, then the replay
