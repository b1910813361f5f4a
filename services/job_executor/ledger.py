"""The work a job executor placed on each TE, one entry per placement, and how much of it
the TE's last report did not show. The services and the simulator both keep one.

A TE reports its load every heartbeat, split by the JE that placed each task
(``TEHeartbeat.shares``). Between two reports a JE knows more about its own placements
than the report does: those it placed since, and those the TE has told it
(``TaskProgress``) produced their first token or ended. ``unreported`` is, per TE, this
JE's share now less its share in the TE's last report; a TE's load as the policies read it
is the report plus that (``placement.te_load``, ``admission.outstanding``). So a client
that sends one request after another, however fast, is counted as the one request it has
in flight, not as every request since the last heartbeat.

A lost notice cannot leave a placement counted for ever: a report says how many
placements the TE had taken (``TEView.placements``, its number of its last
``TaskAccepted``) and the oldest of this JE's it still held (``JobShare.oldest``); an entry
the TE had taken before that one has ended, notice or not."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping

from services.views import TEView
from shared.messages.cluster import JobShare

NO_SHARE = JobShare()


def sequences(te: TEView, unreported: Mapping[str, JobShare]) -> int:
    """Sequences on the TE that have not ended (queued, prefilling or decoding)."""
    return max(0, te.running + te.waiting + unreported.get(te.te_id, NO_SHARE).sequences)


def decoding(te: TEView, unreported: Mapping[str, JobShare]) -> int:
    """Sequences the TE decodes (each holds a batch slot and a token of every iteration)."""
    return max(0, te.running + unreported.get(te.te_id, NO_SHARE).decoding)


def prefill_tokens(te: TEView, unreported: Mapping[str, JobShare]) -> int:
    """Prompt tokens queued on the TE for prefill (less the prefixes expected cached)."""
    return max(0, te.queued_prompt_tokens + unreported.get(te.te_id, NO_SHARE).prefill_tokens)


def import_tokens(te: TEView, unreported: Mapping[str, JobShare]) -> int:
    """PD: prompt tokens whose KV is on its way to the TE from prefill TEs."""
    return max(0, te.queued_import_tokens + unreported.get(te.te_id, NO_SHARE).import_tokens)


@dataclasses.dataclass(slots=True)
class _Placement:
    te_id: str
    prefill_tokens: int  # the prompt tokens the TE computes (after the prefix it holds)
    import_tokens: int = 0  # PD, a decode task: the prompt tokens whose KV it takes in
    decoding: bool = False  # past its first token
    seq: int = 0  # the TE's number for it (TaskAccepted.seq); 0 until the TE answered


@dataclasses.dataclass(slots=True)
class _Totals:
    """This JE's share of one TE now, kept as entries come and go."""

    sequences: int = 0
    decoding: int = 0
    prefill_tokens: int = 0
    import_tokens: int = 0

    def add(self, p: _Placement, sign: int) -> None:
        self.sequences += sign
        if p.decoding:
            self.decoding += sign
        else:
            self.prefill_tokens += sign * p.prefill_tokens
            self.import_tokens += sign * p.import_tokens

    def minus(self, reported: JobShare) -> JobShare:
        return JobShare(
            sequences=self.sequences - reported.sequences,
            decoding=self.decoding - reported.decoding,
            prefill_tokens=self.prefill_tokens - reported.prefill_tokens,
            import_tokens=self.import_tokens - reported.import_tokens,
        )


class PlacementLedger:
    def __init__(self, je_id: str) -> None:
        self.je_id = je_id
        self._by_key: dict[str, _Placement] = {}  # by attempt key
        self._by_te: dict[str, dict[str, _Placement]] = {}  # te -> key -> entry, oldest first
        self._totals: dict[str, _Totals] = {}  # te -> what its entries add up to
        self._reported: dict[str, JobShare] = {}  # te -> this JE's share in its last report
        # te -> this JE's share now less its share in the last report (not all zero)
        self.unreported: dict[str, JobShare] = {}

    def placed(self, te_id: str, key: str, prefill_tokens: int, import_tokens: int = 0) -> None:
        """A task is being placed on ``te_id``: counted before the TE answers, so that the
        jobs placed meanwhile see it. ``import_tokens``: a decode task's (PD)."""
        self.ended(key)
        entry = _Placement(te_id, prefill_tokens, import_tokens)
        self._by_key[key] = entry
        self._by_te.setdefault(te_id, {})[key] = entry
        self._totals.setdefault(te_id, _Totals()).add(entry, 1)
        self._update(te_id)

    def accepted(self, key: str, seq: int) -> None:
        """The TE took the task, as its placement number ``seq``."""
        if (entry := self._by_key.get(key)) is not None:
            entry.seq = seq

    def prefilled(self, key: str, te_id: str) -> None:
        entry = self._by_key.get(key)
        if entry is not None and entry.te_id == te_id and not entry.decoding:
            totals = self._totals[te_id]
            totals.add(entry, -1)
            entry.decoding = True
            totals.add(entry, 1)
            self._update(te_id)

    def ended(self, key: str, te_id: str | None = None) -> None:
        """The task left ``te_id`` (finished, failed, cancelled, refused, handed back); with
        no TE, wherever it was. A notice from a TE the key has since left changes nothing."""
        entry = self._by_key.get(key)
        if entry is None or (te_id is not None and entry.te_id != te_id):
            return
        del self._by_key[key]
        entries = self._by_te[entry.te_id]
        del entries[key]
        self._totals[entry.te_id].add(entry, -1)
        if not entries:
            del self._by_te[entry.te_id], self._totals[entry.te_id]
        self._update(entry.te_id)

    def report(self, te: TEView) -> None:
        """A TE's report reached the view."""
        mine = te.shares.get(self.je_id, NO_SHARE)
        gone_below = mine.oldest if mine.sequences else te.placements + 1
        entries = self._by_te.get(te.te_id, {})
        for key in [k for k, p in entries.items() if 0 < p.seq < gone_below]:
            self.ended(key)  # its notice was lost, or is on its way
        self._reported[te.te_id] = mine
        self._update(te.te_id)

    def keep_only(self, te_ids: Collection[str]) -> None:
        """Forget the TEs the view no longer holds (their tasks move elsewhere)."""
        for te_id in [t for t in self._by_te if t not in te_ids]:
            for key in list(self._by_te[te_id]):
                self.ended(key)
        for te_id in [t for t in self._reported if t not in te_ids]:
            del self._reported[te_id]
            self._update(te_id)

    def outstanding(self, te_id: str) -> int:
        """This JE's tasks on ``te_id`` that have not ended."""
        return len(self._by_te.get(te_id, ()))

    def _update(self, te_id: str) -> None:
        delta = self._totals.get(te_id, _Totals()).minus(self._reported.get(te_id, NO_SHARE))
        if delta == NO_SHARE:
            self.unreported.pop(te_id, None)
        else:
            self.unreported[te_id] = delta
