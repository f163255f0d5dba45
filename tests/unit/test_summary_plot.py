"""The summary page's rows and incidents, computed from agents' event logs."""

from __future__ import annotations

import json

from cachex_agent.model.summary_plot import (
    layout,
    shown_rows,
    summarize,
    summary_figure,
    summary_from_files,
)

T0 = 1000.0


def ev(t: float, node: int, event: str, **fields) -> dict:
    return {"t": T0 + t, "event": event, "node": node, "run": "r", **fields}


def levels(node: int, ckpt: str, commit: float, *reached: tuple[str, float]) -> list[dict]:
    out = [ev(commit + 0.5, node, "captured", ckpt=ckpt, committed_at=T0 + commit, bytes=10)]
    out += [ev(commit + t, node, level, ckpt=ckpt) for level, t in reached]
    return out


def peer_run() -> list[list[dict]]:
    """Two nodes; node 1's agent is killed after step_1 and restarts; step_2 fails
    (node 1's capture failed); node 0's agent fails at the end."""
    node0 = [ev(0, 0, "agent_start", nodes=2),
             ev(10, 0, "committed", ckpt="step_1", path="peer"),
             *levels(0, "step_1", 10, ("replicated", 2.0), ("flushed", 3.0)),
             ev(40, 0, "committed", ckpt="step_2", path="peer"),
             *levels(0, "step_2", 40),
             ev(45, 0, "failed", ckpt="step_2", reason="node 1: capture failed"),
             ev(50, 0, "agent_failed", where="flusher", error="OSError: EIO")]
    node1 = [ev(0.2, 1, "agent_start", nodes=2),
             *levels(1, "step_1", 10, ("flushed", 1.5), ("replicated", 2.5)),
             ev(20, 1, "flush_start", ckpt="step_1"),
             ev(30, 1, "stale_removed", count=1),      # before its agent_start: same run
             ev(30.1, 1, "agent_start", nodes=2),
             ev(41, 1, "capture_failed", ckpt="step_2", error="ENOSPC")]
    return [node0, node1]


def test_rows_levels_per_checkpoint_and_node_failures_and_incidents():
    s = summarize(peer_run())
    assert [c.ckpt for c in s.checkpoints] == ["step_1", "step_2"]
    assert s.levels == ("captured", "replicated", "flushed") and s.paths == ("peer",)
    one, two = s.checkpoints
    assert one.commit == T0 + 10 and not one.failed
    assert [r.node for r in one.rows] == [0, 1]
    assert one.rows[1].reached == {"captured": 0.5, "flushed": 1.5, "replicated": 2.5}
    assert two.failed == "node 1: capture failed"
    assert two.rows[0].reached == {"captured": 0.5} and not two.rows[0].failed
    assert two.rows[1].failed == "capture_failed: ENOSPC" and not two.rows[1].missing
    kinds = [(i.kind, i.nodes) for i in s.incidents]
    assert kinds == [("lost", (1,)), ("restart", (1,)), ("failed", ()),
                     ("agent_failed", (0,))]
    lost = s.incidents[0]
    assert lost.t == T0 + 30        # its last event: the stale files removed at restart


def test_layout_puts_incidents_between_the_checkpoints_around_them():
    items = layout(summarize(peer_run()))
    names = [x.ckpt if kind == "checkpoint" else x.kind for kind, x in items]
    assert names == ["step_1", "lost", "restart", "step_2", "failed", "agent_failed"]
    assert [x.ckpt for kind, x in layout(summarize(peer_run()), 1)
            if kind == "checkpoint"] == ["step_2"]


def test_a_node_without_events_keeps_its_row_and_a_replaced_node_is_named():
    node0 = [ev(0, 0, "agent_start", nodes=2), *levels(0, "step_1", 10, ("flushed", 2.0)),
             *levels(0, "step_2", 60, ("flushed", 2.0))]
    node1 = [ev(50, 1, "agent_start", nodes=2), *levels(1, "step_2", 60, ("flushed", 1.0))]
    s = summarize([node0, node1])
    first = s.checkpoints[0]
    assert [r.node for r in first.rows] == [0, 1] and first.rows[1].missing
    assert {(i.kind, i.nodes) for i in s.incidents} == {("restart", (1,)),
                                                       ("log_lost", (1,))}


def test_a_journal_and_its_pfs_copies_read_as_one_log(tmp_path):
    """The PFS copy repeats the journal's lines, and a restarted agent copies its journal
    again from the start: one agent run each time, not restarts (seen in the demo)."""
    first = [ev(0, 0, "agent_start", nodes=1), *levels(0, "step_1", 10, ("flushed", 2.0))]
    second = [ev(30, 0, "agent_start", nodes=1), *levels(0, "step_2", 40, ("flushed", 2.0))]
    files = {"journal.jsonl": second, "pfs.jsonl": first + first + second}
    for name, records in files.items():
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    s = summary_from_files(sorted(tmp_path.iterdir()))
    assert [c.ckpt for c in s.checkpoints] == ["step_1", "step_2"]
    assert [(i.kind, i.nodes) for i in s.incidents] == [("lost", (0,)), ("restart", (0,))]


def test_only_observed_paths_and_levels_and_never_negative_time():
    direct = [ev(0, 0, "agent_start", nodes=1),
              ev(10, 0, "committed", ckpt="step_1", path="direct"),
              *levels(0, "step_1", 10, ("flushed", 2.0)),
              ev(20, 0, "committed", ckpt="step_2", path="direct"),
              ev(21, 0, "captured", ckpt="step_2", committed_at=T0 + 20),
              ev(15, 0, "flushed", ckpt="step_2", adopted=True)]    # a copy from before
    s = summarize([direct])
    assert s.paths == ("direct",) and s.levels == ("captured", "flushed")
    row = s.checkpoints[1].rows[0]
    assert row.reached == {"captured": 1.0} and row.early == ("flushed",)
    assert all(t >= 0 for c in s.checkpoints for r in c.rows for t in r.reached.values())


def test_many_nodes_show_the_slowest_and_the_figure_draws():
    logs = [[ev(0, n, "agent_start", nodes=12), *levels(n, "step_1", 10, ("flushed", 1 + n))]
            for n in range(12)]
    c = summarize(logs).checkpoints[0]
    assert [r.node for r in shown_rows(c, 3)] == [9, 10, 11]
    fig = summary_figure(summarize(peer_run()))
    assert fig.axes and fig.axes[0].get_yticklabels()[0].get_text() == "step_1   node 0"


def test_a_recovery_is_marked_and_keeps_apart_from_the_agents_runs_and_rows():
    """Node 1's agent is killed after step_1; `cachex recover` restores step_1 on both
    nodes (its events in the nodes' logs, before the agents start again)."""
    restore = [("restore_queued", "queued"), ("restore_start", "running"),
               ("restored", "done")]
    node0 = [ev(0, 0, "agent_start", nodes=2),
             *levels(0, "step_1", 10, ("replicated", 2.0)),
             ev(25, 0, "agent_exit"),
             *(ev(40 + i, 0, e, ckpt="step_1", stage="restore", state=s, seq=1)
               for i, (e, s) in enumerate(restore)),
             ev(50, 0, "agent_start", nodes=2)]
    node1 = [ev(0.2, 1, "agent_start", nodes=2),
             *levels(1, "step_1", 10, ("replicated", 2.5)),
             ev(20, 1, "restore_queued", ckpt="step_1", stage="restore", state="queued"),
             ev(41, 1, "restore_failed", ckpt="step_1", stage="restore", state="failed",
                error="cancelled"),
             ev(50.1, 1, "agent_start", nodes=2)]
    s = summarize([node0, node1])
    assert s.checkpoints[0].rows[1].reached == {"captured": 0.5, "replicated": 2.5}
    assert not s.checkpoints[0].rows[1].failed         # a restore is not the capture's
    kinds = [(i.kind, i.nodes, i.t - T0) for i in s.incidents]
    assert ("lost", (1,), 12.5) in kinds        # its last agent event, not the restore
    assert ("recovered", (0,), 42) in kinds
    assert ("failed", (1,), 41) in kinds
    assert "restore of step_1 failed: cancelled" in [i.text for i in s.incidents]
