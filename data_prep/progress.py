"""The progress of a long step on stderr (Progress): a line every second on a terminal, every 30 s in a
log, or at the interval DATA_PREP_PROGRESS gives (off: none)."""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

from mpt.errors import UserError

PROGRESS_ENV = "DATA_PREP_PROGRESS"  # seconds between progress lines, or "off"
_EVERY_TTY, _EVERY_LOG = 1.0, 30.0


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"



def _amount(x: float, unit: str) -> str:
    if unit == "bytes":  # a stream read from an archive: its position, in decimal units as `ls -h --si`
        for div, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
            if x >= div:
                return f"{x / div:.1f} {name}"
        return f"{x:.0f} B"
    return f"{x:,.0f}"



class Progress:
    """The progress of one long step of a prep, on stderr (the prep's own lines stay on stdout): count /
    total, rate, elapsed and ~left. A terminal sees one line redrawn in place at most every second; a log
    file or a pipe gets a whole line every 30 s and no carriage return. A step done before its first
    interval -- every tiny set -- prints nothing. DATA_PREP_PROGRESS=SECONDS sets the interval (both
    cases), =off silences it. Our own rather than tqdm (which the training loop uses): tqdm redraws with
    carriage returns in a log file too, or (disable=None) prints nothing there, where a multi-hour prep
    run under nohup or a scheduler most needs its lines.

    Use as a context manager; `add(n)` counts work done, `set(x)` gives the position reached (the bytes
    of an archive read so far). Thread-safe."""

    def __init__(self, what: str, total: float | None = None, unit: str = "", stream=None):
        self.what, self.total, self.unit = what, total, unit
        self.stream = sys.stderr if stream is None else stream
        try:
            self.tty = self.stream.isatty()
        except (AttributeError, ValueError, OSError):
            self.tty = False
        self.every = progress_interval(self.tty)
        self.done, self.printed, self.shown = 0, False, None
        self.t0 = self.last = time.monotonic()
        self.lock = threading.Lock()

    def add(self, n: float = 1) -> None:
        self.set(self.done + n)

    def set(self, done: float) -> None:
        with self.lock:
            self.done = done
            if self.every is not None:
                now = time.monotonic()
                if now - self.last >= self.every:
                    self.last = now
                    self._write(self.line(now), final=False)

    def line(self, now: float | None = None) -> str:
        elapsed = (time.monotonic() if now is None else now) - self.t0
        unit = f" {self.unit}" if self.unit and self.unit != "bytes" else ""
        parts = [f"{self.what}: {_amount(self.done, self.unit)}"
                 + (f"/{_amount(self.total, self.unit)}{unit} ({100 * self.done / self.total:.0f}%)" if self.total
                    else unit)]
        if elapsed > 0:
            rate = self.done / elapsed
            parts.append(f"{_amount(rate, self.unit)}/s" if self.unit == "bytes"
                         else f"{rate:,.1f}{unit}/s" if rate < 10 else f"{rate:,.0f}{unit}/s")
        parts.append(f"{_duration(elapsed)} elapsed")
        if self.total and 0 < self.done < self.total and elapsed > 0:
            parts.append(f"~{_duration((self.total - self.done) * elapsed / self.done)} left")
        return ", ".join(parts)

    def _write(self, text: str, final: bool) -> None:
        with contextlib.suppress(OSError, ValueError):  # stderr was a closed terminal (SIGHUP): go on silently
            if self.tty:
                # carriage return, the text, then clear to the end of the line (a shorter line leaves no tail)
                self.stream.write(f"\r{text}\x1b[K" + ("\n" if final else ""))
            else:
                self.stream.write(text + "\n")
            self.stream.flush()
        self.printed, self.shown = True, self.done

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, kind, value, tb) -> None:
        """A step that printed progress ends with its final count; one stopped by an error or a signal
        only ends a redrawn line, so that the one-line error starts on a line of its own."""
        with self.lock:
            if not self.printed:
                return
            if kind is None and (self.tty or self.done != self.shown):
                self._write(self.line(), final=True)
            elif self.tty:
                with contextlib.suppress(OSError, ValueError):
                    self.stream.write("\n")
                    self.stream.flush()



def progress_interval(tty: bool) -> float | None:
    """Seconds between progress lines (None: none): DATA_PREP_PROGRESS (off or 0: none), else 1 s on a
    terminal, 30 s otherwise; a bad value is a one-line error naming the variable."""
    raw = os.environ.get(PROGRESS_ENV, "").strip()
    if not raw:
        return _EVERY_TTY if tty else _EVERY_LOG
    if raw.lower() == "off":
        return None
    try:
        every = float(raw)
        if not 0 <= every < float("inf"):
            raise ValueError
    except ValueError:
        raise UserError(f"{PROGRESS_ENV}={raw!r} is not a number of seconds; set it to e.g. 10, or to off "
                        f"(or 0) to silence the progress lines") from None
    return every or None
