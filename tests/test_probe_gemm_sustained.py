"""bench/probes/gemm_sustained.py's summary on CPU: the burst is the first window, the sustained rate the median of
the second half (the hold itself needs CUDA and is refused elsewhere with the flag named)."""

from __future__ import annotations

import pytest

from bench.probes import gemm_sustained


def test_the_burst_is_the_first_window_and_sustained_the_second_halfs_median():
    s = gemm_sustained.summarize([780.0, 760.0, 700.0, 640.0, 600.0, 620.0, 610.0])
    assert s["burst_tflops"] == 780.0
    assert s["sustained_tflops"] == 615.0  # median of 640, 600, 620, 610: the first half's fall left out
    assert s["sustained_over_burst"] == pytest.approx(615.0 / 780.0)
    assert s["min_tflops"] == 600.0 and s["windows"] == 7
    assert gemm_sustained.summarize([500.0, 400.0])["sustained_tflops"] == 400.0
    with pytest.raises(ValueError):
        gemm_sustained.summarize([])


def test_off_cuda_it_is_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as e:
        gemm_sustained.main(["--device", "cpu", "--hold-s", "2"])
    assert e.value.code == 2 and "--device cpu" in capsys.readouterr().err


def test_a_window_longer_than_the_hold_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        gemm_sustained.main(["--hold-s", "1", "--window-s", "2"])
    assert e.value.code == 2 and "--window-s" in capsys.readouterr().err
