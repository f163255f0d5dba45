"""Stage and level observations, read from the agents' event files (events.jsonl).

Every agent writes its own events; the coordinator's file also holds the checkpoint
levels. Each node's events are also appended to its log on the PFS with every flush
(events.EventCopy, layout.pfs_events_path), so a node whose disk is gone still has its
history there. A node's files (its own, its PFS log, a restarted agent's repeats) are
one stream: merged, repeated lines dropped, in time order. From them:

  stage samples  one per (checkpoint, node, stage): bytes of that node's part, seconds
    write      the trainer's write: first sight of the checkpoint directory -> commit
    capture    `capture_start` -> `captured` (the event's own duration)
    replicate  `replicate_start` -> `replicated` on the owner
    flush      `flush_start` -> `flushed` (bundles adopted after a restart are left out)
  node levels    one per (checkpoint, node, level), as stage samples named "<level>:<path>"
    (e.g. "flushed:peer"): from the commit to this node's part holding the level, its
    stages and any wait between them together
  level samples  one per (checkpoint, level): the whole checkpoint's bytes and the
    latency from commit to the level holding on every node (the coordinator's events)
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import Config, render
from ..errors import OperationError
from ..events import read_events
from ..layout import (
    EVENTS,
    PFS_EVENTS_DIR,
    PFS_EVENTS_SUFFIX,
    events_path,
    journal_dir,
    pfs_events_paths,
    run_dir,
)

STAGES = ("write", "capture", "replicate", "flush")
LEVELS = ("captured", "replicated", "flushed")


@dataclass(frozen=True)
class StageSample:
    run: str
    ckpt: str
    node: int
    nodes: int
    stage: str
    bytes: int
    seconds: float
    end: float          # wall-clock time the stage ended (for timelines)
    path: str
    load: float | None = None   # the node's load per core when the stage ended


@dataclass(frozen=True)
class LevelSample:
    run: str
    ckpt: str
    seq: int
    nodes: int
    level: str
    bytes: int
    latency: float      # seconds from commit to the level holding on every node
    committed: float    # wall-clock time of the commit
    path: str
    load: float | None = None   # the coordinator node's load per core at the commit


@dataclass
class History:
    stages: list[StageSample] = field(default_factory=list)
    levels: list[LevelSample] = field(default_factory=list)
    sources: list[Path] = field(default_factory=list)

    def stage(self, name: str, path: str | None = None) -> list[StageSample]:
        return [s for s in self.stages if s.stage == name and path in (None, s.path)]

    def level(self, name: str, path: str | None = None) -> list[LevelSample]:
        return [s for s in self.levels if s.level == name and path in (None, s.path)]

    def of(self, run: str, ckpt: str) -> list[StageSample]:
        return [s for s in self.stages if s.run == run and s.ckpt == ckpt]


def event_files(paths: Iterable[Path]) -> list[Path]:
    """Event files named directly, or found under directories (recursively)."""
    found: list[Path] = []
    for path in paths:
        if path.is_file():
            found.append(path)
        elif path.is_dir():
            found.extend(sorted(path.rglob(EVENTS)))
            found.extend(sorted(path.rglob(f"{PFS_EVENTS_DIR}/node-*{PFS_EVENTS_SUFFIX}")))
        else:
            raise OperationError(f"{path}: no such file or directory")
    return found


def config_event_files(config: Config) -> list[Path]:
    """Every node's event file of the configured run: the cache template, any node; then
    the nodes' logs on the PFS (what a lost node's disk held)."""
    values = {"node": "*", "rank": "*", "host": "*", "run": config.run, "job": "*"}
    cache = Path(render(config.paths.cache, values, "paths.cache"))
    local = _glob(events_path(journal_dir(run_dir(cache, config.run))))
    pfs = Path(render(config.paths.pfs, values, "paths.pfs"))
    return local + [path for root in _glob(run_dir(pfs, config.run))
                    for path in pfs_events_paths(root)]


def _glob(pattern: Path) -> list[Path]:
    root = Path(pattern.anchor)
    return sorted(root.glob(str(pattern.relative_to(root))))


def load_history(files: Iterable[Path]) -> History:
    history = History()
    paths: dict[tuple[str, str], str] = {}          # (run, ckpt) -> path
    commits: dict[tuple[str, str], float] = {}
    files = list(files)
    history.sources.extend(files)
    per_node = node_streams(files)
    for records in per_node:
        for rec in records:
            if rec.get("event") == "committed":
                paths[(rec.get("run", ""), rec["ckpt"])] = rec.get("path", "peer")
                commits[(rec.get("run", ""), rec["ckpt"])] = rec["t"]
    for records in per_node:
        history.stages.extend(_stage_samples(records, paths, commits))
        history.levels.extend(_level_samples(records, paths))
    return history


def node_streams(files: Iterable[Path]) -> list[list[dict[str, Any]]]:
    """Each (run, node)'s events from every file that has them, a line seen twice (the
    local file and its PFS copy, an agent that copied its file again after a restart)
    kept once, in time order. Records without a node stay a stream of their file."""
    streams: dict[tuple[str, Any], list[dict[str, Any]]] = defaultdict(list)
    seen: set[str] = set()
    for number, path in enumerate(files):
        for rec in read_events(path):
            line = json.dumps(rec, sort_keys=True)
            if line in seen:
                continue
            seen.add(line)
            streams[(rec.get("run", ""), rec.get("node", f"file {number}"))].append(rec)
    for records in streams.values():
        records.sort(key=lambda rec: float(rec.get("t", 0.0)))
    return list(streams.values())


def _stage_samples(records: list[dict[str, Any]], paths: dict[tuple[str, str], str],
                   commits: dict[tuple[str, str], float]) -> list[StageSample]:
    """One file's stage samples, and its node's level times counted from the commit."""
    nodes = 1
    replicating: dict[tuple[str, str], float] = {}
    parts: dict[tuple[str, str], int] = {}
    out: list[StageSample] = []

    def sample(rec: dict[str, Any], stage: str, seconds: float, nbytes: int) -> None:
        run, ckpt = rec.get("run", ""), rec["ckpt"]
        if seconds > 0 and nbytes > 0:
            out.append(StageSample(run, ckpt, int(rec.get("node", 0)), nodes, stage, nbytes,
                                   seconds, rec["t"], paths.get((run, ckpt), "peer"),
                                   rec.get("load")))

    for rec in records:
        kind = rec.get("event")
        if kind == "agent_start":
            nodes = int(rec.get("nodes", 1))
            continue
        if "ckpt" not in rec:
            continue
        key = (rec.get("run", ""), rec["ckpt"])
        if kind == "replicate_start":
            replicating[key] = rec["t"]
        elif kind == "captured":
            parts[key] = int(rec.get("bytes", 0))
            sample(rec, "capture", float(rec.get("duration", 0.0)), parts[key])
            if rec.get("write_start") and rec.get("committed_at"):
                sample({**rec, "t": rec["committed_at"]}, "write",
                       rec["committed_at"] - rec["write_start"], parts[key])
        elif kind == "replicated" and key in replicating:
            sample(rec, "replicate", rec["t"] - replicating.pop(key),
                   int(rec.get("bytes") or parts.get(key, 0)))
        elif kind == "flushed" and not rec.get("adopted"):
            sample(rec, "flush", float(rec.get("duration", 0.0)), int(rec.get("bytes", 0)))
        if kind in LEVELS and key in commits and not rec.get("adopted"):
            sample(rec, f"{kind}:{paths[key]}", rec["t"] - commits[key], parts.get(key, 0))
    return out


def _level_samples(records: list[dict[str, Any]], paths: dict[tuple[str, str], str]
                   ) -> list[LevelSample]:
    committed: dict[tuple[str, str], dict[str, Any]] = {}
    seen: dict[tuple[str, str], set[str]] = defaultdict(set)
    out: list[LevelSample] = []
    for rec in records:
        kind = rec.get("event", "")
        if kind == "committed":
            committed[(rec.get("run", ""), rec["ckpt"])] = rec
        elif kind.startswith("level_") and kind[6:] in LEVELS:
            key = (rec.get("run", ""), rec["ckpt"])
            commit = committed.get(key)
            if commit is None or kind in seen[key] or not rec.get("bytes"):
                continue        # a level whose commit is in an older file: no reference
            seen[key].add(kind)
            out.append(LevelSample(key[0], key[1], int(rec.get("seq", 0)),
                                   int(commit.get("nodes", 1)), kind[6:], int(rec["bytes"]),
                                   float(rec["latency"]), float(commit["t"]),
                                   rec.get("path") or paths.get(key, "peer"),
                                   commit.get("load")))
    return out
