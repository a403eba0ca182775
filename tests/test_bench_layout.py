"""bench/'s rooms import only downward, read from the source (imports inside functions included): cli.py ->
runs/ -> report/ and measure/; probes/ stand apart; and every subcommand is registered the one way."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# room -> the bench rooms it may import (a room always imports itself; bench.common sits below every run)
MAY_IMPORT = {"cli": {"runs", "report", "common"}, "runs": {"report", "measure", "common"},
              "report": set(), "measure": set(), "common": set(), "probes": {"measure"}}


def room(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "bench"


def bench_imports() -> dict[str, set[str]]:
    """bench module -> the bench modules it imports, anywhere in its file."""
    out = {}
    for path in (ROOT / "bench").rglob("*.py"):
        if {"results", "runbooks"} & set(path.parts):
            continue
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        out[name] = {m for m in found if m.startswith("bench.")}
    return out


def test_rooms_import_only_downward():
    bad = [f"{m} -> {t}" for m, targets in sorted(bench_imports().items()) for t in sorted(targets)
           if room(t) != room(m) and room(t) in MAY_IMPORT and room(t) not in MAY_IMPORT.get(room(m), set())]
    assert bad == []


def test_every_subcommand_is_registered_the_one_way():
    from bench.cli import SUBCOMMANDS, build_parser
    for name, run in SUBCOMMANDS.items():
        assert run.__name__ == f"bench.runs.{name}", name
        assert isinstance(run.HELP, str) and callable(run.add_arguments) and callable(run.job), name
    assert set(build_parser()._subparsers._group_actions[0].choices) == set(SUBCOMMANDS)
