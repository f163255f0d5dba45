"""Recovery's manifests: found whole, or rebuilt from the survivors' local and replica
manifests and accepted only when they match the digest a survivor keeps (issue 24)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachex_agent.journal import Journal
from cachex_agent.layout import NodePaths, replica_manifest_path
from cachex_agent.manifest import FileEntry, GlobalManifest, LocalManifest
from cachex_agent.recovery.discover import found_here, merge
from cachex_agent.safepath import UnsafeInput

NODES = 4


def part(node: int, checksum: str = "") -> LocalManifest:
    files = [FileEntry(f"__{node}_{k}.distcp", 10, 0o644, checksum or f"{node:030x}{k:02x}")
             for k in range(2)]
    if node == 0:
        files.append(FileEntry(".metadata", 3, 0o644, "m" * 32))
    return LocalManifest(run="r", ckpt="step_8", seq=8, node=node, host=f"h{node}",
                         rank=node, files=files)


def cluster(tmp_path: Path, holders: tuple[int, ...] = ()) -> tuple[list[NodePaths],
                                                                    GlobalManifest]:
    """NODES nodes' journals as the agents leave them: each its local manifest and its
    digest, its partner's (node - 1) replica manifest; the whole manifest on `holders`."""
    parts = [part(n) for n in range(NODES)]
    whole = GlobalManifest.build(parts, [".metadata"], {}, {n: f"b{n}" for n in range(NODES)})
    nodes = []
    for node in range(NODES):
        paths = NodePaths.of_run(tmp_path / f"n{node}/spool", tmp_path / f"n{node}/stage",
                                 tmp_path / f"n{node}/cache", tmp_path / "pfs", "r")
        journal = Journal(paths.journal)
        journal.save_manifest(parts[node])
        journal.update("step_8", **{"global": whole.digest().to_json()})
        if node in holders:
            journal.save_global(whole)
        owner = (node - 1) % NODES
        path = replica_manifest_path(paths.replicas, owner, "step_8")
        path.parent.mkdir(parents=True, exist_ok=True)
        parts[owner].save(path)
        nodes.append(paths)
    return nodes, whole


def test_a_holders_manifest_is_taken_whole(tmp_path):
    nodes, whole = cluster(tmp_path, holders=(2,))
    merged = merge([found_here(p, n, pfs=False) for n, p in enumerate(nodes)])
    assert merged.manifests["step_8"].files == whole.files and not merged.notes


def test_no_holder_left_rebuilds_from_the_survivors_matching_the_digest(tmp_path):
    nodes, whole = cluster(tmp_path)
    # node 0 (the coordinator) lost with its journal: its part is node 1's replica
    survivors = [found_here(p, n, pfs=False) for n, p in enumerate(nodes) if n != 0]
    merged = merge(survivors)
    rebuilt = merged.manifests["step_8"]
    assert whole.digest().matches(rebuilt)
    assert rebuilt.global_files == [".metadata"] and len(rebuilt.nodes) == NODES
    assert "rebuilt from 4 parts' local and replica manifests" in merged.notes[0]


def test_a_rebuilt_manifest_that_does_not_match_the_digest_is_refused(tmp_path):
    nodes, _ = cluster(tmp_path)
    # node 2's local manifest altered (another checksum): the content is not the digest's
    Journal(nodes[2].journal).save_manifest(part(2, checksum="f" * 32))
    path = replica_manifest_path(nodes[3].replicas, 2, "step_8")
    part(2, checksum="f" * 32).save(path)
    merged = merge([found_here(p, n, pfs=False) for n, p in enumerate(nodes) if n != 0])
    assert "step_8" not in merged.manifests
    assert merged.notes == ["step_8: no global manifest found, not rebuilt: the survivors'"
                            " manifests of its 4 parts do not match the digest (another"
                            " content: stale or altered parts)"]


def test_a_part_nobody_holds_is_named(tmp_path):
    nodes, _ = cluster(tmp_path)
    merged = merge([found_here(p, n, pfs=False) for n, p in enumerate(nodes) if n in (2, 3)])
    assert merged.notes == ["step_8: no global manifest found, not rebuilt: no local or"
                            " replica manifest of node 0"]


def test_a_hostile_replica_manifest_fails_naming_its_path(tmp_path):
    nodes, _ = cluster(tmp_path)
    bad = part(1)
    bad.ckpt = "../../etc"
    path = replica_manifest_path(nodes[2].replicas, 1, "step_9")
    bad.save(path)
    with pytest.raises(UnsafeInput, match="unsafe checkpoint id"):
        found_here(nodes[2], 2, pfs=False)
