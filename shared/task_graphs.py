"""Task graphs and their durable copy in Redis.

A job executor plans each job into a small graph of tasks (``services/job_executor/planner.py``):
one colocated task, or a prefill task whose KV a decode task continues from; the fine-tuning
jobs add preprocess → train → evaluate. A graph whose tasks hand work to each other is kept
here while it runs, so that when its job executor dies another one finishes it from where it
was, instead of running it again.

Each graph has one owner at a time (a job executor) and a fencing number, its ``epoch``: every
write names the epoch it was made under and is refused once another owner has taken the graph
(``Deposed``), so a job executor that stalled and wakes up late cannot overwrite what its
successor decided. A graph may be taken only from an owner that is gone: one whose liveness
key (renewed on each of its heartbeats, expiring after the liveness timeout) has expired. A
task is recorded ``placing`` before it is offered to a TE and ``placed`` after: a successor
that finds ``placing`` does not know whether the TE took it, and cancels it there before it
goes on (cancels are idempotent), so no task runs twice.

Layout (``Keys``): a hash per graph (``owner``, ``epoch``, ``open``, ``graph``: msgpack
``TaskGraph``), a sorted set of the open graphs by deadline (what a sweeper scans for
orphans), a key per live job executor. A finished graph stays for ``KEEP_S`` (to be read by
a retry or an operator), then expires."""

from __future__ import annotations

import array
import dataclasses
import enum
import hashlib
from collections.abc import Sequence

import msgspec

from shared.errors import Deposed
from shared.messages.tasks import KvSource
from shared.store import Store
from shared.subjects import Keys

KEEP_S = 120.0  # how long a finished graph stays readable


class TaskState(enum.StrEnum):
    PLANNED = "planned"  # not offered to any TE yet
    PLACING = "placing"  # offered to te_id; whether it took it is not recorded
    PLACED = "placed"  # te_id took it
    DONE = "done"
    FAILED = "failed"  # refused, or failed where it ran
    CANCELLED = "cancelled"


class GraphTask(msgspec.Struct, kw_only=True):
    """One task of a graph. ``kind`` is what runs (a chat task's ``TaskMode``; later train,
    evaluate...). It may start once each task in ``after`` is done, or, for one that
    ``streams`` its output as it runs (a prefill's KV), once it is placed."""

    name: str
    kind: str
    after: tuple[str, ...] = ()
    streams: bool = False
    state: TaskState = TaskState.PLANNED
    te_id: str = ""  # where it is offered or placed
    attempt: int = 0  # the job's attempt it was placed for: its key on the TE
    kv_source: KvSource | None = None  # a placed prefill task: where its KV is offered
    reason: str = ""  # why it failed or was cancelled


class TaskGraph(msgspec.Struct, kw_only=True):
    graph_id: str  # the job's id (a chat request's id): one graph per job at a time
    kind: str  # "chat"
    model: str
    deadline: float  # unix seconds: an orphan past it is abandoned, not continued
    tasks: list[GraphTask]
    # Chat: a digest of the prompt the tasks were placed for (a continuation must match it).
    prompt: str = ""
    finished: bool = False

    def task(self, name: str) -> GraphTask:
        return next(t for t in self.tasks if t.name == name)


def prompt_digest(token_ids: Sequence[int]) -> str:
    """What a graph remembers of its prompt: enough to tell whether another attempt's prompt
    is the same one."""
    return hashlib.blake2b(array.array("q", token_ids).tobytes(), digest_size=16).hexdigest()


@dataclasses.dataclass(frozen=True, slots=True)
class Held:
    """A graph as stored: who owns it, under which epoch, whether the owner is alive."""

    graph: TaskGraph
    owner: str
    epoch: int
    open: bool
    owner_alive: bool


# KEYS: graph hash, open set. ARGV: me, graph blob, deadline, id, alive-key prefix, suffix.
# Overwrites a graph nobody live holds open (or one this JE holds); -1: a live peer holds it.
_OPEN = """
local owner = redis.call('HGET', KEYS[1], 'owner')
local epoch = tonumber(redis.call('HGET', KEYS[1], 'epoch') or '0')
if owner and owner ~= ARGV[1] and redis.call('HGET', KEYS[1], 'open') == '1'
   and redis.call('EXISTS', ARGV[5] .. owner .. ARGV[6]) == 1 then
  return -1
end
epoch = epoch + 1
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'epoch', epoch, 'graph', ARGV[2], 'open', '1')
redis.call('PERSIST', KEYS[1])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[4])
return epoch
"""

# KEYS: graph hash, open set. ARGV: epoch, graph blob, finished (1/0), keep ms, id.
_PUT = """
if tonumber(redis.call('HGET', KEYS[1], 'epoch') or '-1') ~= tonumber(ARGV[1]) then
  return 0
end
redis.call('HSET', KEYS[1], 'graph', ARGV[2])
if ARGV[3] == '1' then
  redis.call('HSET', KEYS[1], 'open', '0')
  redis.call('ZREM', KEYS[2], ARGV[5])
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
end
return 1
"""

# KEYS: graph hash. ARGV: me, the epoch seen, alive-key prefix, suffix. The new epoch, or 0.
_CLAIM = """
local owner = redis.call('HGET', KEYS[1], 'owner')
local epoch = tonumber(redis.call('HGET', KEYS[1], 'epoch') or '-1')
if epoch ~= tonumber(ARGV[2]) or redis.call('HGET', KEYS[1], 'open') ~= '1' then return 0 end
if owner ~= ARGV[1] and redis.call('EXISTS', ARGV[3] .. owner .. ARGV[4]) == 1 then return 0 end
epoch = epoch + 1
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'epoch', epoch)
return epoch
"""

# KEYS: graph hash. ARGV: alive-key prefix, suffix. {owner, epoch, graph, open, alive} or nil.
_GET = """
local v = redis.call('HMGET', KEYS[1], 'owner', 'epoch', 'graph', 'open')
if not v[1] then return nil end
return {v[1], v[2], v[3], v[4], redis.call('EXISTS', ARGV[1] .. v[1] .. ARGV[2])}
"""


class GraphStore:
    """The graphs of one cluster in Redis, as seen by one job executor (``me``)."""

    def __init__(self, store: Store, cluster: str, me: str) -> None:
        self._redis = store.redis
        self._keys = Keys(cluster)
        self.me = me
        self._alive_prefix, self._alive_suffix = self._keys.je_alive("\0").split("\0")
        self._open = self._redis.register_script(_OPEN)
        self._put = self._redis.register_script(_PUT)
        self._claim = self._redis.register_script(_CLAIM)
        self._get = self._redis.register_script(_GET)

    async def alive(self, ttl_s: float) -> None:
        """This JE is alive for ``ttl_s`` more: its graphs cannot be taken meanwhile."""
        await self._redis.set(self._keys.je_alive(self.me), b"1", px=max(int(ttl_s * 1000), 1))

    async def leave(self) -> None:
        await self._redis.delete(self._keys.je_alive(self.me))

    async def open(self, graph: TaskGraph) -> int | None:
        """Start ``graph`` (replacing a finished or orphaned one of the same id); its epoch,
        or None while a live peer holds an open graph of that id."""
        epoch = int(
            await self._open(
                keys=[self._keys.graph(graph.graph_id), self._keys.graphs_open()],
                args=[
                    self.me,
                    msgspec.msgpack.encode(graph),
                    graph.deadline,
                    graph.graph_id,
                    self._alive_prefix,
                    self._alive_suffix,
                ],
            )
        )
        return None if epoch < 0 else epoch

    async def put(self, graph: TaskGraph, epoch: int) -> None:
        """Record ``graph`` as it is now (finished: it leaves the open set and expires after
        ``KEEP_S``). Raises ``Deposed`` if another JE took it over since ``epoch``."""
        ok = await self._put(
            keys=[self._keys.graph(graph.graph_id), self._keys.graphs_open()],
            args=[
                epoch,
                msgspec.msgpack.encode(graph),
                1 if graph.finished else 0,
                int(KEEP_S * 1000),
                graph.graph_id,
            ],
        )
        if not int(ok):
            raise Deposed(f"another job executor took over job {graph.graph_id}")

    async def get(self, graph_id: str) -> Held | None:
        got = await self._get(
            keys=[self._keys.graph(graph_id)], args=[self._alive_prefix, self._alive_suffix]
        )
        if not got:
            return None
        owner, epoch, blob, is_open, alive = got
        return Held(
            graph=msgspec.msgpack.decode(blob, type=TaskGraph),
            owner=owner.decode() if isinstance(owner, bytes) else str(owner),
            epoch=int(epoch),
            open=(is_open in (b"1", "1")),
            owner_alive=bool(int(alive)),
        )

    async def claim(self, graph_id: str, seen_epoch: int) -> int | None:
        """Take an open graph over from its owner, gone since it was read at ``seen_epoch``:
        the new epoch, or None (the owner is alive, or someone else took it first)."""
        epoch = int(
            await self._claim(
                keys=[self._keys.graph(graph_id)],
                args=[self.me, seen_epoch, self._alive_prefix, self._alive_suffix],
            )
        )
        return epoch or None

    async def open_ids(self, limit: int = 100) -> list[str]:
        """Open graphs, the earliest deadline first."""
        ids = await self._redis.zrange(self._keys.graphs_open(), 0, limit - 1)
        return [i.decode() if isinstance(i, bytes) else str(i) for i in ids]

    async def forget(self, graph_id: str) -> None:
        """Drop an open-set entry whose graph expired or was deleted."""
        await self._redis.zrem(self._keys.graphs_open(), graph_id)
