"""What went wrong talking to NATS and Redis, counted in each process that talks to them
(every service's ``/metrics``: the frontend, job executor, cluster manager, scaler and node
pool; a TE's own process is not scraped). The bus (``shared.bus``) and the Redis client of
``shared.store`` count here; callers still see the error and decide what it means."""

from __future__ import annotations

from prometheus_client import Counter

BUS_ERRORS = Counter(
    "meshserve:bus_errors",
    "NATS failures, by kind: no_responder (nobody subscribed), timeout (no reply in time), "
    "transport (a publish or request failed), undecodable (a reply no one can read), "
    "disconnected (the connection to the server lost), client (an error the NATS client "
    "reported, such as a slow consumer)",
    ["kind"],
)
REDIS_ERRORS = Counter(
    "meshserve:redis_errors",
    "Redis commands and transactions that failed, by kind: connection (unreachable, timed "
    "out, or the connection dropped), refused (an error reply: no permission, a failed "
    "script, a wrong type), watch (a transaction lost its race: retried by its caller)",
    ["kind"],
)

# Every kind from the start: a healthy process shows zeros, and a rate over them is 0, not
# no data.
for _kind in ("no_responder", "timeout", "transport", "undecodable", "disconnected", "client"):
    BUS_ERRORS.labels(_kind)
for _kind in ("connection", "refused", "watch"):
    REDIS_ERRORS.labels(_kind)
