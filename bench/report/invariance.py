"""The `invariance` result (bench/runs/invariance.py): the same prompts served in two orders, compared, as a table.

Why this table: the question is whether a request's answer depends on its neighbours, so each kind of request
(seeded, greedy) gets one row saying how many gave the same tokens and the same logits digests in both passes.
"""

from __future__ import annotations

from bench.report.table import Table, num


def tables(result: dict) -> list[Table]:
    cfg = result["config"]
    t = Table(f"Neighbour invariance -- {cfg['addr']}, {cfg['num_prompts']} prompts of {cfg['input_len']} "
              f"(range {cfg['input_len_range']}), output {cfg['output_len']}, concurrency {cfg['concurrency']}, "
              "served twice in two orders",
              ["requests", "compared", "same tokens", "same logits digests", "first differing token (median)"])
    for kind, k in result["kinds"].items():
        t.rows.append([f"{kind} ({k['requests']})", str(k["compared"]), f"{k['tokens_equal']} of {k['compared']}",
                       f"{k['digests_equal']} of {k['compared']}", num(k["first_difference_median"])])
    for i, p in enumerate(result["passes"], 1):
        t.notes.append(f"pass {i}: {p['output_tokens']} tokens in {p['seconds']:.1f} s "
                       f"({num(p['output_tok_s'])} tok/s), {p['reused_tokens']} prompt tokens from the prefix cache")
    t.notes += [f"FAILED: {f}" for f in result["failures"]]
    return [t]
