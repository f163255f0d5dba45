"""Each rank of a recovery is sent its own slice of rank 0's view, never the whole
(recovery/slices.py, issue 24): its moves, the files of those moves, its peers' ranks,
what it looks for; a slice does not grow with the job."""

from __future__ import annotations

import pickle

from test_plan import dcp_scale

from cachex_agent.recovery.discover import Found
from cachex_agent.recovery.plan import Copy, Move, choose
from cachex_agent.recovery.slices import (
    index,
    known_by_rank,
    plan_shares,
    replication_jobs,
    split,
)


def shares(nodes: int, lose_journals: bool = False):
    big, copies = dcp_scale(nodes)
    if lose_journals:       # .metadata then comes from node 0 to every other node
        copies = [c for c in copies if c.kind != "journal"]
    plan = choose({"big": big}, copies, nodes=nodes)
    return plan, plan_shares(plan, copies, {n: n for n in range(nodes)}, nodes)


def test_a_ranks_slice_holds_only_its_own_moves_and_their_files():
    plan, sliced = shares(6, lose_journals=True)
    for rank, share in enumerate(sliced):
        mine = [m for m in plan.moves if rank in (m.target, m.source.holder)]
        assert share.work.moves == mine and share.work.anywhere
        assert {(o, e.path) for o, e in share.work.files} == {
            (m.owner, p) for m in mine for p in m.paths}
        assert set(share.work.ranks) == {n for m in mine for n in (m.target, m.source.holder)}
        # the replica it holds (of node rank - 1), to check before re-replicating
        assert list(share.held) == [(rank - 1) % 6]
        assert share.parts == 6 and share.files == len(plan.manifest.files)
    # node 0 sends .metadata to every other node: those moves are its, not theirs
    assert len(sliced[0].work.moves) == 6 and len(sliced[3].work.moves) == 2


def test_a_slice_does_not_grow_with_the_job():
    sizes = {n: max(len(pickle.dumps(s)) for s in shares(n)[1][1:]) for n in (50, 1000)}
    assert sizes[1000] < 1.2 * sizes[50], sizes


def test_each_rank_looks_only_for_its_part_and_the_replicas_it_reported():
    big, _ = dcp_scale(5)
    reports = [Found(n, parts=[{"ckpt": "big", "node": (n - 1) % 5}]) for n in range(5)]
    hosts = ("h1", "h0", "h2", "h3", "h4")      # node 0 runs on h1: it holds node 1's part
    views = known_by_rank({"big": big}, reports, hosts)
    assert views[0].wants["big"].owner == 1 and views[1].wants["big"].owner == 0
    assert {e.path for e in views[3].wants["big"].own} == {
        e["path"] for e in big.files if e["node"] == 3}
    assert list(views[3].wants["big"].parts) == [2]
    assert views[3].seqs == {"big": 1} and views[3].counts == {"big": 5}


def test_retries_and_re_replication_go_to_the_two_ends_only():
    big, _ = dcp_scale(4)
    entries = index(big)
    retry = Move(2, 1, Copy("big", 1, "replica", 3, ("__8_0.distcp",)), ("__8_0.distcp",))
    bad = Copy("big", 1, "spool", 1, ("__8_0.distcp",))
    works = split([retry], entries, {n: n for n in range(4)}, 4, {1: [bad]})
    assert [len(w.moves) for w in works] == [0, 0, 1, 1] and all(w.anywhere for w in works)
    assert works[1].bad == [bad] and works[0].files == []
    jobs = replication_jobs(big, [[1], [2], [3], [0]], {(0, 1), (1, 2), (3, 0)},
                            {n: n for n in range(4)}, 4)
    assert [[(j.owner, j.partner, j.peer) for j in mine] for mine in jobs] == [
        [], [], [(2, 3, 3)], [(2, 3, 2)]]
