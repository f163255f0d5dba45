"""The messages agents exchange, typed, and the MPI tags they travel on.

Control messages are small dataclasses that travel as dicts (`{"type": name, **fields}`,
pickled by mpi4py's lowercase calls); bulk bytes never do: they move by Put into a
window or by Isend/Irecv of numpy buffers on the data tags. What arrives from another
rank is hostile until `decode` has checked it: the type must be known on that tag, every
field the type needs present and of the right kind, every name that reaches a path
(checkpoint ids, file paths, node numbers, manifests) safe (safepath.py). Anything else
raises UnsafeInput, which the agent refuses with one line.

Protocols (docs/architecture.md draws them):
  Tag.RELAY        coordinator -> agents: Commit, ManifestReady, Protected, Finalized,
                   Failed, Drain, Reroute, Exit down the broadcast tree, HoldManifest
                   down the holders' chain (relay.py: serialized once, forwarded as
                   bytes)
  Tag.COORDINATOR  coordinator -> one agent: Commit again (a restarted agent);
                   agents -> coordinator: the reports (REPORTS, checked by
                   report_of: decisions.decide's events as they came); all but `captured`
                   go up the tree as a `batch` to the node's parent (uplink.py)
  Tag.PEER         replication between an owner and its partner: Begin, File, Slot, End
                   (owner -> partner), Credit, Ack (partner -> owner); GlobalFile headers
  Tag.GLOBAL_DATA  a global file's bytes after its GlobalFile header (peer/globals.py)
  Tag.RECOVERY     file bytes between the ranks of `cachex recover` (recovery/transfer.py)
  Tag.RECOVERY_STOP  a 1-byte word each way before each file of such a transfer: go on,
                   or stop (a signal on either end)
  Tag.ARRIVE       the bounded start-up agreement (collective.py)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any, ClassVar

from .errors import OperationError
from .fsutil import compact_json
from .manifest import FileEntry, GlobalManifest, LocalManifest, ManifestDigest
from .safepath import UnsafeInput, checkpoint_id, index, relative_path, relative_paths


class Tag(IntEnum):
    COORDINATOR = 7
    PEER = 8
    GLOBAL_DATA = 9
    RELAY = 10
    RECOVERY = 21
    RECOVERY_STOP = 22
    ARRIVE = 31


# ------------------------------------------------------- coordinator -> agents
@dataclass(frozen=True, slots=True)
class Commit:
    """`ckpt` is committed: capture it (then replicate, and flush when `flush`)."""
    TYPE: ClassVar[str] = "commit"
    ckpt: str
    seq: int
    flush: bool
    path: str = "peer"
    global_files: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ManifestReady:
    """Every node captured `ckpt`: the digest of its global manifest, for every journal
    (its size does not grow with the job; the whole manifest goes to the holders)."""
    TYPE: ClassVar[str] = "manifest"
    ckpt: str
    digest: ManifestDigest


@dataclass(frozen=True, slots=True)
class HoldManifest:
    """To the metadata holders only: `ckpt`'s whole global manifest, for their journals
    (what a recovery needs when the coordinator's node is the one lost)."""
    TYPE: ClassVar[str] = "hold"
    ckpt: str
    manifest: GlobalManifest


@dataclass(frozen=True, slots=True)
class Protected:
    """`ckpt`, which flush.every leaves out of the flush, holds `replicated` on every
    node: the stage copies of older ones that are not flushed may go (retention.py)."""
    TYPE: ClassVar[str] = "protected"
    ckpt: str


@dataclass(frozen=True, slots=True)
class Finalized:
    """Global manifest and index of `ckpt` are durable on the PFS (level flushed)."""
    TYPE: ClassVar[str] = "finalized"
    ckpt: str
    digest: ManifestDigest


@dataclass(frozen=True, slots=True)
class Failed:
    """`ckpt` can never be whole: every stage of it stops."""
    TYPE: ClassVar[str] = "failed"
    ckpt: str
    reason: str


@dataclass(frozen=True, slots=True)
class Drain:
    """Finish pending work (flush the checkpoints in `flush`), then report drained."""
    TYPE: ClassVar[str] = "drain"
    flush: list[str]


@dataclass(frozen=True, slots=True)
class Reroute:
    """A node was found dead: the frame's route, which leaves it out, is the news. Each
    agent's reports go to its parent in the new tree, those of the checkpoints in
    flight again (uplink.py), not to a parent that died holding them."""
    TYPE: ClassVar[str] = "reroute"


@dataclass(frozen=True, slots=True)
class Exit:
    """Every agent drained (or the drain timed out); `dead` agents will not answer."""
    TYPE: ClassVar[str] = "exit"
    dead: list[int] = field(default_factory=list)


# ----------------------------------------------------------- owner <-> partner
@dataclass(frozen=True, slots=True)
class Begin:
    """A checkpoint's part follows: its local manifest. `streamed`: the part is still
    being captured; the manifest names no files, each arrives as a File before its
    slots, and End carries the final manifest."""
    TYPE: ClassVar[str] = "begin"
    manifest: LocalManifest
    streamed: bool = False


@dataclass(frozen=True, slots=True)
class File:
    """File `file` (0, 1, ... in order) of a streamed part: its manifest entry."""
    TYPE: ClassVar[str] = "file"
    ckpt: str
    file: int
    path: str
    size: int
    mode: int
    checksum: str

    @property
    def entry(self) -> FileEntry:
        return FileEntry(self.path, self.size, self.mode, self.checksum)


@dataclass(frozen=True, slots=True)
class Slot:
    """`length` bytes of file `file` at `offset` are in the partner's window slot."""
    TYPE: ClassVar[str] = "slot"
    ckpt: str
    slot: int
    file: int
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class End:
    """Every byte of `ckpt` was put: verify and answer with an Ack. A streamed part
    ends with its final manifest (the replica is kept only if it names exactly the
    files received); without one, the owner abandons the stream."""
    TYPE: ClassVar[str] = "end"
    ckpt: str
    manifest: LocalManifest | None = None


@dataclass(frozen=True, slots=True)
class Credit:
    """The partner wrote the slot out: the owner may put into it again."""
    TYPE: ClassVar[str] = "credit"
    slot: int


@dataclass(frozen=True, slots=True)
class Ack:
    """The partner's copy of `ckpt` is durable and verified (`ok`), or why not;
    `mismatch`: the index (in the owner's manifest) of a file whose bytes arrived with
    another checksum, so the owner can say why (a file captured by link, rewritten)."""
    TYPE: ClassVar[str] = "ack"
    ckpt: str
    ok: bool
    error: str | None = None
    mismatch: int | None = None


@dataclass(frozen=True, slots=True)
class GlobalFile:
    """A global file (e.g. `.metadata`) of `ckpt`; its bytes follow on Tag.GLOBAL_DATA."""
    TYPE: ClassVar[str] = "global_file"
    ckpt: str
    path: str
    size: int
    checksum: str


# ------------------------------------------------------- agents -> coordinator
# An agent builds a report with `node` unset (the agent sets it as it sends:
# Agent._report); the fields marked ARRIVAL are the coordinator's own, set on
# arrival and never sent: `now` (its clock), `text` (a manifest as it came).
ARRIVAL = {"arrival": True}


@dataclass(frozen=True, slots=True, kw_only=True)
class Report:
    """What every report to the coordinator carries."""
    TYPE: ClassVar[str] = ""
    node: int = -1                      # the sender's (Agent._report sets it)
    now: float = field(default=0.0, metadata=ARRIVAL)   # the coordinator's clock


@dataclass(frozen=True, slots=True, kw_only=True)
class Marker(Report):
    """This node's commit rule saw `ckpt` committed (`rule`: which one)."""
    TYPE: ClassVar[str] = "marker"
    ckpt: str
    global_files: list[str] = field(default_factory=list)
    rule: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Captured(Report):
    """This node's part of `ckpt` is in its stage; `manifest` its local manifest (JSON
    form), `global_files` the node's own candidates; `fed_wait` the replication's part
    of `duration` (peer/feed.py)."""
    TYPE: ClassVar[str] = "captured"
    ckpt: str
    manifest: dict[str, Any]
    mode: str = "copy"
    reason: str = ""
    duration: float = 0.0
    global_files: list[str] = field(default_factory=list)
    fed_wait: float = 0.0
    text: str | None = field(default=None, metadata=ARRIVAL)


@dataclass(frozen=True, slots=True, kw_only=True)
class CaptureFailed(Report):
    TYPE: ClassVar[str] = "capture_failed"
    ckpt: str
    error: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Replicated(Report):
    """This node's protection of `ckpt` ended: `ok`, or `errors` by partner node;
    `dead`: the nodes it found gone; `adopted`: a restart's report of one done before."""
    TYPE: ClassVar[str] = "replicated"
    ckpt: str
    ok: bool
    partners: list[int] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    dead: list[int] = field(default_factory=list)
    duration: float = 0.0
    adopted: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Flushed(Report):
    TYPE: ClassVar[str] = "flushed"
    ckpt: str
    bundle: str
    adopted: bool = False
    duration: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class FlushError(Report):
    """A flush attempt failed; `final`: no more retries (else the next in `retry_in`)."""
    TYPE: ClassVar[str] = "flush_error"
    ckpt: str
    error: str
    final: bool = False
    retry_in: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Progress(Report):
    TYPE: ClassVar[str] = "progress"
    ckpt: str
    stage: str
    done: int
    total: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Evicted(Report):
    TYPE: ClassVar[str] = "evicted"
    ckpt: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Unprotected(Report):
    """Checkpoints in this node's spool it will not protect (older than it knows)."""
    TYPE: ClassVar[str] = "unprotected"
    ckpts: list[str]
    note: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Superseded(Report):
    """`saves` of this node's saves counted for the version `ckpt` never became part of
    a version: a newer save of its own replaced them first (`newer`: the version that
    carries it, None when none does yet), or `ckpt` was captured here before them."""
    TYPE: ClassVar[str] = "superseded"
    ckpt: str
    newer: str | None = None
    saves: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Stop(Report):
    """A stop was asked of this node (`token`: of a `cachex stop` file, else None)."""
    TYPE: ClassVar[str] = "stop"
    token: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Drained(Report):
    """This node finished its drain; `unflushed`: what it could not flush."""
    TYPE: ClassVar[str] = "drained"
    unflushed: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True, kw_only=True)
class Silence(Report):
    """Node `peer` has sent this node nothing for `seconds` (this node's clock, net of
    its own stalls: liveness.py), past `agent.timeout`; `holds`: what of this node's
    waits on it (`reports` of a relay's subtree, `replication` to a partner). `ended`:
    it spoke again after such a report."""
    TYPE: ClassVar[str] = "silence"
    peer: int
    seconds: float
    ended: bool = False
    holds: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Frames(Report):
    """Relay frames `first`..`last` never reached this node (they went to a parent that
    stalled holding them, relay.Numbers): the coordinator sends them again, directly."""
    TYPE: ClassVar[str] = "frames"
    first: int
    last: int


@dataclass(frozen=True, slots=True)
class FileCaptured:
    """Inside one agent: the capture thread copied file `index` of a part into
    `partial` (renamed to `final` once the part is whole); `header` is the part's
    manifest without files. The replicator may stream it before the capture ends."""
    header: LocalManifest
    index: int
    entry: FileEntry
    partial: Path
    final: Path


@dataclass(frozen=True, slots=True)
class ToNode:
    """Inside one agent: a worker thread asks the main thread to send `message` to the
    agent of `node` on Tag.PEER (worker threads never call MPI)."""
    node: int
    message: Any


TO_AGENT: dict[str, type] = {c.TYPE: c for c in (
    Commit, ManifestReady, HoldManifest, Protected, Finalized, Failed, Drain, Reroute, Exit)}
PEER: dict[str, type] = {c.TYPE: c for c in (
    Begin, File, Slot, End, Credit, Ack, GlobalFile)}
REPORTS: dict[str, type] = {c.TYPE: c for c in (
    Marker, Captured, CaptureFailed, Replicated, Flushed, FlushError, Progress, Evicted,
    Unprotected, Superseded, Stop, Drained, Silence, Frames)}
TO_COORDINATOR = frozenset(REPORTS)
MAX_BATCH = 1 << 20      # reports in one batch: every node of a 100,000-node job, ten times
MAX_SAMPLES = 64         # durations in a reduced report (uplink.SAMPLES sends 8)


def wire(message: Any) -> dict[str, Any]:
    """What travels: a typed message as a dict (manifests as their JSON form, a report's
    manifest as its compact JSON text, the fields set on arrival left out); a dict (a
    batch of reports on its way up) as it is."""
    if isinstance(message, dict):
        return message
    fields = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)
              if not f.metadata.get("arrival")}
    for name, value in fields.items():
        if isinstance(value, GlobalManifest):
            # the holders' copy: its JSON text, encoded once for the journal, the PFS
            # and this send (pickling the O(nodes) dict again cost as much as encoding)
            fields[name] = value.encoded()
        elif isinstance(value, (LocalManifest, ManifestDigest)):
            fields[name] = value.to_json()
    if type(message) is Captured:
        # the coordinator keeps this text as it is (report_of, decisions.state_text)
        fields["manifest"] = compact_json(message.manifest).encode()
    return {"type": message.TYPE, **fields}


def decode(raw: Any, source: str, tag: Tag) -> Any:
    """The typed message that arrived on `tag` from `source` (a batch of reports: the
    checked dict, forwarded as it is). Raises UnsafeInput."""
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise UnsafeInput(f"{source}: not a cachex message: {_short(raw)}")
    name = raw["type"]
    if tag == Tag.COORDINATOR and name == "batch":
        return _checked_batch(raw, source)
    if tag == Tag.COORDINATOR and name in TO_COORDINATOR:
        return report_of(raw, source)
    kind = (TO_AGENT if tag in (Tag.COORDINATOR, Tag.RELAY) else PEER if tag == Tag.PEER
            else {}).get(name)
    if kind is None:
        raise UnsafeInput(f"{source}: unknown message type {name!r} on tag {tag.name}")
    fields = {k: v for k, v in raw.items() if k != "type"}
    names = {f.name for f in dataclasses.fields(kind)}
    required = {f.name for f in dataclasses.fields(kind)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    if not required <= fields.keys() or not fields.keys() <= names:
        raise UnsafeInput(f"{source}: {name} message with fields {sorted(fields)},"
                          f" expected {sorted(names)}")
    return kind(**_checked_fields(kind, fields, source))


def _checked_fields(kind: type, fields: dict[str, Any], source: str) -> dict[str, Any]:
    what = f"{source} ({kind.TYPE})"
    for name, value in fields.items():
        if name == "ckpt":
            checkpoint_id(value, what)
        elif name == "path":
            if kind in (GlobalFile, File):
                relative_path(value, what)
            elif value not in ("peer", "direct"):
                raise UnsafeInput(f"{what}: path must be peer or direct, not {_short(value)}")
        elif name == "global_files":
            relative_paths(_list(value, name, what), what, "global file path")
        elif name == "flush" and kind is Drain:
            _ckpts(value, name, what)
        elif name == "dead":
            _nodes(value, name, what)
        elif name in ("seq", "slot", "file", "offset", "length", "size", "mode"):
            _count(value, name, what)
        elif name == "mismatch" and value is not None:
            _count(value, name, what)
        elif name in ("flush", "ok", "streamed"):
            _flag(value, name, what)
        elif name in ("reason", "error"):
            _text_or_none(value, name, what)
        elif name == "checksum":
            _text(value, name, what)
    if "digest" in fields:
        fields["digest"] = ManifestDigest.from_json(fields["digest"], what, fields.get("ckpt"))
    if "manifest" in fields and (fields["manifest"] is not None or kind is not End):
        if kind in (Begin, End):
            fields["manifest"] = LocalManifest.from_json(fields["manifest"], what,
                                                         fields.get("ckpt"))
        else:
            fields["manifest"] = GlobalManifest.from_json(_json_object(fields["manifest"], what),
                                                          what, fields.get("ckpt"))
    return fields


def _json_object(value: Any, what: str) -> dict[str, Any]:
    """A manifest sent as its JSON text (bytes)."""
    if not isinstance(value, bytes):
        raise UnsafeInput(f"{what}: manifest must be JSON text, not {_short(value)}")
    try:
        # UTF-8 only (JSON's other encodings refused); no NaN or Infinity, which the
        # coordinator would keep verbatim where strict readers refuse them
        data = json.loads(value.decode(), parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:     # UnicodeDecodeError; nesting too deep
        raise UnsafeInput(f"{what}: manifest is not JSON ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise UnsafeInput(f"{what}: manifest is not a JSON object")
    return data


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number JSON knows")


def report_of(raw: dict[str, Any], source: str, now: float = 0.0) -> Report:
    """The typed report a dict from another rank stands for, checked as the messages to
    agents are: a known type, every field it needs and none it does not know, each of
    its kind, every name that reaches a path safe. `now`: the coordinator's clock at
    its arrival. Raises UnsafeInput."""
    kind = REPORTS.get(raw.get("type")) if isinstance(raw, dict) else None
    if kind is None:
        raise UnsafeInput(f"{source}: not a report: {_short(raw)}")
    what = f"{source} ({kind.TYPE})"
    fields = {k: v for k, v in raw.items() if k != "type"}
    names, required = _sent(kind)
    if not required <= fields.keys() or not fields.keys() <= names:
        raise UnsafeInput(f"{what}: fields {sorted(fields)}, expected {sorted(names)}"
                          f" with {sorted(required)}")
    for name, value in fields.items():
        _REPORT_FIELDS[name](value, name, what)
    if kind is Captured:
        text = fields["manifest"]
        fields["manifest"] = manifest = _json_object(text, what)
        try:
            LocalManifest.check_json(manifest, what, fields["ckpt"])
        except OperationError as exc:       # e.g. another format: the sender's fault
            raise UnsafeInput(str(exc)) from None
        # the text is what coordinator.json keeps (decisions.state_text): parsed and
        # checked here, never encoded again (a third of the coordinator's CPU)
        return kind(**fields, text=text.decode(), now=now)
    return kind(**fields, now=now)


@functools.cache
def _sent(kind: type) -> tuple[frozenset[str], frozenset[str]]:
    """The fields of a report that travel, and those it must carry (`node` always)."""
    sent = [f for f in dataclasses.fields(kind) if not f.metadata.get("arrival")]
    required = {f.name for f in sent if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING}
    return frozenset(f.name for f in sent), frozenset(required | {"node"})


def _text(value: Any, name: str, what: str) -> None:
    if not isinstance(value, str):
        raise UnsafeInput(f"{what}: {name} must be text, not {_short(value)}")


def _text_or_none(value: Any, name: str, what: str) -> None:
    if value is not None:
        _text(value, name, what)


def _flag(value: Any, name: str, what: str) -> None:
    if not isinstance(value, bool):
        raise UnsafeInput(f"{what}: {name} must be true or false, not {_short(value)}")


def _nodes(value: Any, name: str, what: str) -> None:
    for node in _list(value, name, what):
        index(node, what)


def _ckpts(value: Any, name: str, what: str) -> None:
    for ckpt in _list(value, name, what):
        checkpoint_id(ckpt, what)


def _errors(value: Any, name: str, what: str) -> None:
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise UnsafeInput(f"{what}: {name} must map text to text, not {_short(value)}")


def _parsed_after(value: Any, name: str, what: str) -> None:
    """A captured manifest: report_of parses and checks its text (_json_object)."""


def _checked_batch(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """Reports of a subtree on their way up (uplink.py): each one checked as if it came
    alone; a batch holds no batch."""
    what = f"{source} (batch)"
    index(raw.get("node"), what)
    reports = _list(raw.get("reports"), "reports", what)
    if len(reports) > MAX_BATCH:
        raise UnsafeInput(f"{what}: {len(reports)} reports, more than {MAX_BATCH}")
    for report in reports:
        kind = report.get("type") if isinstance(report, dict) else None
        if kind == "reduced":
            _checked_reduced(report, what)
        elif kind in TO_COORDINATOR and kind != "captured":
            report_of(report, what)
        else:
            raise UnsafeInput(f"{what}: not a report: {_short(report)}")
    return raw


def _checked_reduced(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """A subtree's reports of one level, reduced (uplink.reduce): runs of node numbers
    sorted and apart, a bounded sample of durations, the dead, a marker's files."""
    what = f"{source} (reduced)"
    index(raw.get("node"), what)
    if raw.get("kind") not in ("marker", "replicated", "flushed"):
        raise UnsafeInput(f"{what}: kind {_short(raw.get('kind'))}")
    checkpoint_id(raw.get("ckpt"), what)
    previous, total = -2, 0
    for run in _list(raw.get("runs"), "runs", what):
        if not isinstance(run, list) or len(run) != 2:
            raise UnsafeInput(f"{what}: run {_short(run)} is not [first, last]")
        first, last = index(run[0], what), index(run[1], what)
        if first <= previous + 1 or last < first:
            raise UnsafeInput(f"{what}: runs not sorted and apart at {run}")
        previous, total = last, total + last - first + 1
    if total > MAX_BATCH:
        raise UnsafeInput(f"{what}: {total} nodes, more than {MAX_BATCH}")
    samples = _list(raw.get("samples"), "samples", what)
    if len(samples) > MAX_SAMPLES:
        raise UnsafeInput(f"{what}: {len(samples)} samples, more than {MAX_SAMPLES}")
    for sample in samples:
        if not isinstance(sample, list) or len(sample) != 2:
            raise UnsafeInput(f"{what}: sample {_short(sample)} is not [node, seconds]")
        index(sample[0], what)
        _seconds(sample[1], "sample", what)
    _nodes(raw.get("dead", []), "dead", what)
    relative_paths(_list(raw.get("global_files", []), "global_files", what), what,
                   "global file path")
    if not isinstance(raw.get("rule"), (str, type(None))):
        raise UnsafeInput(f"{what}: rule must be text, not {_short(raw.get('rule'))}")
    return raw


def _seconds(value: Any, name: str, what: str) -> float:
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value < 0):
        raise UnsafeInput(f"{what}: {name} must be seconds >= 0, not {_short(value)}")
    return value


def _list(value: Any, name: str, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise UnsafeInput(f"{what}: {name} must be a list, not {_short(value)}")
    return value


def _count(value: Any, name: str, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UnsafeInput(f"{what}: {name} must be a count >= 0, not {_short(value)}")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


Check = Callable[[Any, str, str], object]
#: how each field of a report is checked (a field no report has is refused before)
_REPORT_FIELDS: dict[str, Check] = {
    "node": lambda v, _n, what: index(v, what),
    "ckpt": lambda v, _n, what: checkpoint_id(v, what),
    "newer": lambda v, _n, what: v is None or checkpoint_id(v, what),
    "saves": _count,
    "global_files": lambda v, n, what: relative_paths(_list(v, n, what), what,
                                                      "global file path"),
    "bundle": lambda v, _n, what: relative_path(v, what),
    "ckpts": _ckpts, "unflushed": _ckpts, "dead": _nodes, "partners": _nodes,
    "ok": _flag, "adopted": _flag, "final": _flag, "ended": _flag,
    "peer": lambda v, _n, what: index(v, what), "seconds": _seconds, "holds": _text,
    "error": _text, "reason": _text, "note": _text, "mode": _text, "stage": _text,
    "rule": _text_or_none, "token": _text_or_none, "errors": _errors,
    "duration": _seconds, "fed_wait": _seconds, "retry_in": _seconds,
    "done": _count, "total": _count, "first": _count, "last": _count,
    "manifest": _parsed_after,
}
