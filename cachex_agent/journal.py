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
from pathlib import Path
from typing import Any

from .fsutil import makedirs, read_json, write_bytes, write_json
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
                    str(ckpt_dir(place, ckpt)) for place in places}:
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

    def update(self, ckpt: str, **fields: Any) -> None:
        with self._lock:
            self.entries.setdefault(ckpt, {}).update(fields)
            self._save()

    def set_stage(self, ckpt: str, stage: str, state: str, **fields: Any) -> None:
        """One stage's new state (and what resuming it needs), durable on return."""
        with self._lock:
            entry = self.entries.setdefault(ckpt, {})
            entry["stages"] = {**entry.get("stages", {}), stage: state}
            entry.update(fields)
            self._save()

    def forget(self, *ckpts: str) -> None:
        """The entries and local manifests of `ckpts`, in one write of state.json."""
        if not ckpts:
            return
        with self._lock:
            for ckpt in ckpts:
                self.entries.pop(ckpt, None)
            self._save()
            for ckpt in ckpts:
                local_manifest_path(self.root, ckpt).unlink(missing_ok=True)

    def _save(self) -> None:
        self._add(write_json(self.root / JOURNAL_STATE,
                                   {"version": 1, "ckpts": self.entries}))

    def save_manifest(self, manifest: LocalManifest) -> None:
        self._add(manifest.save(local_manifest_path(self.root, manifest.ckpt)))

    def manifest(self, ckpt: str) -> LocalManifest | None:
        path = local_manifest_path(self.root, ckpt)
        return LocalManifest.load(path, ckpt) if path.exists() else None

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
