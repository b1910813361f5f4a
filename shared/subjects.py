"""Every NATS subject meshserve uses, built in this one place. No other code writes a
subject string. The catalogue also drives proto/subjects.md (scripts/gen-docs)."""

from __future__ import annotations

import dataclasses

from shared.messages.api import ErrorReply
from shared.messages.auth import KeyRevoked
from shared.messages.base import Message
from shared.messages.cluster import (
    ClusterView,
    FEHeartbeat,
    GetView,
    JEHeartbeat,
    Leave,
    MemberDown,
    TEHeartbeat,
)
from shared.messages.devices import DeviceSnapshot
from shared.messages.jobs import ChatJob, JobAccepted, JobHeld, JobTaken
from shared.messages.kv import KvEventBatch
from shared.messages.scaling import (
    ControlAck,
    Drain,
    LoadModel,
    OutcomeReport,
    PreloadModel,
    ScaleEvent,
    TrafficReport,
    UnloadModel,
)
from shared.messages.tasks import CancelTask, ChatTask, TaskAccepted, TaskProgress, TokenChunk
from shared.messages.training import (
    CancelTraining,
    FineTuneSubmitted,
    TrainAccepted,
    TrainDone,
    TrainProgress,
    TrainTask,
)


@dataclasses.dataclass(frozen=True)
class SubjectSpec:
    template: str  # "{cluster}" and other {fields} are filled by Subjects
    pattern: str  # "request/reply", "publish", "queue request/reply"
    payload: tuple[type[Message], ...]
    reply: tuple[type[Message], ...]
    publishers: str
    subscribers: str
    doc: str


CATALOGUE: dict[str, SubjectSpec] = {
    "job_submit": SubjectSpec(
        "{cluster}.je.submit",
        "queue request/reply",
        (ChatJob,),
        (JobAccepted, ErrorReply),
        "frontend",
        "job executors (queue group 'je')",
        "Submit a job; the reply comes once the job is placed on a TE or has failed.",
    ),
    "te_task": SubjectSpec(
        "{cluster}.te.{te_id}.task",
        "request/reply",
        (ChatTask, CancelTask),
        (TaskAccepted, ErrorReply),
        "job executor, frontend (cancel)",
        "one TE",
        "Place a task on a TE, or cancel one.",
    ),
    "te_train": SubjectSpec(
        "{cluster}.te.{te_id}.train",
        "request/reply",
        (TrainTask, CancelTraining),
        (TrainAccepted, ErrorReply),
        "job executor",
        "one TE",
        "Run a stage of a fine-tuning job on an idle TE (it trains instead of serving until "
        "the stage ends), or cancel one.",
    ),
    "train_progress": SubjectSpec(
        "{cluster}.je.{je_id}.train",
        "publish",
        (TrainProgress, TrainDone),
        (),
        "TEs",
        "the job executor that placed the stage",
        "A fine-tuning stage's steps, epochs and checkpoints, and its end.",
    ),
    "ft_submit": SubjectSpec(
        "{cluster}.ft.submit",
        "publish",
        (FineTuneSubmitted,),
        (),
        "frontend",
        "job executors",
        "A fine-tuning job was created or cancelled: job executors look at the active jobs "
        "in Redis now rather than at their next scan.",
    ),
    "task_progress": SubjectSpec(
        "{cluster}.je.{je_id}.progress",
        "publish",
        (TaskProgress,),
        (),
        "TEs",
        "the job executor that placed the tasks",
        "Tasks that produced their first token or ended, batched per engine iteration: the "
        "JE counts each TE's queue by placement, not by heartbeat.",
    ),
    "te_control": SubjectSpec(
        "{cluster}.te.{te_id}.control",
        "request/reply",
        (LoadModel, PreloadModel, UnloadModel, Drain),
        (ControlAck,),
        "scaler",
        "one TE",
        "Load or unload a model, pre-load one into the host's weight cache, or drain the TE.",
    ),
    "token_stream": SubjectSpec(
        "{cluster}.inbox.{owner}.{attempt_key}",
        "publish",
        (TokenChunk, JobTaken, JobHeld),
        (),
        "TE (tokens), job executor (JobTaken, JobHeld)",
        "the frontend that owns the request",
        "Tokens of one attempt of a request (attempt_key: request id and attempt number), "
        "streamed straight from the TE to the frontend; the notice that a JE has taken the "
        "job and is placing it; and the notice that a JE holds the job while a model scales "
        "up.",
    ),
    "heartbeat": SubjectSpec(
        "{cluster}.cm.heartbeat",
        "publish",
        (TEHeartbeat, JEHeartbeat, FEHeartbeat, Leave),
        (),
        "TEs, JEs, frontends",
        "cluster manager",
        "Liveness, state and load of every member.",
    ),
    "view": SubjectSpec(
        "{cluster}.cm.view",
        "publish",
        (ClusterView,),
        (),
        "cluster manager",
        "JEs, scaler, frontends",
        "The cluster view, pushed on every change and periodically.",
    ),
    "member_down": SubjectSpec(
        "{cluster}.cm.member_down",
        "publish",
        (MemberDown,),
        (),
        "cluster manager",
        "frontends, TEs (a frontend gone: its generations stop)",
        "A member was declared gone (liveness deadline passed, or it left): every request "
        "depending on it moves at once.",
    ),
    "get_view": SubjectSpec(
        "{cluster}.cm.get_view",
        "request/reply",
        (GetView,),
        (ClusterView,),
        "anyone starting up",
        "cluster manager",
        "The current cluster view, on demand.",
    ),
    "kv_events": SubjectSpec(
        "{cluster}.kv.events.{te_id}",
        "publish",
        (KvEventBatch,),
        (),
        "TEs",
        "job executors (prompt index)",
        "Batches of prefix-cache events (blocks stored, removed) of one TE.",
    ),
    "traffic": SubjectSpec(
        "{cluster}.scaler.traffic",
        "publish",
        (TrafficReport,),
        (),
        "job executors",
        "scaler",
        "Each JE's arrivals per model since its last report and the jobs it holds now; sent "
        "every report interval while there is traffic, and at once when a job waits for a "
        "model with no instance able to take it.",
    ),
    "outcomes": SubjectSpec(
        "{cluster}.scaler.outcomes",
        "publish",
        (OutcomeReport,),
        (),
        "frontends",
        "scaler",
        "Requests finished per model since the last report, and how many met the SLO.",
    ),
    "scale_events": SubjectSpec(
        "{cluster}.scaler.events",
        "publish",
        (ScaleEvent,),
        (),
        "scaler",
        "frontends (metrics), operators",
        "Every scale-up and scale-down once done, with the time of each step.",
    ),
    "key_revoked": SubjectSpec(
        "{cluster}.auth.revoked",
        "publish",
        (KeyRevoked,),
        (),
        "the frontend that revoked the key",
        "frontends",
        "An API key was revoked; frontends drop it from their key caches at once.",
    ),
    "device_views": SubjectSpec(
        "{cluster}.devices.views",
        "publish",
        (DeviceSnapshot,),
        (),
        "node pools with a device arbiter (MESHSERVE_KV_PREEMPTION)",
        "node pools with a device arbiter",
        "A shared device's instances and the requests they hold, twice a second: where a "
        "preempted neighbour's requests could go, validated there (kv_sizing.preemption).",
    ),
}


def inbox_prefix(cluster: str, role: str | None = None) -> str:
    """Where a cluster's services receive replies: nats.py's inboxes, with the cluster name
    first like every other subject, then the service's role (``shared.access``), so that
    NATS lets each role read its own replies only."""
    return f"{cluster}._INBOX" if role is None else f"{cluster}._INBOX.{role}"


class Subjects:
    """Subjects of one cluster."""

    def __init__(self, cluster: str) -> None:
        self.cluster = cluster

    def _fill(self, name: str, **fields: str) -> str:
        return CATALOGUE[name].template.format(cluster=self.cluster, **fields)

    def job_submit(self) -> str:
        return self._fill("job_submit")

    def te_task(self, te_id: str) -> str:
        return self._fill("te_task", te_id=te_id)

    def te_train(self, te_id: str) -> str:
        return self._fill("te_train", te_id=te_id)

    def train_progress(self, je_id: str) -> str:
        return self._fill("train_progress", je_id=je_id)

    def ft_submit(self) -> str:
        return self._fill("ft_submit")

    def task_progress(self, je_id: str) -> str:
        return self._fill("task_progress", je_id=je_id)

    def te_control(self, te_id: str) -> str:
        return self._fill("te_control", te_id=te_id)

    def token_stream(self, owner: str, attempt_key: str) -> str:
        return self._fill("token_stream", owner=owner, attempt_key=attempt_key)

    @staticmethod
    def owner_of(token_stream: str) -> str:
        """The frontend a token-stream subject belongs to (cluster names hold no dots)."""
        return token_stream.split(".")[2]

    def token_streams(self, owner: str) -> str:
        """Wildcard over every token stream one frontend owns."""
        return self._fill("token_stream", owner=owner, attempt_key="*")

    def heartbeat(self) -> str:
        return self._fill("heartbeat")

    def view(self) -> str:
        return self._fill("view")

    def get_view(self) -> str:
        return self._fill("get_view")

    def member_down(self) -> str:
        return self._fill("member_down")

    def kv_events(self, te_id: str) -> str:
        return self._fill("kv_events", te_id=te_id)

    def all_kv_events(self) -> str:
        return self._fill("kv_events", te_id="*")

    def traffic(self) -> str:
        return self._fill("traffic")

    def outcomes(self) -> str:
        return self._fill("outcomes")

    def scale_events(self) -> str:
        return self._fill("scale_events")

    def key_revoked(self) -> str:
        return self._fill("key_revoked")

    def device_views(self) -> str:
        return self._fill("device_views")


class Keys:
    """Redis keys of one cluster; every key starts with the cluster name."""

    def __init__(self, cluster: str) -> None:
        self.cluster = cluster

    def models(self) -> str:
        return f"{self.cluster}:models"

    def members(self) -> str:
        return f"{self.cluster}:members"

    def capacities(self) -> str:
        """Hash: ``model|engine`` -> msgpack ``InstanceCapacity``, measured once each."""
        return f"{self.cluster}:capacity"

    def host_cache(self, pool_id: str, part: str) -> str:
        """Hashes of one node pool's host weight cache, as its TEs last read it: ``tensors``
        (entry key -> JSON size, first_seen, last_use, uses, hits, misses), ``models``
        (model -> JSON resident_bytes, total_bytes) and ``pool`` (``server``: its weight
        server; ``free_bytes``; ``updated_at``)."""
        return f"{self.cluster}:hostcache:{pool_id}:{part}"

    def kv_index_tes(self, model: str) -> str:
        """Hash: TE id -> ``"<seq> <block size>"``, the last KV event batch in the model's
        prompt index from that TE."""
        return f"{self.cluster}:kvidx:{model}:tes"

    def kv_index_blocks(self, model: str, te_id: str, tier: str) -> str:
        """Set: the block hashes (8 bytes, little-endian) ``te_id`` holds in ``tier``."""
        return f"{self.cluster}:kvidx:{model}:{te_id}:{tier}"

    def leader(self, role: str) -> str:
        """String: the id of the replica of ``role`` holding its leader lease (``shared.leader``),
        expiring with the lease."""
        return f"{self.cluster}:leader:{role}"

    def leader_epoch(self, role: str) -> str:
        """Integer: ``role``'s fencing number, one more each time its lease changes hands."""
        return f"{self.cluster}:leader:{role}:epoch"

    def graph(self, graph_id: str) -> str:
        """Hash: one job's task graph (``shared.task_graphs``): ``owner``, ``epoch``,
        ``open``, ``graph`` (msgpack ``TaskGraph``)."""
        return f"{self.cluster}:graph:{graph_id}"

    def graphs_open(self) -> str:
        """Sorted set: the ids of the open task graphs, scored by their deadline."""
        return f"{self.cluster}:graphs:open"

    def je_alive(self, je_id: str) -> str:
        """A job executor's liveness: set on each heartbeat, expiring after the liveness
        timeout; its graphs may be taken over once it is gone."""
        return f"{self.cluster}:je:{je_id}:alive"

    def files(self) -> str:
        """Hash: file id -> msgpack ``shared.file_store.FileObject`` (the bytes are in
        ``MESHSERVE_FILES_DIR``)."""
        return f"{self.cluster}:files"

    def file_usage(self) -> str:
        """Hash: tenant -> the bytes of the files it keeps (its quota's use)."""
        return f"{self.cluster}:files:usage"

    def ft_jobs(self) -> str:
        """Set: every fine-tuning job's id."""
        return f"{self.cluster}:ft:jobs"

    def ft_job(self, job_id: str) -> str:
        """String: one fine-tuning job, JSON ``shared.fine_tuning.FineTuneJob``."""
        return f"{self.cluster}:ft:job:{job_id}"

    def ft_active(self) -> str:
        """Sorted set: the fine-tuning jobs not yet settled (not terminal, or terminal with
        stages a job executor has still to stop), scored by creation time."""
        return f"{self.cluster}:ft:active"

    def ft_events(self, job_id: str) -> str:
        """List: one fine-tuning job's events (JSON ``JobEvent``), oldest first."""
        return f"{self.cluster}:ft:job:{job_id}:events"

    def ft_checkpoints(self, job_id: str) -> str:
        """List: one fine-tuning job's checkpoints (JSON ``JobCheckpoint``), oldest first."""
        return f"{self.cluster}:ft:job:{job_id}:checkpoints"

    def adapters(self) -> str:
        """Hash: a fine-tuned model's name -> JSON ``shared.fine_tuning.Adapter``."""
        return f"{self.cluster}:adapters"

    def tenants(self) -> str:
        """Hash: tenant name -> JSON ``shared.tenancy.Tenant`` (its models and limits)."""
        return f"{self.cluster}:tenants"

    def api_keys(self) -> str:
        """Hash: SHA-256 hex of an API key -> JSON ``shared.tenancy.ApiKey``."""
        return f"{self.cluster}:auth:keys"

    def api_key_ids(self) -> str:
        """Hash: key id -> the key's SHA-256 hex (to revoke by id)."""
        return f"{self.cluster}:auth:key_ids"

    def rate(self, tenant: str) -> str:
        """Hash: one tenant's token buckets (``req``, ``tok`` levels, ``at`` in ms)."""
        return f"{self.cluster}:rate:{tenant}"

    def in_flight(self, tenant: str) -> str:
        """Sorted set: request id -> lease expiry (ms) of one tenant's requests in flight."""
        return f"{self.cluster}:inflight:{tenant}"
