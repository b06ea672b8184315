"""One line of progress on a terminal for command-line operations that take a while.

The line is drawn on ``stderr`` only when that stream is a terminal, only once the operation has
lasted ``delay_s`` (1 s by default, ``ZEROSTALL_PROGRESS_DELAY_S`` overrides it), redrawn in place
a few times a second by a daemon thread, and erased when the operation ends, so that the result
the command prints afterwards stands alone. Output that is piped or captured never sees it; the
CLI also turns it off under ``--json``.

A :class:`Progress` is a callable ``(phase, done, total)``, the progress callback of
:func:`zerostall.interop.export_checkpoint` and :func:`~zerostall.interop.import_checkpoint`; an
operation that reports nothing (``verify``) shows its label and the time elapsed.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from types import TracebackType
from typing import TextIO

from zerostall import envvars

__all__ = ["Progress"]

_SPIN = "|/-\\"


class Progress:
    """A progress line for one operation, used as a context manager.

    Args:
        label: what is being done (``"export model.safetensors"``), shown first.
        stream: where to draw (default ``sys.stderr``).
        enabled: ``None`` (default): draw only if ``stream`` is a terminal. ``False``: never draw.
        delay_s: draw only once the operation has lasted this long (default 1 s, or the
            ``ZEROSTALL_PROGRESS_DELAY_S`` environment variable). 0 draws at once.
        interval_s: how often the line is redrawn.

    Example::

        >>> with Progress("export out.safetensors") as p:      # doctest: +SKIP
        ...     export_checkpoint("/ckpt/a", "out.safetensors", progress=p)
    """

    def __init__(self, label: str, *, stream: TextIO | None = None, enabled: bool | None = None,
                 delay_s: float | None = None, interval_s: float = 0.2) -> None:
        self.label = "".join(c if c.isprintable() else "?" for c in label)  # a path may hold escapes
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self.delay_s = delay_s if delay_s is not None else _env_delay()
        self.interval_s = interval_s
        self.phase = ""
        self.done = 0
        self.total = 0
        self._start = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._drawn = 0  # width of the line on screen; 0: nothing to erase
        self._ticks = 0

    def __call__(self, phase: str, done: int, total: int) -> None:
        """Record how far the operation is; cheap, called from the working thread."""
        self.phase, self.done, self.total = phase, done, total

    def __enter__(self) -> Progress:
        self._start = time.monotonic()
        if self.enabled:
            if self.delay_s <= 0:
                self._draw()
            self._thread = threading.Thread(target=self._run, name="zerostall-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Stop redrawing and erase the line (if one was drawn)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            if self._drawn:
                self._write("\r" + " " * self._drawn + "\r")
                self._drawn = 0

    def _run(self) -> None:
        if self._stop.wait(max(0.0, self.delay_s)):
            return
        while True:
            self._draw()
            if self._stop.wait(self.interval_s):
                return

    def line(self) -> str:
        """The text drawn now: label, phase, bytes done of total, percentage, seconds elapsed."""
        elapsed = time.monotonic() - self._start
        parts = [self.label]
        if self.phase:
            parts.append(self.phase)
        if self.total > 0:
            done = min(self.done, self.total)
            parts.append(f"{done / 2**20:.1f}/{self.total / 2**20:.1f} MiB ({100 * done // self.total}%)")
        else:
            parts.append(_SPIN[self._ticks % len(_SPIN)])
        parts.append(f"{elapsed:.0f} s")
        return "  ".join(parts)

    def _draw(self) -> None:
        with self._lock:
            if self._stop.is_set() and self._thread is None:
                return
            self._ticks += 1
            text = self.line()[: max(10, _columns(self.stream) - 1)]  # never wrap: \r must reach the start
            pad = " " * max(0, self._drawn - len(text))
            self._write("\r" + text + pad)
            self._drawn = max(self._drawn, len(text))

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # the terminal went away: progress is not worth failing for
            self.enabled = False


def _env_delay() -> float:
    try:
        return float(envvars.get(envvars.PROGRESS_DELAY_S, "1") or "1")
    except ValueError:
        return 1.0


def _columns(stream: TextIO) -> int:
    try:
        cols = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 80
    return cols if cols > 0 else 80  # a terminal whose size was never set reports 0
