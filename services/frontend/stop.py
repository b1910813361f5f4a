"""Stop strings applied to streamed text.

``StopMatcher(stops)`` watches the detokenized output of one request::

    m = StopMatcher(req.stop_strings)
    for delta in text_deltas:
        out, hit = m.push(delta)
        send(out)
        if hit:
            cancel the task; finish_reason = "stop"; break
    else:
        send(m.flush())

The stop string itself is never emitted. Text that could still turn out to be the start of
a stop string is held back until the next delta decides it, so a stop split across deltas
(or across tokens) is still caught and nothing before it is lost.

The response ends at the stop occurrence that *completes* first in the text, ties going to
the one that starts first; this is what a streaming check sees and does not depend on how
the text was split into deltas.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Stop-string matching for one response. ``hit`` is the stop string that ended it
    (None until one does); ``stopped`` says whether one has."""

    __slots__ = ("_buf", "_max_hold", "_stops", "hit")

    def __init__(self, stops: Sequence[str]) -> None:
        # An empty stop string would match before the first character; it means nothing.
        self._stops = tuple(s for s in stops if s)
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._buf = ""
        self.hit: str | None = None

    @property
    def stopped(self) -> bool:
        return self.hit is not None

    def push(self, text_delta: str) -> tuple[str, bool]:
        """Add new text; returns (text safe to emit now, whether a stop string was hit).
        After a hit, every further call returns ("", True)."""
        if self.hit is not None:
            return "", True
        if not self._stops:
            return text_delta, False
        buf = self._buf + text_delta
        best: tuple[int, int, str] | None = None
        for s in self._stops:
            i = buf.find(s)
            if i >= 0:
                key = (i + len(s), i, s)
                if best is None or key < best:
                    best = key
        if best is not None:
            _, start, s = best
            self.hit = s
            self._buf = ""
            return buf[:start], True
        hold = self._held_suffix(buf)
        self._buf = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """The held-back text, at the end of a response that hit no stop string."""
        out, self._buf = self._buf, ""
        return "" if self.hit is not None else out

    def _held_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop string;
        the longest one starts earliest, so it covers every possible partial match."""
        for k in range(min(len(buf), self._max_hold), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
