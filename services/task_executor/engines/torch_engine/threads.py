"""How many intra-op threads a CPU engine runs its iterations on: all of them, or one while
its iterations are too short to be worth splitting.

Splitting a millisecond-long iteration over the cores saves little and costs the serving
path its tail on a host the engine shares with the frontend, the bus and the job executor:
each parallel region ends at a barrier that waits for a thread the OS preempted, and the
team's idle threads spin on a core the token's delivery needs. Measured with
``scripts/bench-overhead``'s requests (sequential, 1 output token, demo model, AMD EPYC with
2 cores, the whole cluster on the host): TTFT p99 19.3 ms on two threads, 6.5 ms on one;
p50 5.2 and 4.1 ms. The demo model's 32-token prefill takes about 1.0 ms either way.

The choice follows measured times, never a cost model of small batches, and changes
rarely (a change of thread count costs the next iteration a few milliseconds): after each
WINDOW iterations, the median of their times decides. On all threads, a median that one
thread would keep within SERIAL_S even with no gain from the others (median x threads)
switches to one thread; on one thread, a median past SERIAL_S switches back. A model whose
iterations take several milliseconds never leaves all threads; a tiny one runs on one
thread until its batches grow."""

from __future__ import annotations

import statistics

SERIAL_S = 0.003  # iterations one thread does within this are not worth splitting
WINDOW = 32  # iterations between two decisions


class IntraOpThreads:
    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self.now = self.threads
        self._times: list[float] = []

    def took(self, seconds: float) -> int | None:
        """The last iteration took ``seconds`` on ``now`` threads: the thread count from the
        next one on, if it changes, else None."""
        if self.threads == 1:
            return None
        self._times.append(seconds)
        if len(self._times) < WINDOW:
            return None
        median, self._times = statistics.median(self._times), []
        if self.now > 1 and median * self.now <= SERIAL_S:
            self.now = 1
        elif self.now == 1 and median > SERIAL_S:
            self.now = self.threads
        else:
            return None
        return self.now
