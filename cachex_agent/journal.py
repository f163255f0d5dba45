"""The agent's durable state on node-local storage (`<cache>/<run>/journal/`, layout.py).

    state.json              one entry per checkpoint this node handled: seq, state, stamps
    manifests/<ckpt>.json   this node's local manifest (copy of what is in the stage)
    global/<ckpt>.json      the whole global manifest: on the coordinator's node and the
                            metadata holders only (every entry of state.json keeps its
                            digest under `global`, manifest.ManifestDigest)
    coordinator.json        coordinator only: every checkpoint's global level
    status.json             coordinator only: what `cachex status` shows
    events.jsonl            structured events (events.py)

Each entry of state.json holds, under `stages`, the state of every stage of that
checkpoint on this node (handles.py), written before the state is reported: a
restarted agent resumes each stage from it, and never repeats one that is done.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .fsutil import makedirs, read_json, write_bytes, write_json
from .handles import Stage, State
from .layout import (
    JOURNAL_STATE,
    ckpt_dir,
    global_manifests_dir,
    journal_global_manifest_path,
    local_manifest_path,
    local_manifests_dir,
)
from .manifest import GlobalManifest, LocalManifest, ManifestDigest
from .safepath import UnsafeInput, checkpoint_id, relative_paths
from .versions import trainer_name


@dataclass(frozen=True, slots=True)
class JournalEntry:
    """One checkpoint's entry of state.json, typed: what the node's decisions read
    (node_policy.py). Loaded entries were checked by `Journal` (ids, paths, digests)."""

    ckpt: str
    seq: int | None = None
    stages: dict[str, str] = field(default_factory=dict)    # Stage value -> State value
    source: str | None = None       # the captured copy: stage (copy) or spool (reference)
    mode: str | None = None         # copy | reference | evicted
    mode_reason: str = ""
    global_files: tuple[str, ...] = ()
    globals_shared: bool = False
    protected: bool = False
    bundle: str | None = None
    digest: dict[str, Any] | None = None    # the global manifest's (`global`)
    save: dict[str, Any] | None = None      # this node's own save it took (stage/saves.py)

    @classmethod
    def of(cls, ckpt: str, data: dict[str, Any]) -> JournalEntry:
        return cls(ckpt, seq=data.get("seq"), stages=dict(data.get("stages", {})),
                   source=data.get("source"), mode=data.get("mode"),
                   mode_reason=data.get("mode_reason", ""),
                   global_files=tuple(data.get("global_files", ())),
                   globals_shared=bool(data.get("globals_shared")),
                   protected=bool(data.get("protected")), bundle=data.get("bundle"),
                   digest=data.get("global"), save=data.get("save"))

    def state(self, stage: Stage) -> State | None:
        """A stage's persisted state (None: never submitted)."""
        value = self.stages.get(stage.value)
        return State(value) if value is not None else None

    def done(self, stage: Stage) -> bool:
        return self.state(stage) == State.DONE

    @property
    def failed(self) -> bool:
        """Its capture failed here, or the coordinator gave up on it (a failed
        replication still goes to the PFS; a flush retries)."""
        return State.FAILED in (self.state(Stage.CAPTURE), self.state(Stage.COMMIT))

    @property
    def staged(self) -> bool:
        """The captured copy is the agent's own, in the stage (not the spool's files,
        and not evicted since)."""
        return self.mode == "copy"

    @property
    def captured(self) -> bool:
        """Captured and not failed since: a copy to protect and flush."""
        return self.done(Stage.CAPTURE) and not self.failed


class Journal:
    def __init__(self, root: Path, places: tuple[Path, ...] = ()) -> None:
        """`places`: the directories a checkpoint's `source` may be in (stage, spool);
        an entry whose source is anything but `<place>/<ckpt>` is refused."""
        self.root = makedirs(root)
        makedirs(local_manifests_dir(root))
        makedirs(global_manifests_dir(root))
        self._lock = threading.Lock()
        self._written = 0               # bytes this process wrote here (`written`)
        self._counted = threading.Lock()
        # the local manifests this process saved or read (only it writes them): the
        # node's every decision looks at one, so it is parsed once, not per event
        self._manifests: dict[str, LocalManifest] = {}
        self.entries: dict[str, dict[str, Any]] = self._load(JOURNAL_STATE).get("ckpts", {})
        self._check(root / JOURNAL_STATE, places)

    def _check(self, where: Path, places: tuple[Path, ...]) -> None:
        """Every checkpoint id and path read back is joined to a directory later."""
        for ckpt, entry in self.entries.items():
            checkpoint_id(ckpt, where)
            relative_paths(entry.get("global_files", []), where, f"global file of {ckpt}")
            if "global" in entry:
                ManifestDigest.from_json(entry["global"], where, ckpt)
            source = entry.get("source")
            if places and source is not None and source not in {
                    str(ckpt_dir(place, name)) for place in places
                    for name in (ckpt, trainer_name(ckpt))}:
                raise UnsafeInput(f"{where}: unsafe source {source!r} of {ckpt} (not in"
                                  f" {' or '.join(map(str, places))})")

    @property
    def written(self) -> int:
        """Bytes of JSON this process has written into the journal (the agent's
        `counters` event: what the metadata costs a node per checkpoint)."""
        return self._written

    def _add(self, size: int) -> None:
        with self._counted:
            self._written += size

    def _load(self, name: str) -> dict[str, Any]:
        path = self.root / name
        return read_json(path) if path.exists() else {}

    def get(self, ckpt: str) -> dict[str, Any] | None:
        return self.entries.get(ckpt)

    def entry(self, ckpt: str) -> JournalEntry | None:
        data = self.entries.get(ckpt)
        return None if data is None else JournalEntry.of(ckpt, data)

    def typed(self) -> list[JournalEntry]:
        """Every entry, typed, oldest (lowest seq) first."""
        with self._lock:
            entries = [JournalEntry.of(c, e) for c, e in self.entries.items()]
        return sorted(entries, key=lambda e: e.seq or 0)

    def update(self, ckpt: str, **fields: Any) -> None:
        with self._lock:
            self.entries.setdefault(ckpt, {}).update(fields)
            self._save()

    def set_stage(self, ckpt: str, stage: str, state: str, **fields: Any) -> None:
        """One stage's new state (and what resuming it needs), on disk on return,
        its rename durable when the stage ended. Queued and running are for a restarted
        process (node_policy.resume): what they stand for lives in node memory (the
        stage, the windows) and does not outlive the host either, and the next durable
        write carries them; their directory fsyncs, two per stage, are saved."""
        with self._lock:
            entry = self.entries.setdefault(ckpt, {})
            entry["stages"] = {**entry.get("stages", {}), stage: state}
            entry.update(fields)
            self._save(sync=state not in (State.QUEUED.value, State.RUNNING.value))

    def forget(self, *ckpts: str) -> None:
        """The entries and local manifests of `ckpts`, in one write of state.json."""
        if not ckpts:
            return
        with self._lock:
            for ckpt in ckpts:
                self.entries.pop(ckpt, None)
            self._save()
            for ckpt in ckpts:
                self._manifests.pop(ckpt, None)
                local_manifest_path(self.root, ckpt).unlink(missing_ok=True)

    def _save(self, sync: bool = True) -> None:
        self._add(write_json(self.root / JOURNAL_STATE,
                                   {"version": 1, "ckpts": self.entries}, sync=sync))

    def save_manifest(self, manifest: LocalManifest) -> None:
        self._add(manifest.save(local_manifest_path(self.root, manifest.ckpt)))
        self._manifests[manifest.ckpt] = manifest

    def manifest(self, ckpt: str) -> LocalManifest | None:
        """This node's manifest of `ckpt` (shared: callers do not change it)."""
        if (known := self._manifests.get(ckpt)) is not None:
            return known
        path = local_manifest_path(self.root, ckpt)
        if not path.exists():
            return None
        manifest = self._manifests[ckpt] = LocalManifest.load(path, ckpt)
        return manifest

    def digest(self, ckpt: str) -> ManifestDigest | None:
        """The global manifest's digest this node heard (checked when the journal loads)."""
        data = (self.entries.get(ckpt) or {}).get("global")
        return ManifestDigest.from_json(data, self.root / JOURNAL_STATE, ckpt) if data else None

    def save_global(self, manifest: GlobalManifest) -> None:
        self._add(manifest.save(journal_global_manifest_path(self.root, manifest.ckpt)))

    def global_manifest(self, ckpt: str) -> GlobalManifest | None:
        path = journal_global_manifest_path(self.root, ckpt)
        return GlobalManifest.load(path, ckpt) if path.exists() else None

    def read(self, name: str) -> dict[str, Any]:
        return self._load(name)

    def write(self, name: str, data: dict[str, Any], compact: bool = False) -> None:
        self._add(write_json(self.root / name, data, compact))

    def write_bytes(self, name: str, data: bytes) -> None:
        """`data` (already encoded) as `write` writes its JSON: durably, atomically."""
        self._add(write_bytes(self.root / name, data))
