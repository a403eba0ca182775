"""Config dataclass <-> argparse: one flag per field, so CLI flags map 1:1 to config fields.

Why the help lives on the field: `flag(default, "what it does")` is the field's own
documentation and its `--help` line (with the default), in one place. Why one-line errors:
a bad value exits 2 with one line naming the flag, not a usage block of 60 flags or a
traceback. Why the redaction: configs are logged as one line at start, and a shared secret
must never reach a log file.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import MISSING, asdict, field, fields

SECRET_SUFFIX = "auth_token"  # fields holding a secret value (not its file name)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def flag(default, help: str, choices: tuple | None = None, hidden: bool = False):
    """A config field with its --help text (and, optionally, the values it accepts). `hidden`: a flag for tests
    (fault injection) that works as any other but is left out of --help, which is for users."""
    meta = {"help": help, "hidden": hidden}
    if choices is not None:
        meta["choices"] = tuple(choices)
    return field(default=default, metadata=meta)


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default in --help (a client's: the servers show every default), except where there is none to say (None, an empty string, an option that is
    off) or its help already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or action.default is False or action.default == "" or "default" in text:
            return text
        return super()._get_help_string(action)


class ServerHelp(argparse.ArgumentDefaultsHelpFormatter):
    """The servers' --help: every flag's default, except an empty string (nothing to show: "(default: )") and where
    the help says what its default means itself."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default == "" or "(default" in text:
            return text
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse with defaults in --help, errors as one line (`prog: error: ... (see --help)`), no abbreviations."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", ServerHelp)
        kwargs.setdefault("allow_abbrev", False)  # `--lis` is not --listen: a launcher refusing --listen sees it all
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {' '.join(message.split())} (see --help)\n")
        sys.exit(2)


def add_arguments(parser: argparse.ArgumentParser, cls) -> None:
    """One flag per dataclass field: --field-name, typed by the default, documented by the field's help."""
    for f in fields(cls):
        help_text = f.metadata.get("help")
        if not help_text:
            raise TypeError(f"{cls.__name__}.{f.name} has no help: declare it with flag(default, help)")
        default = f.default if f.default is not MISSING else f.default_factory()
        if f.metadata.get("hidden"):
            help_text = argparse.SUPPRESS
        if isinstance(default, bool) or (default is None and "bool" in str(f.type)):  # None: auto, unless given
            parser.add_argument(flag_name(f.name), action=argparse.BooleanOptionalAction, default=default,
                                help=help_text)
        else:
            parser.add_argument(flag_name(f.name), type=type(default), default=default, help=help_text,
                                choices=f.metadata.get("choices"))


def check_choices(config) -> None:
    """Refuse a value outside a field's declared choices (for configs built without argparse too)."""
    for f in fields(config):
        allowed = f.metadata.get("choices")
        if allowed is not None and getattr(config, f.name) not in allowed:
            raise ValueError(f"{flag_name(f.name)} {getattr(config, f.name)!r}: choose one of {', '.join(allowed)}")


def from_args(cls, argv: list[str] | None, description: str, prog: str | None = None):
    parser = Parser(prog=prog, description=description)
    add_arguments(parser, cls)
    ns = parser.parse_args(argv)
    try:
        return cls(**vars(ns))
    except ValueError as e:
        parser.error(str(e))


def one_line(config) -> str:
    """`field=value ...` for the start-up log, secrets shown only as set or not."""
    return " ".join(f"{k}={'<set>' if k.endswith(SECRET_SUFFIX) and v else v}" for k, v in asdict(config).items())
