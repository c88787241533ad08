"""User mistakes become one-line errors, never tracebacks (README: "Bad input")."""
from __future__ import annotations

import functools
import re
import sys


class UserError(Exception):
    """A mistake the user can fix: the message names the thing and the fix."""


_LAST = re.compile(r"^([A-Za-z_][\w.]*): (.*)$")


def one_line(e: BaseException, with_type: bool = True) -> str:
    """An exception as one line: "Type: message". An error raised in a DataLoader worker arrives
    with the worker's traceback prepended to its message; its last line is the cause."""
    msg = str(e).strip()
    name = type(e).__name__
    if "\n" in msg:
        last = [ln for ln in msg.splitlines() if ln.strip()][-1].strip()
        m = _LAST.match(last)
        if m:  # "mpt.errors.UserError: ..." -> UserError, the message
            name, msg = m.group(1).rsplit(".", 1)[-1], m.group(2)
        else:
            msg = last
    return f"{name}: {msg}" if with_type else msg


def cli(main):
    """Decorate a command's main(): a UserError prints one line to stderr and exits with 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as e:
            print(f"error: {one_line(e, with_type=False)}", file=sys.stderr)
            raise SystemExit(2) from None

    return wrapper
