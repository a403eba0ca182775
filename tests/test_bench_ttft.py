"""`kvtransfer-bench ttft` smoke test: real servers on CPU, JSON fields, verified equality."""

from __future__ import annotations

import json
import os

from support.harness import forked_pairs


def test_ttft_cli_json(tmp_path, capsys):
    """The CLI in this process (its servers and its p2p pair are still real processes, the pair forked:
    support.harness.forked_pairs; `python -m bench.cli ttft` itself runs in tests/test_stacks.py): interpreter
    starts less on a CI core."""
    from bench import cli

    with forked_pairs():  # its raw-link probe's two processes
        code = cli.main(["ttft", "--lengths", "8,40", "--runs", "2", "--warmup", "1", "--decode-tokens", "3",
                         "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, out[-3000:] + err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["kind"] == "ttft" and result["ok"] and result["verified"]
    assert {(r["length"], r["mode"]) for r in result["rows"]} == {(8, "layerwise"), (8, "bulk"), (40, "layerwise"),
                                                                  (40, "bulk")}
    for r in result["rows"]:
        assert r["cache_equal"] and r["tokens_equal"] and r["logits_equal"]
        assert r["ttft_disagg"]["n"] == 2 and r["ttft_colo"]["median_ms"] > 0
        assert abs(r["overhead_ms"] - (r["ttft_disagg"]["median_ms"] - r["ttft_colo"]["median_ms"])) < 1e-9
        assert "second_token_disagg" in r and "prefill_slowdown_pct" in r
    assert result["links"]["p2p whole cache"]["gbps"] > 0
    assert os.path.exists(tmp_path / "result.json") and os.path.exists(tmp_path / "report.md")


def test_ttft_fails_when_the_server_returns_no_digests(monkeypatch, capsys):
    """A verification with nothing to compare is a failure: servers that return empty digests (and the same
    tokens) make `kvtransfer-bench ttft` exit non-zero, naming the checks that failed."""
    import contextlib
    import types

    from bench import cli
    from bench.runs import ttft

    @contextlib.contextmanager
    def fake_server(*args, **kwargs):
        yield types.SimpleNamespace(addr="unused")

    async def no_digests(addr, ids, n, mode="auto", digest=False, timeout=120.0, cache_digest=False, **kw):
        timing = {"first_token_ms": 1.0, "cache_ready_ms": 2.0, "prefill_ms": 1.0, "second_token_ms": 3.0}
        return {"tokens": list(range(n)), "logits_digests": [""] * n if digest else [], "cache_digest": "",
                "timing": timing}

    monkeypatch.setattr(ttft, "colocated_server", fake_server)
    monkeypatch.setattr(ttft, "server_pair", fake_server)
    monkeypatch.setattr(ttft, "generate", no_digests)
    monkeypatch.setattr(ttft, "raw_links", lambda cfg, geom: {})
    code = cli.main(["ttft", "--lengths", "8", "--runs", "1", "--warmup", "0", "--decode-tokens", "3"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code != 0 and not result["ok"]
    assert {"8/layerwise: cache_equal", "8/layerwise: logits_equal"} <= set(result["failures"])
    assert "8/bulk: tokens_equal" not in result["failures"]  # the tokens did match


def test_compare_counts_every_check():
    from bench.runs.ttft import compare
    good = {"cache_digest": "c", "logits_digests": ["a", "b"], "tokens": [1, 2]}
    assert all(compare(good, dict(good), 2).values())
    assert not compare(dict(good, tokens=[1]), dict(good, tokens=[1]), 2)["tokens_equal"]  # fewer than asked
    assert not compare(dict(good, logits_digests=["a", ""]), good, 2)["logits_equal"]
