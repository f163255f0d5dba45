"""The coordinator's decisions as a pure function: `decide(state, event)`.

Given the coordinator's state (typed checkpoint and node records) and one event (a
typed message from a node, a tick with the time, or the result of an effect it asked
for), `decide` returns the new state and the effects to carry out: messages to agents,
files to write (coordinator.json, status, index, global manifests), checkpoint
directories to purge, events to emit, model computations to run. It reads no clock
(time comes in with the event), touches no file and calls no MPI; coordinator.py carries
the effects out, the PFS writes and the model off the thread that services MPI.

Clocks: an event's `now` is the coordinator's monotonic clock, and every decision
(deadlines, the status period, latencies) runs on it, so a step of the wall clock
changes none. Wall-clock times are only recorded and shown (a record's `times`, the
manifests' `committed_at`, the index's `flushed_at`): `now + wall_offset`, the offset
taken from the ticks. No agent's clock is read: a marker's `written` time is when the
coordinator heard of it.

The state is updated in place and returned: a copy per message would make every
checkpoint cost O(nodes^2) at 10,000 nodes. Nothing else is touched.

Protocol (agent <-> coordinator):
  agent  -> coord  marker      an agent saw the commit marker of `ckpt` in its spool
  coord  -> all    commit      `ckpt` is committed (seq, global files, flush or not)
  agent  -> coord  captured    this node's part is in its stage (local manifest)
  agent  -> coord  replicated  this node's partners hold verified copies (or why not)
  agent  -> coord  flushed     this node's bundle is durable on the PFS
  coord  -> all    manifest    every node captured: the global manifest's digest
  coord  -> few    hold        every node captured: the whole global manifest, to the
                               metadata holders (and the coordinator's journal)
  coord  -> all    protected   every node replicated a `ckpt` that is not to be flushed
                               (flush.every): older unflushed stage copies may go
  coord  -> all    finalized   global manifest and index committed (level "flushed")
  coord  -> all    failed      `ckpt` can never be whole: drop it
  agent  -> coord  stop        a user asked to stop (signal, `cachex stop`)
  coord  -> all    drain       finish pending work, then report `drained`
  coord  -> all    exit        every agent drained (or the drain timed out)
  agent  -> coord  unprotected committed checkpoints an agent found at start and left
  agent  -> coord  superseded  saves of this node's counted for a version that never
                               became part of it (a newer save came first): counted
  agent  -> coord  silence     a node that reports to it (or a partner) is silent past
                               agent.timeout: suspect (routed around), or speaks again

A level is recorded only when every node's part holds it; the global manifest is
written last, after every bundle is durable, and only then is the index updated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from . import layout, relay
from .fsutil import compact_json
from .index import Row, state_of_level
from .liveness import beat_period
from .manifest import GlobalManifest, LocalManifest, ManifestDigest
from .messages import (  # the agents' reports are this function's events as they came
    Captured,
    CaptureFailed,
    Commit,
    Drain,
    Drained,
    Evicted,
    Exit,
    Failed,
    Finalized,
    Flushed,
    FlushError,
    Frames,
    HoldManifest,
    ManifestReady,
    Marker,
    Progress,
    Protected,
    Replicated,
    Reroute,
    Silence,
    Stop,
    Superseded,
    Unprotected,
)
from .names import LEVELS
from .safepath import checkpoint_id, relative_paths
from .versions import trainer_name

IN_FLIGHT = LEVELS[:-1]
FINAL = ("flushed", "failed", "evicted", "purged")  # no message moves these on
ENDED = ("failed", "purged", "flushed")     # reports about these change nothing
HEARTBEAT = 2.0     # seconds between status writes of a running coordinator, at most
STATUS_EVERY = 0.5  # seconds between status writes while something changes, at least
# Finished checkpoints (failed, evicted, purged) the journal, status and index keep, newest
# first: enough for an agent that restarted with a stale entry, and the files stay bounded.
HISTORY = 16
NODE_MAPS = ("captured", "replicated", "flushed", "progress")


# ------------------------------------------------------------------------- state
@dataclass(slots=True)
class CheckpointRecord:
    """One checkpoint's global view. The per-node maps are keyed by str(node) (their JSON
    form); a finished record keeps totals (`counts`, `bytes`), not every node's manifest."""
    id: str
    seq: int
    level: str
    global_files: list[str] = field(default_factory=list)
    flush: bool = True
    path: str | None = "peer"           # None: the model's choice is not back yet
    rule: str | None = None             # the commit rule that saw it
    times: dict[str, float] = field(default_factory=dict)
    captured: dict[str, dict[str, Any]] = field(default_factory=dict)   # local manifests
    replicated: dict[str, list[int]] = field(default_factory=dict)      # partners
    flushed: dict[str, str] = field(default_factory=dict)               # bundles
    errors: dict[str, str] = field(default_factory=dict)
    progress: dict[str, dict[str, Any]] = field(default_factory=dict)
    capture: dict[str, dict[str, str]] = field(default_factory=dict)    # not a plain copy
    counts: dict[str, int] = field(default_factory=dict)
    bytes: int = 0
    reason: str | None = None
    deadline: float = 0.0               # monotonic: not kept, a restart sets it again
    replication_failed: bool = False
    superseded: int = 0                 # nodes' saves of it that never became part of it
    # not kept in coordinator.json (rebuilt on demand): at 10,000 nodes the sums over
    # every part and a second global manifest were a good part of the CPU per checkpoint
    sizes: dict[str, int] = field(default_factory=dict, repr=False, compare=False)
    total: int | None = field(default=None, repr=False, compare=False)  # of sizes, once known
    written_at: float | None = field(default=None, repr=False)     # monotonic, this life
    built: GlobalManifest | None = field(default=None, repr=False)
    digest: ManifestDigest | None = field(default=None, repr=False)
    # each node's manifest as coordinator.json holds it, encoded once: re-encoding 10,000
    # of them at every write was a third of the coordinator's CPU per checkpoint
    captured_text: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    def to_json(self) -> dict[str, Any]:
        """coordinator.json's form; the maps are copied (another thread writes it)."""
        return {"id": self.id, "seq": self.seq, "level": self.level,
                "global_files": list(self.global_files), "flush": self.flush,
                "path": self.path, "rule": self.rule, "times": dict(self.times),
                **{key: dict(getattr(self, key)) for key in
                   ("captured", "replicated", "flushed", "errors", "progress", "capture",
                    "counts")},
                "bytes": self.bytes, "reason": self.reason,
                "replication_failed": self.replication_failed, "superseded": self.superseded}

    @classmethod
    def from_json(cls, data: dict[str, Any], source: object, key: str) -> CheckpointRecord:
        """Ids name PFS directories that the coordinator writes and purges: checked."""
        checkpoint_id(data.get("id"), source, key)
        relative_paths(data.get("global_files", []), source, f"global file of {key}")
        for node, manifest in (data.get("captured") or {}).items():    # global_manifest's
            LocalManifest.from_json(manifest, f"{source} ({key}, node {node})", key)
        known = {k: v for k, v in data.items()
                 if k in cls.__dataclass_fields__
                 and k not in ("sizes", "total", "built", "digest", "written_at",
                               "deadline", "captured_text")}
        known.setdefault("path", "peer")        # journals from before the path choice
        return cls(**{**known, "path": known["path"] or "peer"})

    def node_bytes(self, node: int) -> int:
        key = str(node)
        if key not in self.sizes and key in self.captured:
            self.sizes[key] = part_bytes(self.captured[key])
        return self.sizes.get(key, 0)

    def total_bytes(self) -> int:
        if not self.captured:
            return self.bytes                   # finished, or adopted from the PFS index
        if self.total is None:
            self.total = sum(self.node_bytes(int(n)) for n in self.captured)
        return self.total

    def add_part(self, node: str, manifest: dict[str, Any]) -> None:
        """Node `node`'s part, its size counted into the total as it comes (the status
        asks for the total at every write: a sum over every node each time)."""
        size, before = part_bytes(manifest), self.sizes.get(node)
        if before is None and node in self.captured:
            self.total = None                   # its size never taken: summed again
        elif self.total is not None:
            self.total += size - (before or 0)
        self.captured[node], self.sizes[node] = manifest, size

    def count(self, key: str) -> int:
        """Nodes that reported `key`, also of a finished record (its maps emptied)."""
        return len(getattr(self, key)) or self.counts.get(key, 0)


@dataclass(slots=True)
class NodeRecord:
    """One agent as the coordinator knows it. Slow is not dead (liveness.py): a node
    silent past agent.timeout, by the clock of whoever waited on it, is `suspect` (since
    that time on the coordinator's clock) and left out of the tree until it is heard
    again; `dead` only when a partner waited agent.dead_after. Node 0 is neither: it is
    the coordinator's own process."""
    rank: int
    drained: bool = False
    dead: bool = False          # a partner waited agent.dead_after for it
    suspect: float | None = None    # since when (this clock) it is silent, as reported
    holds: dict[str, int] = field(default_factory=dict)     # what waits on it: by whom

    @property
    def skipped(self) -> bool:
        """Left out of the broadcast tree (relay.py): its children would hear nothing."""
        return self.dead or self.suspect is not None


@dataclass(frozen=True, slots=True)
class Settings:
    """What the decisions need of the configuration."""
    run: str
    commit_timeout: float
    agent_timeout: float
    flush_every: int
    drain_timeout: float
    keep_pfs: int
    fixed_path: tuple[str, str] | None   # (path, reason) when no model is consulted


@dataclass(slots=True)
class CoordinatorState:
    settings: Settings
    nodes: list[NodeRecord]
    ckpts: dict[str, CheckpointRecord] = field(default_factory=dict)
    next_seq: int = 1
    phase: str = "running"                  # running, draining, stopped
    drain_deadline: float = 0.0
    drained: int = 0
    dirty: bool = True
    last_status: float = float("-inf")
    unprotected: list[dict[str, Any]] = field(default_factory=list)
    # told to every agent by this life: when (this clock)
    announced: dict[str, float] = field(default_factory=dict)
    choosing: dict[str, int] = field(default_factory=dict)  # ckpt -> marker node
    finalizing: set[str] = field(default_factory=set)   # Finalize asked, no answer yet
    wall_offset: float = 0.0        # wall clock minus `now`, as of the last tick
    stop_ack: str | None = None     # the token of the last stop request taken (status)
    reroute: bool = False           # a node became suspect: one Reroute at the next tick


# ------------------------------------------------------------------------ events
@dataclass(frozen=True, slots=True)
class Tick:
    now: float
    wall: float | None = None   # the wall clock at `now`, for the times recorded


@dataclass(frozen=True, slots=True)
class Heard:
    """Node 0's agent received a message from `node` itself (not relayed)."""
    now: float
    node: int


@dataclass(frozen=True, slots=True)
class PathChosen:
    """The model's answer to `Choose`."""
    now: float
    ckpt: str
    path: str
    reason: str
    loss: dict[str, float] | None = None


@dataclass(frozen=True, slots=True)
class FinalizeDone:
    """The answer to `Finalize`: `error` None when manifest and index are durable."""
    now: float
    ckpt: str
    manifest: GlobalManifest
    error: str | None = None


# ----------------------------------------------------------------------- effects
@dataclass(frozen=True, slots=True)
class Send:
    rank: int
    msg: Any                # a typed message (messages.py)


@dataclass(frozen=True, slots=True)
class Broadcast:
    msg: Any                # a typed message (messages.py)


@dataclass(frozen=True, slots=True)
class Emit:
    event: str
    fields: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Log:
    level: str          # "info", "warning", "error"
    text: str


@dataclass(frozen=True, slots=True)
class SaveState:
    """Write coordinator.json as the state is now (latest wins)."""


@dataclass(frozen=True, slots=True)
class WriteStatus:
    """Write status.json (journal and PFS) as the state is now (latest wins)."""


@dataclass(frozen=True, slots=True)
class WriteIndex:
    """Write the PFS index as the state is now (latest wins)."""


@dataclass(frozen=True, slots=True)
class SaveGlobal:
    """Keep the global manifest in the coordinator's journal."""
    manifest: GlobalManifest


@dataclass(frozen=True, slots=True)
class Hold:
    """Send `msg` (the whole global manifest) to the metadata holders."""
    msg: HoldManifest


@dataclass(frozen=True, slots=True)
class Finalize:
    """Write the global manifest onto the PFS, then `index` (this checkpoint valid);
    answer with FinalizeDone."""
    ckpt: str
    manifest: GlobalManifest
    index: list[Row]


@dataclass(frozen=True, slots=True)
class Purge:
    """Remove these checkpoints' PFS directories (the index already says purged)."""
    ckpts: list[str]


@dataclass(frozen=True, slots=True)
class Resend:
    """Send tree frames `first`..`last` (those kept) to `node` directly, in order."""
    node: int
    first: int
    last: int


@dataclass(frozen=True, slots=True)
class Observe:
    """A stage duration for the model."""
    stage: str
    ckpt: str
    node: int
    nbytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class Choose:
    """Ask the model for `ckpt`'s path; answer with PathChosen."""
    ckpt: str
    size: int
    now: float


Effects = list[Any]


# --------------------------------------------------------------------- decisions
def decide(state: CoordinatorState, event: Any) -> tuple[CoordinatorState, Effects]:
    out: Effects = []
    _HANDLERS[type(event)](state, event, out)
    state.dirty = state.dirty or not isinstance(event, Tick)
    return state, out


def _on_marker(s: CoordinatorState, e: Marker, out: Effects) -> None:
    record = s.ckpts.get(e.ckpt)
    if record is not None:
        if record.level in IN_FLIGHT and record.path is not None and _missed(s, record, e):
            _announce(s, record, out, e.now,
                      s.nodes[e.node].rank if e.ckpt in s.announced else None)
        return
    if s.phase != "running":
        return
    seq, s.next_seq = s.next_seq, s.next_seq + 1
    record = CheckpointRecord(e.ckpt, seq, "written", global_files=list(e.global_files),
                              rule=e.rule, flush=(seq - 1) % s.settings.flush_every == 0, path=None,
                              times={"written": _wall(s, e.now)}, written_at=e.now,
                              deadline=e.now + s.settings.commit_timeout
                              + s.settings.agent_timeout)
    s.ckpts[e.ckpt] = record
    if s.settings.fixed_path is not None:
        _commit(s, record, *s.settings.fixed_path, None, e.node, e.now, out)
        out.append(SaveState())
        return
    s.choosing[e.ckpt] = e.node
    newest = _newest(s, LEVELS[1:])         # its size stands for this one's
    out.append(Choose(e.ckpt, newest.total_bytes() if newest else 0, e.now))


def _missed(s: CoordinatorState, record: CheckpointRecord, e: Marker) -> bool:
    """A marker after the commit went out may come from an agent that never got it: a
    relay that held the frame, or a coordinator that restarted (it broadcasts again).
    One that arrives within a beat of the commit crossed it on the way (every node's
    marker, as a rule): answering each would cost node 0 a send per node per
    checkpoint (10,000 at 10,000 nodes) for nothing."""
    return (record.id not in s.announced
            or e.now - s.announced[record.id] > beat_period(s.settings.agent_timeout))


def _on_path_chosen(s: CoordinatorState, e: PathChosen, out: Effects) -> None:
    node = s.choosing.pop(e.ckpt, 0)
    record = s.ckpts.get(e.ckpt)
    if record is None or record.path is not None or record.level not in IN_FLIGHT:
        return
    _commit(s, record, e.path, e.reason, e.loss, node, e.now, out)
    out.append(SaveState())


def _commit(s: CoordinatorState, record: CheckpointRecord, path: str, reason: str,
            loss: dict[str, float] | None, node: int, now: float, out: Effects) -> None:
    record.path = path
    record.flush = record.flush or path == "direct"  # the PFS is its only copy beyond memory
    out.append(Emit("committed", {"ckpt": record.id, "seq": record.seq, "marker_node": node,
                                  "nodes": len(s.nodes), "path": path, "reason": reason,
                                  "loss": loss}))
    out.append(Log("info", f"checkpoint {record.id}: path {path} ({reason})"))
    _announce(s, record, out, now)


def _announce(s: CoordinatorState, record: CheckpointRecord, out: Effects, now: float,
              rank: int | None = None) -> None:
    """To every agent the first time in this coordinator's life; later (a marker from
    each node that saw the checkpoint's marker, at scale) only to the one asking, else
    N markers cost N broadcasts."""
    msg = Commit(ckpt=record.id, seq=record.seq, global_files=record.global_files,
                 flush=record.flush, path=record.path)
    if rank is not None:
        out.append(Send(rank, msg))
        return
    s.announced[record.id] = now
    out.append(Broadcast(msg))


def _on_captured(s: CoordinatorState, e: Captured, out: Effects) -> None:
    record = s.ckpts.get(e.ckpt)
    if record is None or record.level not in IN_FLIGHT:
        return
    same = record.captured.get(str(e.node)) == e.manifest
    record.add_part(str(e.node), e.manifest)
    if e.text is None:
        record.captured_text.pop(str(e.node), None)
    else:
        record.captured_text[str(e.node)] = _member(str(e.node), e.text)
    if not same:        # a part reported again unchanged (a restart) keeps the manifest
        record.built = record.digest = None
    # each node's candidates from its own finished part (GlobalManifest.build keeps
    # those one node alone holds): the first marker saw one node's part only
    record.global_files = sorted({*record.global_files, *e.global_files})
    if e.mode != "copy":                    # status says why a part is not staged
        record.capture[str(e.node)] = {"mode": e.mode, "reason": e.reason}
    out.append(Observe("capture", e.ckpt, e.node, record.sizes[str(e.node)], e.duration))
    record.errors.pop(str(e.node), None)
    if record.level != "written":
        # every node had captured: this one restarted, maybe before the broadcast of
        # the digest reached it (without it, its erasure group never encodes)
        manifest = global_manifest(record, record.times, _wall(s, e.now))
        out.append(Send(s.nodes[e.node].rank, ManifestReady(record.id,
                                                            _digest(record, manifest))))
    _advance(s, record, e.now, out)


def _on_replicated(s: CoordinatorState, e: Replicated, out: Effects) -> None:
    # never node 0: this process is alive, whatever a partner saw during its stall
    newly = [d for d in e.dead if 0 < d < len(s.nodes) and not s.nodes[d].dead]
    for dead in newly:
        s.nodes[dead].dead = True
        out.append(Log("error", f"node {dead} taken for dead: node {e.node}'s replication"
                                f" waited agent.dead_after for it"))
    if newly:           # the reports that went to a dead parent come again by others
        out.append(Broadcast(Reroute()))
    record = s.ckpts.get(e.ckpt)
    if record is not None and record.level == "flushed" and e.ok and not e.adopted:
        _late_replica(s, record, e, out)
    if record is None or record.level in ENDED:
        return
    if e.ok:
        record.replicated[str(e.node)] = e.partners
        if _sampled(e):
            out.append(Observe("replicate", e.ckpt, e.node, record.node_bytes(e.node),
                               e.duration))
    else:
        record.replication_failed = True
        record.errors[str(e.node)] = "; ".join(e.errors.values())
    _advance(s, record, e.now, out)
    _try_finalize(s, record, e.now, out)        # every bundle may be in already


def _sampled(e: Replicated | Flushed) -> bool:
    """A duration the model learns from: not an adopted report, nor one of the nodes a
    `reduced` report carries no sample for (uplink.expand gives those 0)."""
    return not e.adopted and e.duration > 0


def _late_replica(s: CoordinatorState, record: CheckpointRecord, e: Replicated,
                  out: Effects) -> None:
    """A node's partner can finish its copy after every bundle is on the PFS (the
    flush of the stage runs beside replication): the copy exists, so `cachex status`
    counts it, and the model learns its time."""
    done = record.counts.get("replicated", 0)
    record.counts["replicated"] = min(len(s.nodes), done + 1)
    share = record.bytes // max(1, len(s.nodes))    # a finished record keeps no sizes
    out.append(Observe("replicate", e.ckpt, e.node, share, e.duration))
    out.append(SaveState())


def _advance(s: CoordinatorState, record: CheckpointRecord, now: float, out: Effects) -> None:
    """Move the level up as far as every node's reports allow."""
    nodes = len(s.nodes)
    if record.level == "written" and len(record.captured) == nodes:
        _reach(s, record, "captured", now, out)
        # the holders learn what the checkpoint is, long before the PFS does: what a
        # recovery needs when the coordinator's node is the one lost; every other
        # journal keeps a digest that does not grow with the job
        manifest = global_manifest(record, record.times, _wall(s, now))
        out.append(SaveGlobal(manifest))
        out.append(Hold(HoldManifest(record.id, manifest)))
        out.append(Broadcast(ManifestReady(record.id, _digest(record, manifest))))
    if (record.level == "captured" and len(record.replicated) == nodes
            and not record.replication_failed):
        _reach(s, record, "replicated", now, out)
        if not record.flush:    # its last level: the agents' older stage copies may go
            out.append(Broadcast(Protected(record.id)))


def _on_capture_failed(s: CoordinatorState, e: CaptureFailed, out: Effects) -> None:
    record = s.ckpts.get(e.ckpt)
    if record is not None and record.level == "written":
        _fail(s, record, f"node {e.node}: {e.error}", out)


def _on_flushed(s: CoordinatorState, e: Flushed, out: Effects) -> None:
    record = s.ckpts.get(e.ckpt)
    if record is None or record.level in ENDED:
        return
    record.flushed[str(e.node)] = e.bundle
    if _sampled(e):
        out.append(Observe("flush", e.ckpt, e.node, record.node_bytes(e.node), e.duration))
    record.errors.pop(str(e.node), None)
    record.progress.pop(str(e.node), None)
    _try_finalize(s, record, e.now, out)


def _on_flush_error(s: CoordinatorState, e: FlushError, out: Effects) -> None:
    record = s.ckpts.get(e.ckpt)
    if record is None:
        return
    record.errors[str(e.node)] = e.error
    if e.final and record.level in IN_FLIGHT:
        _fail(s, record, f"node {e.node}: flush impossible: {e.error}", out)


def _on_progress(s: CoordinatorState, e: Progress, out: Effects) -> None:
    record = s.ckpts.get(e.ckpt)
    if record is not None and record.level not in ("flushed", "failed"):
        record.progress[str(e.node)] = {"stage": e.stage, "done": e.done, "total": e.total}


def _on_evicted(s: CoordinatorState, e: Evicted, out: Effects) -> None:
    record = s.ckpts.get(e.ckpt)
    if record is not None and record.level in IN_FLIGHT:
        record.level = "evicted"
        _finish(s, record)
        out.append(SaveState())


def _on_unprotected(s: CoordinatorState, e: Unprotected, out: Effects) -> None:
    note = f"node {e.node}: {e.note}"
    s.unprotected.append({"ckpts": list(e.ckpts), "note": note})
    out.append(Emit("unprotected", {"node_reporting": e.node, "ckpts": list(e.ckpts),
                                    "note": note}))


def _on_superseded(s: CoordinatorState, e: Superseded, out: Effects) -> None:
    """Counted on the version the saves were made for (status shows it per name); a
    version the history forgot counts no more."""
    record = s.ckpts.get(e.ckpt)
    if record is not None:
        record.superseded += e.saves
    out.append(Emit("superseded", {"ckpt": e.ckpt, "name": trainer_name(e.ckpt),
                                   "by": e.newer, "saves": e.saves, "node_reporting": e.node}))


def _on_stop(s: CoordinatorState, e: Stop, out: Effects) -> None:
    s.stop_ack = e.token or s.stop_ack
    if s.phase != "running":
        return
    s.phase = "draining"
    s.drain_deadline = e.now + s.settings.drain_timeout
    newest = _newest(s, IN_FLIGHT)
    flush = [newest.id] if newest and not newest.flush else []
    if newest:
        newest.flush = True
    out.append(Emit("drain", {"requested_by": e.node, "flush": flush}))
    out.append(Broadcast(Drain(flush)))


def _on_drained(s: CoordinatorState, e: Drained, out: Effects) -> None:
    node = s.nodes[e.node]
    if not node.drained:
        node.drained = True
        s.drained += 1
    _exit_if_drained(s, out)


def _exit_if_drained(s: CoordinatorState, out: Effects) -> None:
    """Every agent drained, and no finalize is still out: an agent reports `drained`
    right after its last `flushed`, before the PFS took the global manifest."""
    if s.phase == "draining" and s.drained == len(s.nodes) and not s.finalizing:
        _exit(s, "every agent drained", out)


def _on_tick(s: CoordinatorState, e: Tick, out: Effects) -> None:
    if e.wall is not None:
        s.wall_offset = e.wall - e.now
    if s.reroute:       # one frame for every node found silent since the last tick
        s.reroute = False
        out.append(Broadcast(Reroute()))
    nodes = len(s.nodes)
    for record in list(s.ckpts.values()):
        if record.level == "written" and e.now > record.deadline:
            missing = sorted(set(range(nodes)) - {int(n) for n in record.captured})
            for node in missing:
                _suspect(s, node, e.now, f"capture of {record.id}", 0, out)
            _fail(s, record, f"nodes {missing} did not capture within"
                             f" {s.settings.commit_timeout:.0f}s", out)
        elif record.level in ("captured", "replicated") and len(record.flushed) == nodes:
            _try_finalize(s, record, e.now, out)   # a finalize that met a PFS fault
    if s.phase == "draining" and e.now > s.drain_deadline + s.settings.agent_timeout:
        silent = [n for n, node in enumerate(s.nodes) if not node.drained]
        _exit(s, f"drain timed out; agents {silent} did not report", out)
    since = e.now - s.last_status
    if (s.dirty and since >= STATUS_EVERY) or since >= HEARTBEAT:
        out.append(WriteStatus())
        s.dirty = False
        s.last_status = e.now


def _on_silence(s: CoordinatorState, e: Silence, out: Effects) -> None:
    """Node `e.node` waited on `e.peer` for `e.seconds` (its clock, net of its own
    stalls), or heard it again."""
    if not 0 <= e.peer < len(s.nodes):
        return
    if e.ended:
        _heard(s, e.peer, e.now, out)
    else:
        _suspect(s, e.peer, e.now - e.seconds, e.holds, e.node, out)


def _on_frames(s: CoordinatorState, e: Frames, out: Effects) -> None:
    """A node missed tree frames (its parent stalled holding them): it gets them again
    (a drain, a commit, an exit that would never have reached it)."""
    if e.first <= e.last:
        out.append(Resend(e.node, e.first, e.last))


def _on_heard(s: CoordinatorState, e: Heard, out: Effects) -> None:
    if 0 <= e.node < len(s.nodes):
        _heard(s, e.node, e.now, out)


def _suspect(s: CoordinatorState, node: int, since: float, holds: str, by: int,
             out: Effects) -> None:
    """Silent past agent.timeout: left out of the tree (its children report through
    others, it gets every frame directly) and named in status; not dead."""
    if node == 0:       # the coordinator's own node: what its partner saw was its stall
        return
    record = s.nodes[node]
    record.holds.setdefault(holds, by)
    if record.suspect is not None or record.dead:
        return
    record.suspect = since
    s.dirty = True
    out.append(Log("warning", f"node {node} silent (by node {by}'s clock) past"
                              f" agent.timeout: suspect, routed around; holds up {holds}"))
    out.append(Emit("node_suspect", {"node": node, "by": by, "holds": holds}))
    s.reroute = True    # its subtree's reports go around it from the next tick's frame


def _heard(s: CoordinatorState, node: int, now: float, out: Effects) -> None:
    """A suspect (or dead) node speaks: taken back; the next frame's tree has it."""
    record = s.nodes[node]
    if record.suspect is None and not record.dead:
        return
    silent = now - record.suspect if record.suspect is not None else None
    was = "dead" if record.dead else "suspect"
    record.suspect, record.dead, record.holds = None, False, {}
    s.dirty = True
    out.append(Log("info", f"node {node} ({was}) speaks again"
                           + (f" after {silent:.0f}s" if silent is not None else "")))
    out.append(Emit("node_back", {"node": node, "was": was,
                                  "seconds": round(silent, 3) if silent else None}))


def _on_finalize_done(s: CoordinatorState, e: FinalizeDone, out: Effects) -> None:
    s.finalizing.discard(e.ckpt)
    record = s.ckpts.get(e.ckpt)
    if record is None or record.level not in ("captured", "replicated"):
        return
    if e.error is not None:
        record.errors["coordinator"] = f"global manifest: {e.error}"
        out.append(Log("warning", f"finalize of {e.ckpt} failed: {e.error} (will retry)"))
        _exit_if_drained(s, out)        # drained: no retry to wait for
        return
    record.errors.pop("coordinator", None)
    # the journal keeps the copy of `captured` (same files): the PFS has this one
    digest = _digest(record, e.manifest)
    _reach(s, record, "flushed", e.now, out)
    out.append(Broadcast(Finalized(e.ckpt, digest)))
    if not _purge_pfs(s, out):
        out.append(WriteIndex())    # a snapshot taken while the finalize was out lacks it
    _exit_if_drained(s, out)


# ---------------------------------------------------------------------- helpers
def _reach(s: CoordinatorState, record: CheckpointRecord, level: str, now: float,
           out: Effects) -> None:
    record.level = level
    record.times[level] = _wall(s, now)
    # this life's monotonic clock; a checkpoint of an earlier life: the recorded times
    latency = (now - record.written_at if record.written_at is not None
               else record.times[level] - record.times["written"])
    out.append(Emit(f"level_{level}", {"ckpt": record.id, "seq": record.seq,
                                       "bytes": record.total_bytes(), "path": record.path,
                                       "latency": latency}))
    if level in FINAL:
        _finish(s, record)
    out.append(SaveState())


def _finish(s: CoordinatorState, record: CheckpointRecord) -> None:
    """A checkpoint no message moves on keeps its totals, not every node's manifest
    (those are in the global manifest; how a node captured, when not a plain copy,
    stays for `cachex status`): coordinator.json, rewritten at every level of every
    checkpoint, does not grow with nodes times checkpoints. Older finished ones than
    HISTORY (valid ones on the PFS excepted) are forgotten."""
    record.bytes = record.total_bytes()
    record.counts = {key: len(getattr(record, key))
                     for key in ("captured", "replicated", "flushed")}
    for key in NODE_MAPS:
        setattr(record, key, {})
    record.sizes, record.built, record.digest, record.captured_text = {}, None, None, {}
    record.total = None
    finished = sorted((r for r in s.ckpts.values() if r.level in FINAL[1:]),
                      key=lambda r: r.seq)
    for old in finished[:-HISTORY]:
        del s.ckpts[old.id]


def _fail(s: CoordinatorState, record: CheckpointRecord, reason: str, out: Effects) -> None:
    record.level = "failed"
    record.reason = reason
    _finish(s, record)
    out.append(Emit("failed", {"ckpt": record.id, "seq": record.seq, "reason": reason}))
    out.append(Log("error", f"checkpoint {record.id} failed: {reason}"))
    out.append(Broadcast(Failed(record.id, reason)))
    out.append(SaveState())
    out.append(WriteIndex())
    out.append(Purge([record.id]))      # bundles flushed before the failure: no checkpoint


def _try_finalize(s: CoordinatorState, record: CheckpointRecord, now: float,
                  out: Effects) -> None:
    if (record.level not in ("captured", "replicated") or len(record.flushed) < len(s.nodes)
            or record.id in s.finalizing or _replicating(record)):
        return
    s.finalizing.add(record.id)
    wall = _wall(s, now)
    manifest = global_manifest(record, {**record.times, "flushed": wall}, wall)
    rows = [*index_rows(s), Row(record.id, record.seq, "valid", record.total_bytes(), wall)]
    out.append(Finalize(record.id, manifest, rows))


def _replicating(record: CheckpointRecord) -> bool:
    """On the peer path the flush runs beside the replication, yet `flushed` is recorded
    after `replicated` (or after the replication failed): the levels stay in order, and
    an agent restarted meanwhile still finds its replication to resume (the checkpoint
    is not committed yet)."""
    return (record.path == "peer" and record.level == "captured"
            and not record.replication_failed)


def _purge_pfs(s: CoordinatorState, out: Effects) -> bool:
    """Keep the newest `keep.pfs` valid checkpoints; True if it purged (and so asked for
    an index write)."""
    keep = s.settings.keep_pfs
    valid = sorted((r for r in s.ckpts.values() if r.level == "flushed"), key=lambda r: r.seq)
    if keep == 0 or len(valid) <= keep:
        return False
    purged = valid[:-keep]
    for record in purged:
        record.level = "purged"
        _finish(s, record)
        out.append(Emit("purged", {"ckpt": record.id, "seq": record.seq, "level": "pfs"}))
    out.append(Purge([r.id for r in purged]))
    out.append(SaveState())
    out.append(WriteIndex())
    return True


def _exit(s: CoordinatorState, why: str, out: Effects) -> None:
    if s.phase == "stopped":
        return
    s.phase = "stopped"
    out.append(Emit("exit", {"reason": why}))
    out.append(Log("info", f"coordinator: {why}; agents exit"))
    # a suspect agent cannot join the window's collective free either
    out.append(Broadcast(Exit(list(skipped(s)))))
    out.append(WriteStatus())


def _wall(s: CoordinatorState, now: float) -> float:
    """The wall-clock time of the monotonic `now`: recorded and shown, never compared."""
    return now + s.wall_offset


def _newest(s: CoordinatorState, levels: tuple[str, ...]) -> CheckpointRecord | None:
    found = [r for r in s.ckpts.values() if r.level in levels]
    return max(found, key=lambda r: r.seq) if found else None


_HANDLERS: dict[type, Callable[[CoordinatorState, Any, Effects], None]] = {
    Marker: _on_marker, Captured: _on_captured, CaptureFailed: _on_capture_failed,
    Replicated: _on_replicated, Flushed: _on_flushed, FlushError: _on_flush_error,
    Progress: _on_progress, Evicted: _on_evicted, Unprotected: _on_unprotected,
    Superseded: _on_superseded,
    Stop: _on_stop, Drained: _on_drained, Tick: _on_tick, PathChosen: _on_path_chosen,
    FinalizeDone: _on_finalize_done, Silence: _on_silence, Heard: _on_heard,
    Frames: _on_frames}


# ----------------------------------------------------------- views of the state
def global_manifest(record: CheckpointRecord, times: dict[str, float],
                    now: float) -> GlobalManifest:
    """From the local manifests as they arrived (messages.decode checked each one); the
    finalize's shares the files of the one built at `captured` (they are the same)."""
    if record.built is None:
        bundles = {int(n): layout.bundle_name(int(n)) for n in record.captured}
        record.built = GlobalManifest.from_parts(list(record.captured.values()),
                                                 record.global_files, times, bundles, now)
        return record.built
    return replace(record.built, times=dict(times), committed_at=now)


def _digest(record: CheckpointRecord, manifest: GlobalManifest) -> ManifestDigest:
    """Once per checkpoint: the files, and so the hash, do not change after `captured`."""
    if record.digest is None:
        record.digest = manifest.digest()
    return record.digest


def index_rows(s: CoordinatorState) -> list[Row]:
    return [Row(r.id, r.seq, state_of_level(r.level), r.total_bytes(), r.times.get("flushed"))
            for r in s.ckpts.values() if r.level in ("flushed", "failed", "purged")]


def notes(s: CoordinatorState) -> list[str]:
    """What agents left unprotected, unless another node's marker committed it since."""
    return [u["note"] for u in s.unprotected if not all(c in s.ckpts for c in u["ckpts"])]


def skipped(s: CoordinatorState) -> tuple[int, ...]:
    """The nodes the tree leaves out (dead or suspect), sorted: relay.Route's skip."""
    return tuple(n for n, node in enumerate(s.nodes) if node.skipped)


def silent_rows(s: CoordinatorState, now: float, fanout: int) -> list[dict[str, Any]]:
    """Every suspect or dead node: for how long (this clock), who found it, and what
    waits on it: the next level of each checkpoint in flight it has not reported, the
    reports of the subtree it relays (now sent around it), its partners' replication."""
    skip = skipped(s)
    rows = []
    for n in skip:
        node = s.nodes[n]
        others = tuple(x for x in skip if x != n)
        rows.append({"node": n, "state": "dead" if node.dead else "suspect",
                     "seconds": round(now - node.suspect, 1) if node.suspect is not None
                     else None, "by": sorted(set(node.holds.values())),
                     "holds": sorted(node.holds),
                     "relays_for": relay.children(n, len(s.nodes), fanout, others),
                     "subtree": relay.subtree(n, len(s.nodes), fanout, others) - 1,
                     "waiting": [f"{r.id} {level}" for r in s.ckpts.values()
                                 if (level := _held_level(r, n)) is not None]})
    return rows


def _held_level(r: CheckpointRecord, node: int) -> str | None:
    """The level of an in-flight checkpoint that waits on `node`'s report, if any."""
    if r.level not in IN_FLIGHT:
        return None
    for level in LEVELS[LEVELS.index(r.level) + 1:]:
        if level == "flushed" and not r.flush:
            return None
        if level in NODE_MAPS and str(node) not in getattr(r, level):
            return level
    return None


def status_rows(s: CoordinatorState) -> list[dict[str, Any]]:
    """Every checkpoint's row of status.json; the maps are copied (another thread
    writes it)."""
    return [{"id": r.id, "seq": r.seq, "level": r.level, "bytes": r.total_bytes(),
             "times": dict(r.times), "nodes_captured": r.count("captured"),
             "nodes_replicated": r.count("replicated"), "nodes_flushed": r.count("flushed"),
             "flush": r.flush, "path": r.path, "rule": r.rule, "errors": dict(r.errors),
             "capture": dict(r.capture), "progress": dict(r.progress), "reason": r.reason,
             **({"superseded": r.superseded} if r.superseded else {})}
            for r in sorted(s.ckpts.values(), key=lambda r: r.seq)]


def state_json(s: CoordinatorState) -> dict[str, Any]:
    """coordinator.json."""
    return {"version": 1, "next_seq": s.next_seq,
            "ckpts": {key: r.to_json() for key, r in s.ckpts.items()}}


def state_text(s: CoordinatorState) -> bytes:
    """coordinator.json as written: `state_json`, compact, with each node's manifest
    taken from the text encoded when it was first written (CheckpointRecord)."""
    ckpts = ",".join(f"{compact_json(key)}:{_record_text(r)}" for key, r in s.ckpts.items())
    return f'{{"ckpts":{{{ckpts}}},"next_seq":{s.next_seq},"version":1}}\n'.encode()


def _record_text(r: CheckpointRecord) -> str:
    data = r.to_json()
    captured = data.pop("captured")
    texts = r.captured_text
    for node, manifest in captured.items():
        if node not in texts:
            texts[node] = _member(node, compact_json(manifest))
    parts = ",".join(texts[node] for node in captured)
    return f'{compact_json(data)[:-1]},"captured":{{{parts}}}}}'


def _member(node: str, text: str) -> str:
    """One node's manifest as a member of the `captured` object of coordinator.json."""
    return f"{compact_json(node)}:{text}"


def part_bytes(manifest: dict[str, Any]) -> int:
    return sum(e["size"] for e in manifest["files"])
