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
    """Decorate a command's main(): a UserError prints one line to stderr and exits with 2; a closed
    stdout (`... | head -1`) ends the command quietly (stdout_closed)."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            result = main(*args, **kwargs)
            sys.stdout.flush()  # a closed pipe fails here, not in the interpreter's flush at exit
            return result
        except UserError as e:
            print(f"error: {one_line(e, with_type=False)}", file=sys.stderr)
            raise SystemExit(2) from None
        except BrokenPipeError:
            if not stdout_closed():
                raise
            raise SystemExit(141) from None

    return wrapper


def stdout_closed() -> bool:
    """True when stdout is a pipe whose reader has gone (`| head -1`), after pointing stdout at
    /dev/null. Python ignores SIGPIPE, so such a command got BrokenPipeError and a traceback where a unix
    tool dies of the signal silently; this ends it the same way, with the status a shell gives a process
    killed by SIGPIPE (141). Its buffered output goes nowhere, so the interpreter's flush at exit does
    not fail again ("Exception ignored ... BrokenPipeError")."""
    import os
    import select

    try:
        fd = sys.stdout.fileno()
        poll = select.poll()
        poll.register(fd, select.POLLOUT)
        closed = any(ev & select.POLLERR for _, ev in poll.poll(0))  # a pipe without a reader
    except (AttributeError, OSError, ValueError):  # stdout replaced or closed: not a pipe to judge
        return False
    if closed:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    return closed
