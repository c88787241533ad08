"""User mistakes become one-line errors, never tracebacks (README: "Bad input")."""
from __future__ import annotations

import functools
import sys


class UserError(Exception):
    """A mistake the user can fix: the message names the thing and the fix."""


def cli(main):
    """Decorate a command's main(): a UserError prints one line to stderr and exits with 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as e:
            msg = str(e).strip()
            if "\n" in msg:  # raised in a DataLoader worker: torch prepends the worker's traceback
                msg = msg.splitlines()[-1].split("UserError: ", 1)[-1]
            print(f"error: {msg}", file=sys.stderr)
            raise SystemExit(2) from None

    return wrapper
