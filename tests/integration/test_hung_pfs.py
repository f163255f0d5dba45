"""A hung PFS stops only what needs the PFS.

The PFS is a real ext4 on a loop device (benchmarks/contention.py), frozen with
`fsfreeze -f` while the agents run: every write to it blocks, as on a hung Lustre.
The coordinator writes its manifests, index and status there off the thread that
services MPI, so a checkpoint committed during the freeze still reaches `replicated`
(credits, commits and levels go on); once thawed it reaches `flushed`.
"""

from __future__ import annotations

import subprocess

import pytest
from contention import ThrottledPFS, unavailable
from predict import write_checkpoint

from cachex_agent import config as configuration

MiB = 1024 * 1024


def levels_of(cluster, ckpt: str) -> list[str]:
    return [e["event"] for e in cluster.events(0)
            if e.get("ckpt") == ckpt and e["event"].startswith("level_")]


@pytest.mark.timeout(300)
def test_a_checkpoint_committed_during_a_pfs_freeze_is_replicated(cluster, tmp_path):
    assert unavailable() is None, f"this test needs root and loop devices: {unavailable()}"
    buffer = memoryview(bytes(range(256)) * 4096)
    with ThrottledPFS(tmp_path / "mnt", size="256MiB") as pfs:
        (tmp_path / "pfs").symlink_to(pfs.path)
        c = cluster(nodes=2)
        cfg = configuration.load(c.config)
        frozen = False
        try:
            c.start_agents()
            write_checkpoint(cfg, c.nodes, "step_00001", 2 * MiB, buffer)
            c.wait_level("step_00001", "flushed", timeout=60)

            subprocess.run(["fsfreeze", "-f", str(pfs.path)], check=True)
            frozen = True
            write_checkpoint(cfg, c.nodes, "step_00002", 2 * MiB, buffer)
            # the journal's status and events are node-local: they go on
            c.wait_level("step_00002", "replicated", timeout=60)
            assert levels_of(c, "step_00002") == ["level_captured", "level_replicated"]
            assert not (c.pfs / "ckpt" / "step_00002" / "manifest.json").exists()

            subprocess.run(["fsfreeze", "-u", str(pfs.path)], check=True)
            frozen = False
            c.wait_level("step_00002", "flushed", timeout=60)
            assert levels_of(c, "step_00002")[-1] == "level_flushed"
            assert (c.pfs / "ckpt" / "step_00002" / "manifest.json").is_file()
            assert c.stop() == 0
        finally:
            if frozen:
                subprocess.run(["fsfreeze", "-u", str(pfs.path)], check=False)
            c.close()           # before the file system is unmounted
