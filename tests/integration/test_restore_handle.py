"""`cachex recover` as a restore handle on every node: states persisted in the journal
before their events, a recovery SIGKILLed mid-restore said and redone, one cancelled by
SIGTERM between rounds on every rank alike, and one SIGTERM to either end of a transfer
between ranks stopping both at its next file."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import psutil
import pytest
from harness import BIN, MPIEXEC, files_of, finish, kill_tree, wait_for
from test_recover import expected_after, lose_node, snapshot, trained

from cachex_agent.layout import recover_partial_dir

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def start_recover(c, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen([str(MPIEXEC), "-n", "4", str(BIN / "cachex"), "recover",
                             "--config", str(c.config)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **env},
                            start_new_session=True)


def restore_states(c, node: int, ckpt: str) -> list[str]:
    if not (c.journal(node) / "events.jsonl").exists():    # a lost node's, not yet
        return []
    return [e["state"] for e in c.events(node)
            if e.get("stage") == "restore" and e.get("ckpt") == ckpt]


def journal_state(c, node: int, ckpt: str) -> str | None:
    state = json.loads((c.journal(node) / "state.json").read_text())
    return state["ckpts"].get(ckpt, {}).get("stages", {}).get("restore")


def running_everywhere(c, ckpt: str) -> bool:
    return all("running" in restore_states(c, n, ckpt) for n in range(4))


def test_restore_states_are_journaled_and_evented_on_every_node(cluster):
    c = trained(cluster, 8)
    before = snapshot(c, "step_00008")
    lose_node(c, 2)
    result = subprocess.run([str(MPIEXEC), "-n", "4", str(BIN / "cachex"), "recover",
                             "--config", str(c.config)], capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    for node in range(4):
        assert restore_states(c, node, "step_00008") == ["queued", "running", "done"]
        assert journal_state(c, node, "step_00008") == "done"
        restored = [e for e in c.events(node) if e["event"] == "restored"]
        assert restored[-1]["seq"] == 2 and restored[-1]["node"] == node
    assert files_of(c.spool(2) / "step_00008") == expected_after(before)[2]


def test_a_recovery_killed_mid_restore_is_said_and_redone(cluster):
    c = trained(cluster, 8)
    before = snapshot(c, "step_00008")
    lose_node(c, 0)
    held = start_recover(c, CACHEX_TEST_HOLD="restore:0")
    try:
        wait_for(lambda: running_everywhere(c, "step_00008"), 120, "restores running")
    finally:
        kill_tree(held)
    assert journal_state(c, 0, "step_00008") == "running"
    assert not (c.spool(0) / "step_00008").exists()

    result = subprocess.run([str(MPIEXEC), "-n", "4", str(BIN / "cachex"), "recover",
                             "--config", str(c.config)], capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert ("node 0: an earlier restore of step_00008 was cut short; restoring it again"
            in result.stderr), result.stderr
    assert journal_state(c, 0, "step_00008") == "done"
    assert restore_states(c, 0, "step_00008")[-3:] == ["queued", "running", "done"]
    for node, files in expected_after(before).items():
        assert files_of(c.spool(node) / "step_00008") == files


def test_sigterm_cancels_the_restore_on_every_rank_with_one_line(cluster):
    c = trained(cluster, 8)
    lose_node(c, 0)
    held = start_recover(c, CACHEX_TEST_HOLD="restore:0")
    try:
        wait_for(lambda: running_everywhere(c, "step_00008"), 120, "restores running")
        ranks = recover_ranks(held)
        assert len(ranks) == 4
        for rank in ranks:
            rank.send_signal(signal.SIGTERM)
        _out, err = held.communicate(timeout=120)
    finally:
        if held.poll() is None:
            kill_tree(held)
    assert_cancelled_in_one_line(held, err)
    for node in range(4):
        assert restore_states(c, node, "step_00008")[-1] == "cancelled"
        assert journal_state(c, node, "step_00008") == "cancelled"
    assert not (c.spool(0) / "step_00008").exists()


MANY = ["--shard-size", "64KiB", "--chunk-size", "64KiB", "--step-time", "0.02",
        "--files-per-rank", "30", "--every", "4"]     # 60 shards a node: 60 files to move


def recover_ranks(held: subprocess.Popen[str]) -> list[psutil.Process]:
    return [p for p in psutil.Process(held.pid).children(recursive=True)
            if "recover" in " ".join(p.cmdline())]


def rank_process(held: subprocess.Popen[str], rank: int) -> psutil.Process:
    return next(p for p in recover_ranks(held) if p.environ().get("PMI_RANK") == str(rank))


def assert_cancelled_in_one_line(held: subprocess.Popen[str], err: str) -> None:
    assert held.returncode != 0
    lines = [line for line in err.splitlines() if "cachex recover: error" in line]
    assert len(lines) == 1 and "cancelled by a signal" in lines[0], err
    assert "Traceback" not in err


@pytest.mark.parametrize("signalled", [0, 1], ids=["receiver", "sender"])
def test_sigterm_mid_transfer_stops_both_ends_at_the_next_file(cluster, signalled):
    c = cluster()
    c.start_agents()
    finish(c.trainer("--steps", "4", *MANY))
    c.wait_level("step_00004", "flushed")
    assert c.stop() == 0
    lose_node(c, 0)     # node 0's part comes back from its replica on node 1, over MPI
    partial = recover_partial_dir(c.spool(0), "step_00004")
    # the holder waits 0.5 s before each file: the transfer would last 30 s
    held = start_recover(c, CACHEX_TEST_PACE="0.5")
    try:
        wait_for(lambda: len(list(partial.rglob("*.distcp"))) >= 2, 120, "the transfer")
        rank_process(held, signalled).send_signal(signal.SIGTERM)
        _out, err = held.communicate(timeout=20)
    finally:
        if held.poll() is None:
            kill_tree(held)
    assert_cancelled_in_one_line(held, err)
    assert restore_states(c, signalled, "step_00004")[-1] == "cancelled"
    assert not (c.spool(0) / "step_00004").exists() and not partial.exists()
