"""bench/measure/stats.py and bench/measure/twoproc.py: the figures every bench reports, and the two-process harness."""

from __future__ import annotations

import statistics

import pytest

from bench.measure.stats import median, percentile, spread_ms, summarize, timed
from bench.measure.twoproc import PairError, exit_now, run_pair


def test_summarize_matches_the_textbook_figures():
    xs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    s = summarize(xs, scale=2.0, percentiles=(10, 90, 99.5))
    dec = statistics.quantiles([2 * x for x in xs], n=10, method="inclusive")
    assert s["n"] == 8 and s["min"] == 2.0 and s["max"] == 18.0
    assert s["median"] == pytest.approx(2 * statistics.median(xs))
    assert s["mean"] == pytest.approx(2 * statistics.mean(xs))
    assert s["std"] == pytest.approx(2 * statistics.pstdev(xs))
    assert (s["p10"], s["p90"]) == pytest.approx((dec[0], dec[-1]))
    assert "p99.5" in s
    assert summarize([]) == {"n": 0, "mean": None, "median": None, "std": None, "min": None, "max": None,
                             "p10": None, "p90": None}
    assert median(x for x in (1.0, 3.0)) == 2.0 and median([]) is None
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9) and percentile([], 50) is None
    assert spread_ms([0.001, 0.003, 0.002]) == pytest.approx({"median_ms": 2.0, "min_ms": 1.0, "max_ms": 3.0})


def test_timed_skips_the_warmup_and_runs_the_hooks_untimed():
    calls = []
    secs = timed(lambda: calls.append("fn"), runs=3, warmup=2, before=lambda: calls.append("before"),
                 after=lambda: calls.append("after"))
    assert len(secs) == 3 and all(t >= 0 for t in secs)
    assert calls == ["before", "fn", "after"] * 5


def _target(rank: int, how: str):
    if how == "raise" and rank == 1:
        raise ValueError("receiver broke")
    if how == "exit" and rank == 1:
        exit_now(("died", rank))
    return rank * 10


def test_run_pair_returns_each_ranks_result():
    assert run_pair(_target, ("ok",), timeout=60) == [0, 10]
    assert run_pair(_target, ("exit",), timeout=60) == [0, ("died", 1)]


def test_run_pair_names_the_rank_that_failed():
    with pytest.raises(PairError, match=r"(?s)rank 1 \(receiver\) failed:.*receiver broke"):
        run_pair(_target, ("raise",), timeout=60, what="unit")
