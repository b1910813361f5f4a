"""A progress line on stderr while a replay runs.

On a terminal it redraws one line (carriage return) a few times a second; into a file or a
pipe (CI logs) it writes a plain line every few seconds instead, so logs stay readable."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(
        self,
        total: int,
        *,
        stream: TextIO | None = None,
        enabled: bool = True,
        interval_s: float | None = None,
    ) -> None:
        self.total = total
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval_s = interval_s if interval_s is not None else (0.2 if self.tty else 5.0)
        self.sent = self.done = self.failed = 0
        self._t0 = time.monotonic()
        self._last = 0.0

    def line(self) -> str:
        elapsed = time.monotonic() - self._t0
        width = 24
        filled = int(width * self.done / self.total) if self.total else width
        bar = "#" * filled + "." * (width - filled)
        return (
            f"[{bar}] {self.done}/{self.total} done, {self.sent - self.done} in flight, "
            f"{self.failed} failed, {elapsed:.0f}s"
        )

    def update(self, *, sent: int = 0, done: int = 0, failed: int = 0, force: bool = False) -> None:
        self.sent += sent
        self.done += done
        self.failed += failed
        now = time.monotonic()
        if not self.enabled or (not force and now - self._last < self.interval_s):
            return
        self._last = now
        if self.tty:
            self.stream.write("\r" + self.line() + "\x1b[K")
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        self.update(force=True)
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
