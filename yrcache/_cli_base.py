"""What every part of the ``yrcache`` command shares: its errors, exit codes,
argument parser and the escaping of keys for display."""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_PIPE = 1, 2, 130, 141


class CliError(Exception):
    """A failure to report as one line on stderr, with exit status ``code``."""

    def __init__(self, message: str, code: int = EXIT_FAILED):
        super().__init__(message)
        self.code = code


class Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit status 2) and epilogs printed as written."""

    def __init__(self, *args: Any, **kw: Any):
        kw.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kw)
        self.commands: dict[str, argparse.ArgumentParser] = {}   # subcommand parsers, by name

    def error(self, message: str) -> NoReturn:
        usage = " ".join(self.format_usage().split())        # "usage: yrcache get [-h] ..."
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} ({usage}; more: {self.prog} --help)\n")



def display_key(key: str) -> str:
    """``key`` safe to print in a table: control, other non-printable characters and
    backslashes as Python backslash escapes (``\\t``, ``\\x1b``, ``\\u200b``,
    ``\\\\``), printable unicode as is.  Distinct keys stay distinct, and no key
    can break a line or a column, or send terminal escape sequences."""
    if key.isprintable() and "\\" not in key:
        return key                       # the common case, unchanged
    return "".join(c if c.isprintable() and c != "\\" else repr(c)[1:-1] for c in key)
