"""`kvtransfer-bench invariance` against real colocated decode servers (tiny preset, CPU; issue #40).

What is claimed (and tested here): the same prompts, served twice in two orders (so every request rides beside other
neighbours), give the same tokens and logits digests on a `--batch-invariant` server, greedy and seeded alike, and
the report counts them; on a server without the mode the same load changes digests (the control: the count is not
a constant). The second pass runs in another order than the first.
"""

from __future__ import annotations

import json

import pytest

from bench.cli import main
from bench.runs.invariance import compare
from support.servers import colocated_server

LOAD = ["--model", "tiny", "--num-prompts", "24", "--concurrency", "8", "--input-len", "60", "--output-len", "8",
        "--seeded", "4"]
ROWS = ["--max-batch", "16", "--mixed-prefill", "--prefill-chunk", "32"]


def run_cli(argv, capsys) -> dict:
    rc = main(argv)
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and r["ok"], r["failures"]
    return r


@pytest.mark.parametrize("invariant", [True, False], ids=["mode", "control"])
def test_two_orders_agree_in_the_mode_and_not_without_it(tmp_path, capsys, invariant):
    args = [*ROWS, *(["--batch-invariant"] if invariant else [])]
    with colocated_server(tmp_path / "server", args=args) as run:
        r = run_cli(["invariance", "--addr", run.addr, *LOAD, "--out", str(tmp_path / "out")], capsys)
    assert json.loads((tmp_path / "out" / "result.json").read_text())["kinds"] == r["kinds"]
    seeded, greedy = r["kinds"]["seeded"], r["kinds"]["greedy"]
    assert (seeded["compared"], greedy["compared"]) == (4, 20)
    assert r["second_order_head"] != list(range(16))
    assert all(p["output_tokens"] == 24 * 8 for p in r["passes"])
    if invariant:
        assert seeded["tokens_equal"] == seeded["digests_equal"] == 4
        assert greedy["tokens_equal"] == greedy["digests_equal"] == 20
    else:
        assert seeded["digests_equal"] + greedy["digests_equal"] < 24


def test_compare_finds_the_first_differing_token():
    a = {"tokens": [1, 2, 3], "digests": ["x", "y", "z"]}
    assert compare(a, a) == {"tokens_equal": True, "digests_equal": True, "first_difference": None}
    assert compare(a, {"tokens": [1, 5, 3], "digests": ["x", "y", "z"]})["first_difference"] == 1
    assert compare(a, {"tokens": [1, 2], "digests": ["x", "y"]})["first_difference"] == 2
    assert not compare(a, {"tokens": [1, 2, 3], "digests": ["x", "y", "q"]})["digests_equal"]
