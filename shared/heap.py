"""The garbage collector of a long-running service.

A service builds most of what it will ever hold at start (imported modules, torch, its
clients) and a TE more with each model it loads: hundreds of thousands of objects that live
as long as the process. CPython's full collection walks every tracked object, so each one
took 40-90 ms in every service (measured with ``gc.callbacks`` under
``scripts/bench-overhead``) and landed on whichever request was in flight: the serving
path's TTFT tail. ``settle`` moves what exists now out of the collector's sight
(``gc.freeze``); collections then walk only what requests allocate. Objects frozen still
die when nothing refers to them; only reference cycles among them wait for ``unsettle``,
which a TE calls before it frees a model."""

from __future__ import annotations

import gc


def settle() -> None:
    """What the process holds now lives as long as it: collect the garbage, then freeze the
    rest."""
    gc.collect()
    gc.freeze()


def unsettle() -> None:
    """Before something settled is let go (a model unloaded): its cycles can be collected
    again."""
    gc.unfreeze()
