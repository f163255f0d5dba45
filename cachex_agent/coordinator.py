"""The coordinator (agent rank 0, the metadata host): global levels of every checkpoint.

It never moves data. It hears small messages from the agents (a commit marker seen,
a node's part captured or flushed, errors, progress), decides, and answers through
`send(rank, message)`. That keeps it free of MPI and testable in one process.

Protocol:
  agent  -> coord  marker      an agent saw the commit marker of `ckpt` in its spool
  coord  -> all    commit      `ckpt` is committed (seq, global files, flush or not)
  agent  -> coord  captured    this node's part is in its stage (local manifest)
  agent  -> coord  replicated  this node's partners hold verified copies (or why not)
  agent  -> coord  flushed     this node's bundle is durable on the PFS
  coord  -> all    manifest    every node captured: the global manifest, for every journal
  coord  -> all    finalized   global manifest and index committed (level "flushed")
  coord  -> all    failed      `ckpt` can never be whole: drop it
  agent  -> coord  stop        a user asked to stop (signal, `cachex stop`)
  coord  -> all    drain       finish pending work, then report `drained`
  coord  -> all    exit        every agent drained (or the drain timed out)
  agent  -> coord  unprotected committed checkpoints an agent found at start and left

`status.json` carries a heartbeat (time, pid, host, period), rewritten at least every
HEARTBEAT seconds while the coordinator runs: readers tell live agents from a status
file that dead ones left behind (status.py).

A level is recorded only when every node's part holds it; the global manifest is
written last, after every bundle is durable, and only then is the index updated.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import layout
from .config import Config
from .events import EventLog
from .fsutil import makedirs, remove_under, write_json
from .index import Index, Row, read_index, state_of_level, write_index
from .journal import Journal
from .manifest import GlobalManifest, LocalManifest
from .model.choose import PathChooser
from .safepath import checkpoint_id, relative_paths

log = logging.getLogger(__name__)
Send = Callable[[int, dict[str, Any]], None]
LEVELS = ("written", "captured", "replicated", "flushed")   # plus failed, evicted, purged
IN_FLIGHT = LEVELS[:-1]
HEARTBEAT = 2.0     # seconds between status writes of a running coordinator, at most
FINAL = ("flushed", "failed", "evicted", "purged")  # no message moves these on
# Finished checkpoints (failed, evicted, purged) the journal, status and index keep, newest
# first: enough for an agent that restarted with a stale entry, and the files stay bounded.
HISTORY = 16


class Coordinator:
    def __init__(self, config: Config, ranks_by_node: list[int], journal: Journal,
                 pfs_run: Path, events: EventLog, send: Send,
                 clock: Callable[[], float] = time.time, can_replicate: bool = True) -> None:
        self.config = config
        self.ranks = ranks_by_node
        self.journal = journal
        self.pfs_run = pfs_run
        self.events = events
        self.send = send
        self.clock = clock
        saved = journal.read(layout.COORDINATOR_STATE)
        source = journal.root / layout.COORDINATOR_STATE
        if not saved:
            saved, source = self._from_index(), layout.index_path(pfs_run)
        self.ckpts: dict[str, dict[str, Any]] = _checked_records(saved.get("ckpts", {}),
                                                                 source)
        for record in self.ckpts.values():
            record.setdefault("path", "peer")   # journals from before the path choice
            if record["level"] == "written":    # no agent could capture while none ran
                record["deadline"] = self._capture_deadline()
        self.next_seq: int = saved.get("next_seq", 1)
        self.state = "running"
        self.drained: set[int] = set()
        self.dead: set[int] = set()         # agents that partners found unresponsive
        self.drain_deadline = 0.0
        self.dirty = True
        self._last_status = 0.0
        self.unprotected: list[dict[str, Any]] = []     # what agents left at start, why
        self.announced: set[str] = set()    # told to every agent by this coordinator
        self.chooser = PathChooser(config, len(ranks_by_node), can_replicate)

    def _from_index(self) -> dict[str, Any]:
        """A coordinator without a journal (its node was replaced) learns from the PFS
        what was flushed, so it neither re-flushes nor reuses sequence numbers."""
        try:
            rows = read_index(self.pfs_run).checkpoints
        except (OSError, ValueError):       # none, or not an index: an unsafe one raises
            return {}
        ckpts = {row.id: _empty_record(row.id, row.seq, row.level, bytes=row.bytes,
                                       times={"flushed": row.flushed_at})
                 for row in rows}
        return {"ckpts": ckpts, "next_seq": max((r.seq for r in rows), default=0) + 1}

    @property
    def nodes(self) -> int:
        return len(self.ranks)

    # ----------------------------------------------------------------- messages
    def handle(self, node: int, msg: dict[str, Any]) -> None:
        handler = getattr(self, f"_on_{msg['type']}", None)
        if handler is None:
            log.warning("coordinator: unknown message %r from node %d", msg["type"], node)
            return
        handler(node, msg)
        self.dirty = True

    def _on_marker(self, node: int, msg: dict[str, Any]) -> None:
        ckpt = msg["ckpt"]
        if ckpt in self.ckpts:
            record = self.ckpts[ckpt]
            if record["level"] in IN_FLIGHT:    # an agent restarted: it may need it again
                self._announce(record, self.ranks[node] if ckpt in self.announced else None)
            return
        if self.state != "running":
            return
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        every = self.config.flush.every
        newest = self._newest(LEVELS[1:])         # its size stands for this one's
        choice = self.chooser.choose(_record_bytes(newest) if newest else 0, self.clock())
        direct = choice.path == "direct"        # the PFS is its only copy beyond memory
        record = _empty_record(ckpt, seq, "written", global_files=msg["global_files"],
                               rule=msg.get("rule"),  # which commit rule saw it (status)
                               flush=direct or (seq - 1) % every == 0, path=choice.path,
                               times={"written": msg.get("t", self.clock())},
                               deadline=self._capture_deadline())
        self.ckpts[ckpt] = record
        self.events.emit("committed", ckpt=ckpt, seq=seq, marker_node=node, nodes=self.nodes,
                         path=choice.path, reason=choice.reason, loss=choice.loss)
        log.info("checkpoint %s: path %s (%s)", ckpt, choice.path, choice.reason)
        self._announce(record)
        self._persist()

    def _capture_deadline(self) -> float:
        return self.clock() + self.config.commit.timeout + self.config.agent.timeout

    def _announce(self, record: dict[str, Any], rank: int | None = None) -> None:
        """To every agent the first time in this coordinator's life; later (a marker from
        each node that saw the checkpoint's marker, at scale) only to the one asking, else
        N markers cost N broadcasts."""
        msg = {"type": "commit", "ckpt": record["id"], "seq": record["seq"],
               "global_files": record["global_files"], "flush": record["flush"],
               "path": record["path"]}
        if rank is not None:
            self.send(rank, msg)
            return
        self.announced.add(record["id"])
        self._broadcast(msg)

    def _on_captured(self, node: int, msg: dict[str, Any]) -> None:
        record = self.ckpts.get(msg["ckpt"])
        if record is None or record["level"] not in IN_FLIGHT:
            return
        record["captured"][str(node)] = msg["manifest"]
        # each node's candidates from its own finished part (GlobalManifest.build keeps
        # those one node alone holds): the first marker saw one node's part only
        record["global_files"] = sorted({*record["global_files"], *msg.get("global_files", [])})
        if msg.get("mode", "copy") != "copy":   # status says why a part is not staged
            record.setdefault("capture", {})[str(node)] = {"mode": msg["mode"],
                                                           "reason": msg.get("reason", "")}
        self.chooser.observe("capture", msg["ckpt"], node, _part_bytes(msg["manifest"]),
                             msg.get("duration", 0.0))
        record["errors"].pop(str(node), None)
        self._advance(record)

    def _on_replicated(self, node: int, msg: dict[str, Any]) -> None:
        self.dead.update(msg.get("dead", []))
        record = self.ckpts.get(msg["ckpt"])
        if record is None or record["level"] in ("failed", "purged", "flushed"):
            return
        if msg["ok"]:
            record.setdefault("replicated", {})[str(node)] = msg["partners"]
            self.chooser.observe("replicate", record["id"], node, _node_bytes(record, node),
                                 msg.get("duration", 0.0))
        else:
            record["replication_failed"] = True
            record["errors"][str(node)] = "; ".join(msg["errors"].values())
        self._advance(record)

    def _advance(self, record: dict[str, Any]) -> None:
        """Move the level up as far as every node's reports allow."""
        if record["level"] == "written" and len(record["captured"]) == self.nodes:
            self._reach(record, "captured")
            # every journal learns what the checkpoint is, long before the PFS does:
            # what a recovery needs when the coordinator's node is the one lost
            manifest = self._global_manifest(record)
            self.journal.save_global(manifest)
            self._broadcast({"type": "manifest", "ckpt": record["id"],
                             "manifest": manifest.to_json()})
        if (record["level"] == "captured" and len(record.get("replicated", {})) == self.nodes
                and not record.get("replication_failed")):
            self._reach(record, "replicated")

    def _on_capture_failed(self, node: int, msg: dict[str, Any]) -> None:
        record = self.ckpts.get(msg["ckpt"])
        if record is not None and record["level"] == "written":
            self._fail(record, f"node {node}: {msg['error']}")

    def _on_flushed(self, node: int, msg: dict[str, Any]) -> None:
        record = self.ckpts.get(msg["ckpt"])
        if record is None or record["level"] in ("failed", "purged", "flushed"):
            return
        record["flushed"][str(node)] = msg["bundle"]
        if not msg.get("adopted"):
            self.chooser.observe("flush", record["id"], node, _node_bytes(record, node),
                                 msg.get("duration", 0.0))
        record["errors"].pop(str(node), None)
        record["progress"].pop(str(node), None)
        self._try_finalize(record)

    def _on_flush_error(self, node: int, msg: dict[str, Any]) -> None:
        record = self.ckpts.get(msg["ckpt"])
        if record is None:
            return
        record["errors"][str(node)] = msg["error"]
        if msg.get("final") and record["level"] in IN_FLIGHT:
            self._fail(record, f"node {node}: flush impossible: {msg['error']}")

    def _on_progress(self, node: int, msg: dict[str, Any]) -> None:
        record = self.ckpts.get(msg["ckpt"])
        if record is not None and record["level"] not in ("flushed", "failed"):
            record["progress"][str(node)] = {k: msg[k] for k in ("stage", "done", "total")}

    def _on_evicted(self, node: int, msg: dict[str, Any]) -> None:
        record = self.ckpts.get(msg["ckpt"])
        if record is not None and record["level"] in IN_FLIGHT:
            record["level"] = "evicted"
            self._finish(record)
            self._persist()

    def _on_unprotected(self, node: int, msg: dict[str, Any]) -> None:
        note = f"node {node}: {msg['note']}"
        self.unprotected.append({"ckpts": msg["ckpts"], "note": note})
        self.events.emit("unprotected", node_reporting=node, ckpts=msg["ckpts"], note=note)

    def _notes(self) -> list[str]:
        """What agents left unprotected, unless another node's marker committed it since."""
        return [u["note"] for u in self.unprotected
                if not all(c in self.ckpts for c in u["ckpts"])]

    def _on_stop(self, node: int, msg: dict[str, Any]) -> None:
        if self.state != "running":
            return
        self.state = "draining"
        self.drain_deadline = self.clock() + self.config.flush.drain_timeout
        newest = self._newest(IN_FLIGHT)
        flush = [newest["id"]] if newest and not newest["flush"] else []
        if newest:
            newest["flush"] = True
        self.events.emit("drain", requested_by=node, flush=flush)
        self._broadcast({"type": "drain", "flush": flush})

    def _on_drained(self, node: int, msg: dict[str, Any]) -> None:
        self.drained.add(node)
        if len(self.drained) == self.nodes:
            self._exit("every agent drained")

    # ------------------------------------------------------------------- timers
    def tick(self) -> None:
        now = self.clock()
        for record in list(self.ckpts.values()):
            if record["level"] == "written" and now > record["deadline"]:
                missing = sorted(set(range(self.nodes)) - {int(n) for n in record["captured"]})
                self._fail(record, f"nodes {missing} did not capture within"
                                   f" {self.config.commit.timeout:.0f}s")
            elif (record["level"] in ("captured", "replicated")
                  and len(record["flushed"]) == self.nodes):
                self._try_finalize(record)          # a finalize that met a PFS fault
        if self.state == "draining" and now > self.drain_deadline + self.config.agent.timeout:
            self._exit(f"drain timed out; agents {sorted(set(range(self.nodes)) - self.drained)}"
                       " did not report")
        since = now - self._last_status
        if (self.dirty and since >= 0.5) or since >= HEARTBEAT:
            self.write_status()

    # ---------------------------------------------------------------- decisions
    def _reach(self, record: dict[str, Any], level: str) -> None:
        record["level"] = level
        record["times"][level] = self.clock()
        self.events.emit(f"level_{level}", ckpt=record["id"], seq=record["seq"],
                         bytes=_record_bytes(record), path=record["path"],
                         latency=record["times"][level] - record["times"]["written"])
        if level in FINAL:
            self._finish(record)
        self._persist()

    def _finish(self, record: dict[str, Any]) -> None:
        """A checkpoint no message moves on keeps its totals, not every node's manifest
        (those are in the global manifest; how a node captured, when not a plain copy,
        stays for `cachex status`): coordinator.json, rewritten at every level
        of every checkpoint, does not grow with nodes times checkpoints. Older finished
        ones than HISTORY (valid ones on the PFS excepted) are forgotten."""
        record["bytes"] = _record_bytes(record)
        record["counts"] = {key: len(record.get(key, {}))
                            for key in ("captured", "replicated", "flushed")}
        for key in ("captured", "replicated", "flushed", "progress"):
            record[key] = {}
        finished = sorted((r for r in self.ckpts.values() if r["level"] in FINAL[1:]),
                          key=lambda r: r["seq"])
        for old in finished[:-HISTORY]:
            del self.ckpts[old["id"]]

    def _fail(self, record: dict[str, Any], reason: str) -> None:
        record["level"] = "failed"
        record["reason"] = reason
        self._finish(record)
        self.events.emit("failed", ckpt=record["id"], seq=record["seq"], reason=reason)
        log.error("checkpoint %s failed: %s", record["id"], reason)
        self._broadcast({"type": "failed", "ckpt": record["id"], "reason": reason})
        self._persist()
        self._write_index_quietly()

    def _try_finalize(self, record: dict[str, Any]) -> None:
        if record["level"] not in ("captured", "replicated") or len(record["flushed"]) < self.nodes:
            return
        record["times"]["flushed"] = self.clock()
        level_before = record["level"]
        manifest = self._global_manifest(record)
        try:
            makedirs(layout.pfs_ckpt_dir(self.pfs_run, record["id"]))
            write_json(layout.pfs_manifest_path(self.pfs_run, record["id"]), manifest.to_json(),
                       compact=True)
            record["level"] = "flushed"
            self._write_index()
        except OSError as exc:
            record["level"] = level_before
            record["errors"]["coordinator"] = f"global manifest: {exc.strerror or exc}"
            log.warning("finalize of %s failed: %s (will retry)", record["id"], exc)
            return
        record["errors"].pop("coordinator", None)
        self.journal.save_global(manifest)
        self._reach(record, "flushed")
        self._broadcast({"type": "finalized", "ckpt": record["id"],
                         "manifest": manifest.to_json()})
        self._purge_pfs()

    def _global_manifest(self, record: dict[str, Any]) -> GlobalManifest:
        parts = [LocalManifest.from_json(m) for m in record["captured"].values()]
        bundles = {int(n): layout.bundle_name(int(n)) for n in record["captured"]}
        return GlobalManifest.build(parts, record["global_files"], record["times"], bundles)

    def _purge_pfs(self) -> None:
        keep = self.config.keep.pfs
        valid = sorted((r for r in self.ckpts.values() if r["level"] == "flushed"),
                       key=lambda r: r["seq"])
        if keep == 0 or len(valid) <= keep:
            return
        for record in valid[:-keep]:
            remove_under(layout.pfs_ckpts_dir(self.pfs_run),
                         layout.pfs_ckpt_dir(self.pfs_run, record["id"]))
            record["level"] = "purged"
            self._finish(record)
            self.events.emit("purged", ckpt=record["id"], seq=record["seq"], level="pfs")
        self._persist()
        self._write_index_quietly()

    def _exit(self, why: str) -> None:
        if self.state == "stopped":
            return
        self.state = "stopped"
        self.events.emit("exit", reason=why)
        log.info("coordinator: %s; agents exit", why)
        self._broadcast({"type": "exit", "dead": sorted(self.dead)})
        self.write_status()

    # ------------------------------------------------------------ persistence
    def _newest(self, levels: tuple[str, ...]) -> dict[str, Any] | None:
        found = [r for r in self.ckpts.values() if r["level"] in levels]
        return max(found, key=lambda r: r["seq"]) if found else None

    def _broadcast(self, msg: dict[str, Any]) -> None:
        for rank in self.ranks:
            self.send(rank, msg)

    def _persist(self) -> None:
        self.journal.write(layout.COORDINATOR_STATE, {"version": 1, "next_seq": self.next_seq,
                                                      "ckpts": self.ckpts}, compact=True)

    def _write_index(self) -> None:
        rows = [Row(r["id"], r["seq"], state_of_level(r["level"]), _record_bytes(r),
                    r["times"].get("flushed"))
                for r in self.ckpts.values() if r["level"] in ("flushed", "failed", "purged")]
        write_index(self.pfs_run, Index.build(self.config.run, rows))

    def _write_index_quietly(self) -> None:
        try:
            self._write_index()
        except OSError as exc:
            log.warning("index.json not updated: %s", exc)

    def status(self) -> dict[str, Any]:
        rows = []
        for record in sorted(self.ckpts.values(), key=lambda r: r["seq"]):
            rows.append({
                "id": record["id"], "seq": record["seq"], "level": record["level"],
                "bytes": _record_bytes(record), "times": record["times"],
                "nodes_captured": _count(record, "captured"),
                "nodes_replicated": _count(record, "replicated"),
                "nodes_flushed": _count(record, "flushed"),
                "flush": record["flush"], "path": record["path"], "rule": record.get("rule"),
                "errors": record["errors"], "capture": record.get("capture", {}),
                "progress": record["progress"], "reason": record.get("reason")})
        now = self.clock()
        return {"format": "cachex-status", "version": 1, "run": self.config.run,
                "updated": now, "state": self.state, "nodes": self.nodes,
                "heartbeat": {"t": now, "pid": os.getpid(), "host": socket.gethostname(),
                              "period": HEARTBEAT},
                "notes": self._notes(), "checkpoints": rows}

    def write_status(self) -> None:
        """Into the journal always; onto the PFS when it takes writes."""
        status = self.status()
        self.journal.write(layout.STATUS, status)
        try:
            makedirs(self.pfs_run)
            write_json(layout.pfs_status_path(self.pfs_run), status)
        except OSError:
            pass
        self.dirty = False
        self._last_status = self.clock()


def _checked_records(ckpts: dict[str, dict[str, Any]], source: Path
                     ) -> dict[str, dict[str, Any]]:
    """Record ids name PFS directories that the coordinator writes and purges."""
    for key, record in ckpts.items():
        checkpoint_id(record.get("id"), source, key)
        relative_paths(record.get("global_files", []), source, f"global file of {key}")
    return ckpts


def _empty_record(ckpt: str, seq: int, level: str, **fields: Any) -> dict[str, Any]:
    return {"id": ckpt, "seq": seq, "level": level, "global_files": [], "flush": True,
            "path": "peer", "times": {}, "captured": {}, "replicated": {}, "flushed": {},
            "errors": {}, "progress": {}, **fields}


def _count(record: dict[str, Any], key: str) -> int:
    """Nodes that reported `key`, also of a finished record (its maps emptied)."""
    return len(record.get(key, {})) or record.get("counts", {}).get(key, 0)


def _part_bytes(manifest: dict[str, Any]) -> int:
    return sum(e["size"] for e in manifest["files"])


def _node_bytes(record: dict[str, Any], node: int) -> int:
    manifest = record["captured"].get(str(node))
    return _part_bytes(manifest) if manifest else 0


def _record_bytes(record: dict[str, Any]) -> int:
    if not record["captured"]:
        return record.get("bytes", 0)           # adopted from the PFS index
    return sum(_part_bytes(m) for m in record["captured"].values())

