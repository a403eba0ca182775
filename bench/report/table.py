"""One neutral Table, rendered two ways: rich on the terminal, Markdown in report.md.

Why one type: every bench result becomes `Table`s once (bench/report/<kind>.py), and the terminal
and bench/results/ show the same cells, so the two never disagree. `num`, `spread` and `yes` format
cells the same way for every kind.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.console import Console
from rich.markup import escape
from rich.table import Table as RichTable


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def num(x: float | None, unit: str = "") -> str:
    """Three significant-ish digits without scientific notation: 0.0123, 1.23, 123, 12345."""
    if x is None:
        return "-"
    digits = 0 if abs(x) >= 100 else 1 if abs(x) >= 10 else 2 if abs(x) >= 1 else 3 if abs(x) >= 0.01 else 5
    return f"{x:,.{digits}f}{unit}"


def spread(s: dict) -> str:
    """A stats dict as `median [min-max]` in ms."""
    return f"{num(s['median_ms'])} [{num(s['min_ms'])}-{num(s['max_ms'])}]"


def yes(b: bool) -> str:
    return "yes" if b else "NO"


def print_tables(tables: list[Table], console: Console) -> None:
    for t in tables:
        rt = RichTable(title=escape(t.title), title_justify="left", caption_justify="left",
                       caption=escape("\n".join(t.notes)) or None)
        numeric = [bool(t.rows) and t.rows[0][i][:1].isdigit() for i in range(len(t.headers))]
        for h, right in zip(t.headers, numeric):
            rt.add_column(escape(h), justify="right" if right else "left")
        for row in t.rows:
            rt.add_row(*map(escape, row))
        console.print(rt)


def markdown(tables: list[Table], title: str, command: str | None = None,
             images: list[tuple[str, str]] = ()) -> str:
    """Tables as Markdown; `images` (title, relative path) are embedded after them."""
    lines = [f"# {title}", ""]
    if command:
        lines += ["Produced by:", "", "```", command, "```", ""]
    for t in tables:
        lines += [f"## {t.title}", "", "| " + " | ".join(t.headers) + " |",
                  "| " + " | ".join("---" for _ in t.headers) + " |"]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in t.rows]
        lines += [""] + [f"{n}  " for n in t.notes] + [""]
    for alt, path in images:
        lines += [f"## {alt}", "", f"![{alt}]({path})", ""]
    return "\n".join(lines)

