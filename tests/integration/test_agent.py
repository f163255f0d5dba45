"""The data path end to end: `mpiexec -n 4 cachex-agent` beside the example trainer
(`mpiexec -n 8`, two ranks per virtual node), real files, real SIGKILLs."""

from __future__ import annotations

import json
import subprocess
import time

import h5py
import pytest
from harness import BIN, MPIEXEC, Cluster, files_of, finish, kill_tree, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
TRAIN = ["--shard-size", "256KiB", "--chunk-size", "64KiB", "--step-time", "0.02"]


@pytest.mark.parametrize("writers", [1, 2])
def test_checkpoints_flow_to_the_pfs_and_export_byte_for_byte(cluster, tmp_path, writers):
    """`writers` bundle writer threads per flush: the result is the same bundle."""
    c = cluster(extra=f"[flush]\nwriters = {writers}")
    c.start_agents()
    finish(c.trainer("--steps", "12", "--every", "4", *TRAIN))
    for step in ("step_00004", "step_00008", "step_00012"):
        c.wait_level(step, "flushed")

    listing = json.loads(c.cachex("ls", "--json").stdout)
    assert [(r["id"], r["level"]) for r in listing["checkpoints"]] == [
        ("step_00004", "flushed"), ("step_00008", "flushed"), ("step_00012", "flushed")]
    for step in ("step_00004", "step_00008", "step_00012"):
        result = c.cachex("verify", step)
        assert result.returncode == 0, result.stdout + result.stderr

    # one bundle per node, readable with plain h5py, `complete` set
    with h5py.File(c.pfs / "ckpt/step_00012/node-00001.h5", "r", locking=False) as h5:
        assert h5.attrs["complete"] and h5.attrs["ckpt"] == "step_00012"
        paths = sorted(ds.attrs["path"] for ds in h5["files"].values())
    assert paths == ["__2_0.distcp", "__3_0.distcp"]
    gm = json.loads((c.pfs / "ckpt/step_00012/manifest.json").read_text())
    assert gm["global_files"] == [".metadata"] and len(gm["nodes"]) == 4

    result = c.cachex("export", "step_00012", str(tmp_path / "out"), "--per-node")
    assert result.returncode == 0, result.stderr
    metadata = (c.spool(0) / "step_00012" / ".metadata").read_bytes()
    for node in range(4):
        spool = files_of(c.spool(node) / "step_00012")
        if node:        # the global file, mirrored into every node's spool (commit.mirror)
            assert spool.pop(".metadata") == metadata
        assert files_of(tmp_path / "out" / f"node-{node:05d}") == spool

    # every node: captured before flushed, with timestamps, for every checkpoint
    for node in range(4):
        events = c.events(node)
        for step in ("step_00004", "step_00008", "step_00012"):
            times = {e["event"]: e["t"] for e in events if e.get("ckpt") == step}
            assert times["capture_start"] <= times["captured"] <= times["flushed"]
    assert c.stop() == 0
    assert c.status()["state"] == "stopped"


def test_sigkilled_trainer_leaves_no_committed_half_checkpoint(cluster):
    c = cluster()
    c.start_agents()
    # each chunk of a shard waits 0.5 s: the kill below lands long before the commit,
    # even when a loaded machine slows this process between its look and the kill
    trainer = c.trainer("--steps", "12", "--every", "4", "--write-delay", "0.5", *TRAIN)
    c.wait_level("step_00004", "flushed", timeout=90)
    wait_for(lambda: (c.spool(1) / "step_00008" / "__2_0.distcp").exists(), 60,
             "the trainer to start writing step_00008")
    kill_tree(trainer)
    assert not (c.spool(0) / "step_00008" / ".metadata").exists()
    time.sleep(3)           # longer than commit.settle: nothing may pick the torn one up
    assert c.levels() == {"step_00004": "flushed"}
    assert c.cachex("verify", "step_00004").returncode == 0
    assert c.cachex("verify", "step_00008").returncode == 1

    finish(c.trainer("--steps", "12", "--every", "4", "--resume", *TRAIN))
    c.wait_level("step_00012", "flushed")
    assert c.levels()["step_00008"] == "flushed"
    assert c.stop() == 0


def test_unwritable_pfs_keeps_data_staged_then_flushes(cluster, tmp_path):
    mount = tmp_path / "pfs"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], check=True)
    try:
        c = cluster(extra='[flush]\nretry_max = "1s"\n')
        c.start_agents()
        finish(c.trainer("--steps", "4", "--every", "4", *TRAIN))
        c.wait_level("step_00004", "flushed")
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        finish(c.trainer("--steps", "8", "--every", "4", "--resume", *TRAIN))
        c.wait_level("step_00008", "captured", "replicated")
        errors = wait_for(lambda: _errors(c, "step_00008"), 30, "flush errors in status")
        assert any("Read-only file system" in e for e in errors.values()), errors
        assert (c.stage(2) / "step_00008" / "__4_0.distcp").exists()
        status = c.cachex("status")
        assert status.returncode == 0 and "Read-only" in status.stdout, status.stdout
        assert c.agents.poll() is None                      # the agent keeps running
        subprocess.run(["mount", "-o", "remount,rw", str(mount)], check=True)
        c.wait_level("step_00008", "flushed")
        assert c.cachex("verify", "step_00008").returncode == 0
        assert c.stop() == 0
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _errors(c: Cluster, ckpt: str) -> dict[str, str]:
    rows = [r for r in c.status().get("checkpoints", []) if r["id"] == ckpt]
    return rows[0]["errors"] if rows else {}


def test_restarted_agents_resume_an_unfinished_flush(cluster):
    c = cluster(extra='[flush]\nbandwidth = "256KiB"\n')   # 2 MiB a node: 1 MiB burst + 4 s
    c.start_agents()
    finish(c.trainer("--steps", "4", "--every", "4", "--shard-size", "1MiB", *TRAIN[2:]))
    c.wait_level("step_00004", "captured", "replicated")
    kill_tree(c.agents)
    assert c.levels()["step_00004"] in ("captured", "replicated")
    c.start_agents()
    c.wait_level("step_00004", "flushed", timeout=60)
    assert c.cachex("verify", "step_00004").returncode == 0
    captures = [e for e in c.events(1) if e["event"] == "captured"]
    assert len(captures) == 1                               # not captured twice
    assert c.stop() == 0


def test_stop_drains_and_flushes_the_newest_with_flush_every(cluster):
    c = cluster(extra="[flush]\nevery = 5\n")
    c.start_agents()
    finish(c.trainer("--steps", "8", "--every", "4", *TRAIN))
    c.wait_level("step_00004", "flushed")
    c.wait_level("step_00008", "captured", "replicated")
    assert c.stop() == 0
    assert c.levels()["step_00008"] == "flushed"        # the drain flushed the newest


def test_configuration_errors_are_one_line_exit_2(cluster, tmp_path):
    c = cluster()
    text = c.config.read_text()
    c.config.write_text(text.replace(f'pfs = "{tmp_path}/pfs"', 'pfs = "/nonexistent/pfs"'))
    for launcher in ([], [str(MPIEXEC), "-n", "2"]):
        proc = subprocess.run([*launcher, str(BIN / "cachex-agent"), "--config", str(c.config)],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert "paths.pfs" in proc.stderr and "/nonexistent" in proc.stderr
        assert "Traceback" not in proc.stderr
    c.config.write_text(text + "[flush]\nbandwith = 1\n")
    proc = subprocess.run([str(BIN / "cachex-agent"), "--config", str(c.config)],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "flush.bandwith" in proc.stderr


@pytest.mark.timeout(60)
def test_cli_on_an_unknown_run_fails_cleanly(tmp_path):
    c = Cluster(tmp_path, nodes=1)
    for args in (["status"], ["ls"], ["verify", "step_1"], ["export", "step_1", "x"]):
        result = c.cachex(*args)
        assert result.returncode == 1, (args, result.stderr)
        assert result.stderr.startswith("cachex: error:") and "Traceback" not in result.stderr
    result = c.cachex("ls", "--set", "flush.bandwidth=fast")
    assert result.returncode == 2 and "flush.bandwidth" in result.stderr
