"""Spool-root files through real agents and `cachex recover` (rule `auto`): Megatron's
tracker `latest_checkpointed_iteration.txt` beside a `torch_dist` iteration directory,
and a single-file checkpoint (torch.save / Lightning `.ckpt`) that one rank writes.

The layouts are the ones Megatron-Core's `dist_checkpointing.save` and Lightning's
`ModelCheckpoint` produce on 2 nodes with node-local spools (see cachex_agent/rules/ for the
functions they come from): what only node 0 holds must reach node 1 (mirrored), be
captured with its checkpoint, and come back at the spool root after node 0 is lost."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess

import pytest
from harness import BIN, MPIEXEC, files_of, kill_tree, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
TRACKER = "latest_checkpointed_iteration.txt"
ITER = "iter_0000004"
SINGLE = "epoch=0-step=4.ckpt"


def write(path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def megatron_save(c) -> None:
    """dist_checkpointing.save's order: rank 0's common.pt, every rank's shard, the
    coordinator's .metadata, rank 0's metadata.json; then Megatron-LM's tracker."""
    write(c.spool(0) / ITER / "common.pt", b"common" * 100)
    write(c.spool(0) / ITER / "__0_0.distcp", os.urandom(4096))
    write(c.spool(1) / ITER / "__1_0.distcp", os.urandom(4096))
    write(c.spool(0) / ITER / ".metadata", b"dcp-metadata")
    write(c.spool(0) / ITER / "metadata.json",
          b'{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    # a mode of its own (not our 0600 nor the umask's), set before it names anything
    os.close(os.open(c.spool(0) / TRACKER, os.O_CREAT | os.O_WRONLY, 0o640))
    os.chmod(c.spool(0) / TRACKER, 0o640)
    write(c.spool(0) / TRACKER, b"4")


def test_tracker_and_single_file_captured_mirrored_recovered(cluster):
    c = cluster(nodes=2, rule="auto", commit='settle = "0.5s"\ntimeout = "60s"')
    c.start_agents()
    megatron_save(c)
    c.wait_level(ITER, "flushed", timeout=120)
    write(c.spool(0) / SINGLE, os.urandom(8192))        # global rank 0 only
    c.wait_level(SINGLE, "flushed", timeout=120)

    rules = {row["id"]: row.get("rule") for row in c.status()["checkpoints"]}
    assert rules == {ITER: "megatron", SINGLE: "torch"}, rules
    shown = c.cachex("status", "--config", str(c.config)).stdout
    assert "megatron" in shown and "torch" in shown, shown
    # node 1 reads what node 0 alone wrote: mirrored without configuration
    wait_for(lambda: (c.spool(1) / SINGLE).is_file() and (c.spool(1) / TRACKER).is_file(),
             60, "mirror of the spool-root files to node 1")
    assert (c.spool(1) / SINGLE).read_bytes() == (c.spool(0) / SINGLE).read_bytes()
    assert (c.spool(1) / TRACKER).read_text() == "4"
    for name in ("common.pt", ".metadata", "metadata.json"):
        assert (c.spool(1) / ITER / name).read_bytes() == (c.spool(0) / ITER / name).read_bytes()
    node0 = {ITER: files_of(c.spool(0) / ITER), SINGLE: (c.spool(0) / SINGLE).read_bytes()}
    node1_part = files_of(c.spool(1) / ITER)

    kill_tree(c.agents)                                 # node 0 is lost ...
    shutil.rmtree(c.root / "node0")
    c.spool(0).mkdir(parents=True)
    os.rename(c.pfs, c.root / "pfs-gone")               # ... and the PFS is down
    c.pfs.write_text("down")

    for ckpt in (ITER, SINGLE):
        result = subprocess.run([str(MPIEXEC), "-n", "2", str(BIN / "cachex"), "recover",
                                 "--config", str(c.config), "--ckpt", ckpt],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
    assert files_of(c.spool(0) / ITER) == node0[ITER]
    assert files_of(c.spool(1) / ITER) == node1_part
    # the tracker names the recovered iteration on both nodes; the single file is back
    # at the spool root as a file, not a directory
    for node in range(2):
        assert (c.spool(node) / TRACKER).read_text().strip() == "4"
        # rewritten to name the recovered iteration, with the trainer's mode
        assert stat.S_IMODE((c.spool(node) / TRACKER).stat().st_mode) == 0o640
        assert (c.spool(node) / SINGLE).read_bytes() == node0[SINGLE]
    assert not any(p.name.startswith(".cachex") for n in range(2) for p in c.spool(n).iterdir())


def test_a_tracker_written_just_after_the_commit_is_captured_and_mirrored(cluster):
    """Megatron-LM writes its tracker after a barrier that follows `metadata.json`, which
    commits the save first: the capture waits for the tracker up to `commit.settle`, so
    node 1's tracker names the new iteration, not the previous one (seen on a loaded
    machine in the Megatron drill: node 1 kept "2" after iteration 4 was flushed)."""
    c = cluster(nodes=2, rule="auto", commit='settle = "2s"\ntimeout = "60s"')
    c.start_agents()
    megatron_save(c)
    c.wait_level(ITER, "flushed", timeout=120)
    wait_for(lambda: (c.spool(1) / TRACKER).is_file(), 60, "the tracker on node 1")
    later = "iter_0000008"
    write(c.spool(0) / later / "common.pt", b"common" * 100)
    write(c.spool(1) / later / "__1_0.distcp", os.urandom(4096))
    write(c.spool(0) / later / "__0_0.distcp", os.urandom(4096))
    write(c.spool(0) / later / ".metadata", b"dcp-metadata")
    write(c.spool(0) / later / "metadata.json", b'{"sharded_backend": "torch_dist"}')
    # node 0's capture of it has begun (committed by metadata.json); then the tracker
    wait_for(lambda: any(e.get("event") == "capture_start" and e.get("ckpt") == later
                         for e in c.events(0)), 60, "node 0's capture of iteration 8")
    write(c.spool(0) / TRACKER, b"8")
    c.wait_level(later, "flushed", timeout=120)
    wait_for(lambda: (c.spool(1) / TRACKER).read_text() == "8", 30,
             "node 1's tracker naming iteration 8")
