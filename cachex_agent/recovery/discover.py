"""Which global manifests a recovery knows: found whole, or rebuilt from the survivors.

The whole global manifest lives only in the coordinator's journal (node 0), on the PFS
and in the journals of a few metadata holders (peer.partners.metadata_holders); every
other agent keeps a ManifestDigest in its journal entry (`global`), its own local
manifest, and its partners' replica manifests. Each rank reports what it has (`Found`,
its size independent of the job's but for the holders' and rank 0's); rank 0 alone
merges (`merge`): the newest whole manifest of each checkpoint, else one rebuilt from
the local and replica manifests, accepted only when it matches a digest a survivor
holds (ManifestDigest.matches: count, bytes and the hash of every entry), so a
manifest assembled from stale or forged parts is refused, named in `notes`.
Every manifest, digest and path is parsed with the checks of manifest.py and
safepath.py where it is read: the files are hostile until then.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import layout
from ..layout import NodePaths
from ..manifest import GlobalManifest, LocalManifest, ManifestDigest
from ..peer.store import held_replicas
from ..safepath import UnsafeInput
from . import holdings


@dataclass
class Found:
    """What one rank reports: whole manifests (holders, node 0, the PFS on rank 0),
    digests, its local manifests and the replica manifests it holds, as JSON."""

    node: int
    manifests: dict[str, dict[str, Any]] = field(default_factory=dict)
    digests: dict[str, dict[str, Any]] = field(default_factory=dict)
    parts: list[dict[str, Any]] = field(default_factory=list)


def found_here(paths: NodePaths, node: int, pfs: bool) -> Found:
    """This node's report; `pfs`: read the PFS's manifests too (rank 0)."""
    whole = holdings.journal_manifests(paths)
    if pfs:
        whole = {**holdings.pfs_manifests(paths.pfs), **whole}
    found = Found(node, {k: m.to_json() for k, m in whole.items()})
    found.digests = _digests(paths.journal)
    found.parts = [m.to_json() for m in _local_manifests(paths.journal)]
    found.parts += [m.to_json() for held in _replicas(paths.replicas).values() for m in held]
    return found


def _digests(journal: Path) -> dict[str, dict[str, Any]]:
    """The `global` digest of each journal entry; an unreadable state.json gives none
    (the journal of a replacement node, or one wiped)."""
    try:
        state = json.loads((journal / layout.JOURNAL_STATE).read_text())
    except (OSError, ValueError):
        return {}
    entries = state.get("ckpts", {}) if isinstance(state, dict) else {}
    if not isinstance(entries, dict):
        return {}
    return {ckpt: entry["global"] for ckpt, entry in entries.items()
            if isinstance(entry, dict) and isinstance(entry.get("global"), dict)}


def _local_manifests(journal: Path) -> list[LocalManifest]:
    found = []
    for path in sorted(layout.local_manifests_dir(journal).glob("*.json")):
        try:
            manifest = LocalManifest.load(path)
        except (OSError, ValueError):
            continue
        if layout.local_manifest_path(journal, manifest.ckpt) != path:
            raise UnsafeInput(f"{path}: checkpoint id {manifest.ckpt!r} is not the one"
                              " stored here")
        found.append(manifest)
    return found


def _replicas(root: Path) -> dict[int, list[LocalManifest]]:
    try:
        return held_replicas(root)
    except OSError:
        return {}


@dataclass
class Merged:
    manifests: dict[str, GlobalManifest]
    notes: list[str]


def merge(reports: list[Found]) -> Merged:
    """Rank 0: every report parsed (hostile until then: UnsafeInput names the node), the
    newest whole manifest per checkpoint, and a rebuilt one for each checkpoint that
    only digests and parts describe."""
    whole: dict[str, GlobalManifest] = {}
    digests: dict[str, list[ManifestDigest]] = {}
    parts: dict[str, dict[int, list[LocalManifest]]] = {}
    for report in reports:
        source = f"node {report.node}"
        for ckpt, data in report.manifests.items():
            manifest = GlobalManifest.from_json(data, f"{source}'s manifest of {ckpt}", ckpt)
            if ckpt not in whole or manifest.committed_at > whole[ckpt].committed_at:
                whole[ckpt] = manifest
        for ckpt, data in report.digests.items():
            digests.setdefault(ckpt, []).append(
                ManifestDigest.from_json(data, f"{source}'s digest of {ckpt}", ckpt))
        for data in report.parts:
            part = LocalManifest.from_json(data, f"{source}'s local or replica manifest")
            parts.setdefault(part.ckpt, {}).setdefault(part.node, []).append(part)
    notes: list[str] = []
    for ckpt in sorted(set(digests) - set(whole)):
        rebuilt, why = rebuild(digests[ckpt], parts.get(ckpt, {}))
        if rebuilt is None:
            notes.append(f"{ckpt}: no global manifest found, not rebuilt: {why}")
        else:
            whole[ckpt] = rebuilt
            notes.append(f"{ckpt}: no holder or PFS has its global manifest; rebuilt from"
                         f" {len(rebuilt.nodes)} parts' local and replica manifests of the"
                         " survivors (matches the digest they hold)")
    return Merged(whole, notes)


def rebuild(digests: list[ManifestDigest], parts: dict[int, list[LocalManifest]]
            ) -> tuple[GlobalManifest | None, str]:
    """The global manifest a digest describes, from one local or replica manifest per
    node (of the digest's sequence); (None, why) when a part is missing or no choice
    of them matches a digest."""
    why = ""
    for digest in sorted({d.hash: d for d in digests}.values(), key=lambda d: -d.seq):
        chosen = [next((p for p in parts.get(n, []) if p.seq == digest.seq), None)
                  for n in range(digest.nodes)]
        missing = [n for n, part in enumerate(chosen) if part is None]
        if missing:
            why = (f"no local or replica manifest of node{'s' if len(missing) > 1 else ''}"
                   f" {', '.join(map(str, missing[:8]))}"
                   + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
            continue
        manifest = GlobalManifest.build(
            [p for p in chosen if p is not None], [e["path"] for e in digest.globals], {},
            {n: layout.bundle_name(n) for n in range(digest.nodes)}, committed_at=0.0)
        if digest.matches(manifest):
            return manifest, ""
        why = (f"the survivors' manifests of its {digest.nodes} parts do not match the"
               " digest (another content: stale or altered parts)")
    return None, why
