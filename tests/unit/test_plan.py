"""Recovery planning: which checkpoint, which source for every part, and why not."""

from __future__ import annotations

import pytest

from cachex_agent.errors import OperationError
from cachex_agent.manifest import FileEntry, GlobalManifest, LocalManifest
from cachex_agent.recovery.plan import (
    Copy,
    Space,
    bytes_needed,
    check_space,
    choose,
    gathered,
    next_source,
    placement,
    reshards,
)


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


# ------------------------------------------------------------ another node count
def per_rank(ckpt: str, nodes: int) -> GlobalManifest:
    """A layout no framework reshards: one file per node, a global tracker of node 0."""
    parts = []
    for node in range(nodes):
        files = [FileEntry(f"rank_{node}.pt", 10, 0o600, f"{node:032x}")]
        if node == 0:
            files.append(FileEntry("latest", 2, 0o600, "l" * 32))
        parts.append(LocalManifest(run="r", ckpt=ckpt, seq=1, node=node, host=f"h{node}",
                                   rank=node, files=files))
    return GlobalManifest.build(parts, ["latest"], {}, {n: f"b{n}" for n in range(nodes)})


def per_rank_copy(ckpt: str, node: int, kind: str, holder: int) -> Copy:
    paths = (f"rank_{node}.pt", "latest") if node == 0 else (f"rank_{node}.pt",)
    return Copy(ckpt, node, kind, holder, paths)


def received(plan) -> dict[int, list[str]]:
    """Target -> every path it gets, in the plan's order."""
    found: dict[int, list[str]] = {}
    for move in plan.moves:
        found.setdefault(move.target, []).extend(move.paths)
    return found


def test_dcp_onto_fewer_nodes_gives_every_node_every_file_once():
    # node 0 lost: its part survives as a replica on node 1; node 2's only on the PFS
    copies = [replica("s2", 0, 1), own("s2", 1), pfs("s2", 0), pfs("s2", 1), pfs("s2", 2)]
    plan = choose({"s2": MANIFESTS["s2"]}, copies, nodes=2)
    assert plan.resized and reshards(plan.manifest)
    everything = sorted(e["path"] for e in plan.manifest.files)
    for target, paths in received(plan).items():
        assert sorted(paths) == everything, target        # each path once per node
    found = sources(plan)
    assert found[(0, 0)] == ("replica", 1) and found[(1, 0)] == ("replica", 1)
    assert found[(1, 1)] == ("spool", 1) and found[(0, 1)] == ("spool", 1)
    assert found[(0, 2)] == found[(1, 2)] == ("pfs", -1)
    assert not any(plan.kept(m) for m in plan.moves)     # assembled aside, even its own
    assert "written by 3 nodes, recovered onto 2: PyTorch DCP layout, every node gets all" \
        " 4 files" in "\n".join(plan.describe())


def test_dcp_onto_more_nodes_fills_the_new_nodes_too():
    copies = [own("s2", n) for n in range(3)]
    plan = choose({"s2": MANIFESTS["s2"]}, copies, nodes=5)
    assert sorted(received(plan)) == [0, 1, 2, 3, 4]
    assert all(len(paths) == 4 for paths in received(plan).values())
    assert sources(plan)[(4, 2)] == ("spool", 2)          # new nodes read the survivors


def test_per_rank_files_go_to_old_node_mod_m_and_globals_everywhere():
    manifest = per_rank("s1", 4)
    copies = [per_rank_copy("s1", n, "spool", n) for n in range(1, 4)] + [
        per_rank_copy("s1", 0, "replica", 1)]
    plan = choose({"s1": manifest}, copies, nodes=3)
    assert placement(manifest, 3) == {0: [0, 3], 1: [1], 2: [2]}
    got = received(plan)
    assert sorted(got[0]) == ["latest", "rank_0.pt", "rank_3.pt"]
    assert sorted(got[1]) == ["latest", "rank_1.pt"]
    assert sorted(got[2]) == ["latest", "rank_2.pt"]
    text = "\n".join(plan.describe())
    assert "old node o goes to node o mod 3 (old node 3 -> node 0)" in text
    assert "no resharding is known" in text and "--to DIR" in text


def test_per_rank_onto_more_nodes_leaves_the_new_ones_the_globals():
    manifest = per_rank("s1", 2)
    copies = [per_rank_copy("s1", n, "spool", n) for n in range(2)]
    plan = choose({"s1": manifest}, copies, nodes=4)
    got = received(plan)
    assert got[2] == got[3] == ["latest"] and sorted(got[1]) == ["latest", "rank_1.pt"]
    assert "nodes 2, 3 get only the global files" in "\n".join(plan.describe())


def test_a_path_with_different_contents_cannot_share_a_spool():
    parts = [LocalManifest(run="r", ckpt="s1", seq=1, node=n, host=f"h{n}", rank=n,
                           files=[FileEntry("state.pt", 4, 0o600, f"{n:032x}")])
             for n in range(2)]
    manifest = GlobalManifest.build(parts, [], {}, {0: "b0", 1: "b1"})
    copies = [Copy("s1", n, "spool", n, ("state.pt",)) for n in range(2)]
    with pytest.raises(OperationError, match="state.pt: nodes 0 and 1 hold different files"
                       " under this path: they cannot share one node's spool"):
        choose({"s1": manifest}, copies, nodes=1)
    assert len(choose({"s1": manifest}, copies, nodes=2).moves) == 2    # same count: fine


def test_hostile_inputs_change_no_placement():
    with pytest.raises(OperationError, match="at least one node, not 0"):
        placement(MANIFESTS["s2"], 0)
    # a copy claiming an owner the checkpoint does not have, one that lacks a file, and a
    # journal copy held by no node of this job are never used
    bogus = [Copy("s2", 7, "replica", 1, ("__0_0.distcp", ".metadata")),
             Copy("s2", 2, "replica", 1, ("__9_0.distcp",)),
             Copy("s2", 0, "journal", 5, (".metadata",))]
    copies = [own("s2", 0), own("s2", 1), pfs("s2", 2), *bogus]
    plan = choose({"s2": MANIFESTS["s2"]}, copies, nodes=2)
    assert not {m.source for m in plan.moves} & set(bogus)
    with pytest.raises(OperationError, match="node 2's files have no verified copy left"):
        choose({"s2": MANIFESTS["s2"]}, [own("s2", 0), own("s2", 1), *bogus], nodes=2)


# ------------------------------------------------------------------ free space
def test_bytes_needed_counts_what_is_written_not_what_stays():
    same = choose(MANIFESTS, [own("s2", n) for n in range(3)], nodes=3)
    # same count: the own spool copies stay; nodes 1, 2 gain .metadata (3 bytes)
    assert bytes_needed(same) == {0: 0, 1: 3, 2: 3}
    shrunk = choose({"s2": MANIFESTS["s2"]}, [own("s2", n) for n in range(3)], nodes=2)
    assert bytes_needed(shrunk) == {0: 33, 1: 33}          # the whole checkpoint, aside


def test_free_space_refusal_names_the_node_the_path_and_the_bytes():
    needed = {0: 33, 1: 33}
    fits = [Space(0, "/nvme0/spool", 40, "h0:1"), Space(1, "/nvme1/spool", 40, "h1:1")]
    check_space(needed, fits)
    short = [Space(0, "/nvme0/spool", 40, "h0:1"), Space(1, "/nvme1/spool", 20, "h1:1")]
    with pytest.raises(OperationError) as caught:
        check_space(needed, short)
    assert str(caught.value).startswith("node 1: /nvme1/spool needs 33 B (33 bytes), 20 B"
                                        " (20 bytes) free")
    # two targets on one file system (virtual nodes of one host) share its free space
    shared = [Space(0, "/tmp/n0/spool", 40, "h:1"), Space(1, "/tmp/n1/spool", 40, "h:1")]
    with pytest.raises(OperationError, match=r"nodes 0, 1 \(one file system\):"
                       r" /tmp/n0/spool needs 66 B"):
        check_space(needed, shared)


# ------------------------------------------------------------------ --to DIR
def test_gathered_writes_each_path_once_by_its_holder():
    copies = [replica("s2", 0, 1), own("s2", 1), pfs("s2", 0), pfs("s2", 1), pfs("s2", 2)]
    plan = gathered(choose({"s2": MANIFESTS["s2"]}, copies, nodes=2), copies, 2, "/pfs/out")
    assert plan.to == "/pfs/out" and not any(plan.kept(m) for m in plan.moves)
    assert sorted(p for m in plan.moves for p in m.paths) == sorted(
        e["path"] for e in plan.manifest.files)
    # the replica and the spool copy are written by their holder, the PFS bundle of
    # node 2 by node 2 mod 2
    assert {(m.owner, m.target, m.source.kind) for m in plan.moves} == {
        (0, 1, "replica"), (1, 1, "spool"), (2, 0, "pfs")}
    assert sum(bytes_needed(plan).values()) == plan.manifest.bytes


def test_an_older_checkpoints_copies_are_never_a_source():
    """File names repeat across checkpoints: s1's spool copies hold s2's paths too."""
    copies = [own("s1", n) for n in range(3)] + [replica("s2", n, (n + 1) % 3)
                                                 for n in range(3)]
    plan = gathered(choose(MANIFESTS, copies, nodes=3), copies, 3, "/pfs/out")
    assert plan.ckpt == "s2" and {m.source.ckpt for m in plan.moves} == {"s2"}


def test_a_large_resize_is_said_in_one_line_per_target():
    big = manifest("s9", 9, nodes=12)
    copies = [own("s9", n) for n in range(1, 12)] + [replica("s9", 0, 1)]
    plan = choose({"s9": big}, copies, nodes=11)
    assert len(plan.moves) > 64
    lines = plan.describe()
    per_target = [line for line in lines if line.startswith("  node ")]
    assert len(per_target) == 11
    assert per_target[0] == ("  node 0: 13 files of 12 nodes: 2 from replica on 1 other node,"
                             " 11 from spool on 11 other nodes")


def test_the_mod_map_names_at_most_eight_moved_parts():
    manifest = per_rank("s1", 20)
    copies = [per_rank_copy("s1", n, "pfs", -1) for n in range(20)]
    note = choose({"s1": manifest}, copies, nodes=5).notes[0]
    assert "old node 5 -> node 0, old node 10 -> node 0" in note
    assert note.count("->") == 8 and "7 more)" in note


def test_export_shares_the_one_path_once_rule():
    from cachex_agent.recovery.export import _wanted
    parts = [LocalManifest(run="r", ckpt="s1", seq=1, node=n, host=f"h{n}", rank=n,
                           files=[FileEntry("state.pt", 4, 0o600, f"{n:032x}")])
             for n in range(2)]
    clash = GlobalManifest.build(parts, [], {}, {0: "b0", 1: "b1"})
    with pytest.raises(OperationError, match="state.pt: nodes 0 and 1 hold different files"
                       " under this path; use --per-node"):
        _wanted(clash, per_node=False)
    assert _wanted(clash, per_node=True) == {0: {"state.pt"}, 1: {"state.pt"}}
    # the mirrored .metadata of MANIFESTS comes from node 0 only
    assert _wanted(MANIFESTS["s2"], per_node=False) == {
        0: {"__0_0.distcp", ".metadata"}, 1: {"__1_0.distcp"}, 2: {"__2_0.distcp"}}
