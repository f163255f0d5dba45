"""Recovery planning: which checkpoint, which source for every part, and why not."""

from __future__ import annotations

import pytest

from cachex_agent.errors import OperationError
from cachex_agent.manifest import FileEntry, GlobalManifest, LocalManifest
from cachex_agent.recovery.plan import Copy, choose, next_source


def manifest(ckpt: str, seq: int, nodes: int = 3) -> GlobalManifest:
    parts = []
    for node in range(nodes):
        files = [FileEntry(f"__{node}_0.distcp", 10, 0o644, f"{node:032x}")]
        if node == 0:
            files.append(FileEntry(".metadata", 3, 0o644, "m" * 32))
        parts.append(LocalManifest(run="r", ckpt=ckpt, seq=seq, node=node, host=f"h{node}",
                                   rank=node, files=files))
    return GlobalManifest.build(parts, [".metadata"], {}, {n: f"b{n}" for n in range(nodes)})


def own(ckpt: str, node: int, kind: str = "spool") -> Copy:
    paths = (f"__{node}_0.distcp", ".metadata") if node == 0 else (f"__{node}_0.distcp",)
    return Copy(ckpt, node, kind, node, paths)


def replica(ckpt: str, owner: int, holder: int) -> Copy:
    return Copy(ckpt, owner, "replica", holder, own(ckpt, owner).paths)


def pfs(ckpt: str, owner: int) -> Copy:
    return Copy(ckpt, owner, "pfs", -1, own(ckpt, owner).paths)


MANIFESTS = {"s1": manifest("s1", 1), "s2": manifest("s2", 2)}


def sources(plan):
    return {(m.target, m.owner): (m.source.kind, m.source.holder) for m in plan.moves}


def test_prefers_own_copy_then_replica_then_pfs():
    copies = [own("s2", 1), own("s2", 2, "stage"), replica("s2", 0, 1), pfs("s2", 0),
              pfs("s2", 1), pfs("s2", 2)]
    plan = choose(MANIFESTS, copies, nodes=3)
    assert plan.ckpt == "s2" and not plan.skipped
    found = sources(plan)
    assert found[(0, 0)] == ("replica", 1)
    assert found[(1, 1)] == ("spool", 1) and found[(2, 2)] == ("stage", 2)
    # the global file of node 0 goes to every other node, from node 0's source
    assert found[(1, 0)] == ("replica", 1) and found[(2, 0)] == ("replica", 1)
    assert all(m.paths == (".metadata",) for m in plan.moves if m.target != m.owner)


def test_journal_copy_of_global_files_is_used_by_its_holder():
    copies = [pfs("s2", 0), own("s2", 1), own("s2", 2),
              Copy("s2", 0, "journal", 2, (".metadata",))]
    found = sources(choose(MANIFESTS, copies, nodes=3))
    assert found[(2, 0)] == ("journal", 2) and found[(1, 0)] == ("pfs", -1)


def test_falls_back_with_the_reason():
    copies = [own("s2", 1), own("s2", 2)] + [pfs("s1", n) for n in range(3)]
    plan = choose(MANIFESTS, copies, nodes=3)
    assert plan.ckpt == "s1"
    assert "node 0's files have no verified copy" in plan.skipped["s2"]
    assert any("s2: not recoverable" in line for line in plan.describe())


def test_exclude_and_explicit_checkpoint():
    copies = [replica("s2", 0, 1), own("s2", 1), own("s2", 2)] + [pfs("s1", n) for n in range(3)]
    assert choose(MANIFESTS, copies, nodes=3, exclude=frozenset({"replica"})).ckpt == "s1"
    assert choose(MANIFESTS, copies, nodes=3, want="s1").ckpt == "s1"
    with pytest.raises(OperationError, match="s9: no global manifest"):
        choose(MANIFESTS, copies, nodes=3, want="s9")


def test_node_count_must_match():
    copies = [pfs("s2", n) for n in range(3)]
    with pytest.raises(OperationError, match="written by 3 nodes, this recovery runs on 4"):
        choose(MANIFESTS, copies, nodes=4)


def test_nothing_recoverable_names_every_reason():
    with pytest.raises(OperationError) as caught:
        choose(MANIFESTS, [own("s2", 1)], nodes=3)
    assert "s2:" in str(caught.value) and "s1:" in str(caught.value)


def test_a_file_that_failed_comes_from_the_next_copy_own_copies_first():
    copies = [replica("s1", 0, 1), replica("s1", 0, 2), pfs("s1", 0), own("s1", 0, "stage")]
    path = "__0_0.distcp"
    tried = {replica("s1", 0, 1)}
    assert next_source(copies, 0, 0, path, tried) == own("s1", 0, "stage")
    tried.add(own("s1", 0, "stage"))
    assert next_source(copies, 0, 0, path, tried) == replica("s1", 0, 2)
    tried.add(replica("s1", 0, 2))
    assert next_source(copies, 0, 0, path, tried) == pfs("s1", 0)
    assert next_source(copies, 0, 0, path, {*tried, pfs("s1", 0)}) is None
    assert next_source(copies, 0, 0, "not/in/any/copy", set()) is None
