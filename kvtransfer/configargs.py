"""Config dataclass <-> argparse: one flag per field, so CLI flags map 1:1 to config fields.

Why the redaction: configs are logged as one line at start, and a shared secret must
never reach a log file.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, fields

SECRET_SUFFIX = "auth_token"  # fields holding a secret value (not its file name)


def add_arguments(parser: argparse.ArgumentParser, cls) -> None:
    """One flag per dataclass field: --field-name, typed by the default."""
    for f in fields(cls):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default)


def from_args(cls, argv: list[str] | None, description: str):
    parser = argparse.ArgumentParser(description=description)
    add_arguments(parser, cls)
    ns = parser.parse_args(argv)
    try:
        return cls(**vars(ns))
    except ValueError as e:
        parser.error(str(e))


def one_line(config) -> str:
    """`field=value ...` for the start-up log, secrets shown only as set or not."""
    return " ".join(f"{k}={'<set>' if k.endswith(SECRET_SUFFIX) and v else v}" for k, v in asdict(config).items())
