"""The one place a frontend learns that a member its requests depend on is gone.

Every attempt of a request depends on one member at a time: the job executor placing it
(from the moment it took the job, through any wait for a scale-up), then the task executor
streaming its tokens. Attempts register
here; when a member is declared gone, every attempt that depends on it hears it at once,
from one event, and moves on (resubmitted elsewhere), instead of each request polling for
its own peer.

Two signals declare a member gone:
- the cluster manager's ``MemberDown`` notice (its liveness deadline expired, or the member
  left): the prompt path, within one liveness deadline of the member's last heartbeat;
- the member's absence from the pushed cluster view for longer than ``grace_s``: the
  backstop for a notice that was lost. The grace keeps a view that is briefly incomplete
  (a cluster manager that has just restarted and not yet heard every heartbeat) from
  reading as the death of every member.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from shared.logging import get_logger
from shared.messages.cluster import ClusterView, MemberDown

log = get_logger(__name__)

OnLost = Callable[[str], None]


class Watch:
    """One attempt's dependency on one member; ``cancel`` when it no longer depends on it."""

    def __init__(self, registry: Liveness, member: str, on_lost: OnLost) -> None:
        self._registry, self.member, self.on_lost = registry, member, on_lost

    def cancel(self) -> None:
        self._registry._unwatch(self)


class Liveness:
    def __init__(self, *, grace_s: float) -> None:
        self._grace = grace_s
        self._watches: dict[str, set[Watch]] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._present: set[str] | None = None  # members of the newest view (None: no view yet)

    def watch(self, member: str, on_lost: OnLost) -> Watch:
        """Call ``on_lost(member)`` once the member is declared gone. A member already absent
        from the view starts its grace now."""
        w = Watch(self, member, on_lost)
        self._watches.setdefault(member, set()).add(w)
        if self._present is not None and member not in self._present:
            self._start_grace(member)
        return w

    def _unwatch(self, w: Watch) -> None:
        watches = self._watches.get(w.member)
        if watches is None:
            return
        watches.discard(w)
        if not watches:
            del self._watches[w.member]
            self._stop_grace(w.member)

    @property
    def watched(self) -> int:
        """Attempts depending on some member now."""
        return sum(len(ws) for ws in self._watches.values())

    # -- the two signals --------------------------------------------------------------------

    def on_member_down(self, msg: MemberDown) -> None:
        self.lost(msg.member_id, msg.reason)

    def on_view(self, view: ClusterView) -> None:
        present = {te.te_id for te in view.tes} | {je.je_id for je in view.jes}
        self._present = present
        for member in list(self._watches):
            if member in present:
                self._stop_grace(member)
            else:
                self._start_grace(member)

    def lost(self, member: str, reason: str) -> None:
        """Every attempt that depends on ``member`` hears it now."""
        self._stop_grace(member)
        watches = self._watches.pop(member, set())
        if watches:
            log.warning("member lost", member=member, reason=reason, attempts=len(watches))
        for w in watches:
            w.on_lost(member)

    # -- the grace of an absence ------------------------------------------------------------

    def _start_grace(self, member: str) -> None:
        if member in self._timers:
            return
        self._timers[member] = asyncio.get_running_loop().call_later(
            self._grace, self.lost, member, f"absent from the cluster view for {self._grace:g}s"
        )

    def _stop_grace(self, member: str) -> None:
        timer = self._timers.pop(member, None)
        if timer is not None:
            timer.cancel()

    def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
