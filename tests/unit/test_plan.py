"""Recovery planning: which checkpoint, which source for every part, and why not."""

from __future__ import annotations

import pytest

from cachex_agent.errors import ConfigError, OperationError
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


def test_dcp_onto_another_node_count_needs_to_and_goes_there_once():
    """Not whole into every spool: which files a new rank reads is in DCP's pickled
    .metadata, which is never unpickled; so once into a directory every rank reads."""
    copies = [replica("s2", 0, 1), own("s2", 1), pfs("s2", 0), pfs("s2", 1), pfs("s2", 2)]
    for onto in (2, 5):
        with pytest.raises(ConfigError, match=r"s2: a PyTorch DCP checkpoint of 3 nodes"
                           f" onto {onto}: give `cachex recover --to DIR`"):
            choose({"s2": MANIFESTS["s2"]}, copies, nodes=onto)
    plan = choose({"s2": MANIFESTS["s2"]}, copies, nodes=2, to="/pfs/out")
    assert plan.to == "/pfs/out" and reshards(plan.manifest)
    assert sorted(p for m in plan.moves for p in m.paths) == sorted(
        e["path"] for e in plan.manifest.files)                     # each path once


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
    plan = choose({"s2": MANIFESTS["s2"]}, copies, nodes=2, to="/pfs/out")
    assert not {m.source for m in plan.moves} & set(bogus)
    plan = choose({"s2": MANIFESTS["s2"]}, copies, nodes=3)
    assert not {m.source for m in plan.moves} & set(bogus)
    with pytest.raises(OperationError, match="node 2's files have no verified copy left"):
        choose({"s2": MANIFESTS["s2"]}, [own("s2", 0), own("s2", 1), *bogus], nodes=3)


# ------------------------------------------------------------------ free space
def test_bytes_needed_counts_what_is_written_not_what_stays():
    same = choose(MANIFESTS, [own("s2", n) for n in range(3)], nodes=3)
    # same count: the own spool copies stay; nodes 1, 2 gain .metadata (3 bytes)
    assert bytes_needed(same) == {0: 0, 1: 3, 2: 3}
    shrunk = choose({"s2": MANIFESTS["s2"]}, [own("s2", n) for n in range(3)], nodes=2,
                    to="/pfs/out")
    assert bytes_needed(shrunk) == {0: 23, 1: 10}          # the checkpoint once, in all


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
    plan = gathered(choose({"s2": MANIFESTS["s2"]}, copies, nodes=2, to="/x"), copies, 2,
                    "/pfs/out")
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
    big = per_rank("s9", 80)
    copies = [per_rank_copy("s9", n, "spool", n) for n in range(1, 80)] + [
        per_rank_copy("s9", 0, "replica", 1)]
    plan = choose({"s9": big}, copies, nodes=70)
    assert len(plan.moves) > 64
    per_target = [line for line in plan.describe() if line.startswith("  node ")]
    assert len(per_target) == 70
    assert per_target[0].startswith("  node 0: 3 files of 2 nodes: ")


# ------------------------------------------------------------------ at scale
def dcp_scale(nodes: int, files: int = 8) -> tuple[GlobalManifest, list[Copy]]:
    """`nodes` nodes of `files` DCP shards each, .metadata on node 0; each part in its
    own spool, a replica on the next node, a bundle on the PFS."""
    parts = []
    for node in range(nodes):
        entries = [FileEntry(f"__{node * files + k}_0.distcp", 100, 0o644, f"{node:032x}")
                   for k in range(files)]
        if node == 0:
            entries.append(FileEntry(".metadata", 7, 0o644, "m" * 32))
        parts.append(LocalManifest(run="r", ckpt="big", seq=1, node=node, host=f"h{node}",
                                   rank=node, files=entries))
    big = GlobalManifest.build(parts, [".metadata"], {}, {n: f"b{n}" for n in range(nodes)})
    copies = []
    for node, part in enumerate(parts):
        paths = tuple(e.path for e in part.files)
        copies += [Copy("big", node, "spool", node, paths),
                   Copy("big", node, "replica", (node + 1) % nodes, paths),
                   Copy("big", node, "pfs", -1, paths)]
        if node:
            copies.append(Copy("big", 0, "journal", node, (".metadata",)))
    return big, copies


@pytest.mark.parametrize("nodes", [100, 2000])
def test_same_count_moves_grow_with_the_nodes_not_their_square(nodes):
    big, copies = dcp_scale(nodes)
    plan = choose({"big": big}, copies, nodes=nodes)
    assert len(plan.moves) == 2 * nodes - 1            # each part home, .metadata to the rest
    assert all(plan.kept(m) for m in plan.moves if m.owner == m.target)
    assert {m.source.kind for m in plan.moves if m.owner != m.target} == {"journal"}


@pytest.mark.parametrize("nodes", [100, 2000])
def test_a_lost_node_onto_one_fewer_moves_each_file_once(nodes):
    big, copies = dcp_scale(nodes)
    copies = [c for c in copies if c.holder != 0]              # node 0 lost, no spare
    plan = choose({"big": big}, copies, nodes=nodes - 1, to="/pfs/out")
    assert len(plan.moves) == nodes
    assert sum(len(m.paths) for m in plan.moves) == 8 * nodes + 1
    assert sum(bytes_needed(plan).values()) == big.bytes
    assert max(bytes_needed(plan).values()) <= 2 * 800 + 7     # its own part and one more


def test_per_rank_onto_one_fewer_at_scale_moves_o_to_o_mod_m():
    nodes = 2000
    big = per_rank("big", nodes)
    copies = [per_rank_copy("big", n, "spool", n) for n in range(1, nodes)] + [
        per_rank_copy("big", 0, "replica", 1)]
    plan = choose({"big": big}, copies, nodes=nodes - 1)
    # every part to one node, and the tracker to the nodes but 0 (which has node 0's part)
    assert len(plan.moves) == nodes + (nodes - 2)
    assert {m.target for m in plan.moves if m.owner == nodes - 1} == {0}


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
