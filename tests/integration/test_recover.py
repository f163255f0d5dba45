"""`cachex recover` after real losses: SIGKILLed agents and trainer, deleted node
directories, an unreadable PFS, corrupted copies; then the trainer resumes unchanged."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Any

import pytest
from harness import BIN, MPIEXEC, Cluster, files_of, finish, kill_tree

from cachex_agent.journal import Journal
from cachex_agent.layout import global_manifests_dir
from cachex_agent.manifest import GlobalManifest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
TRAIN = ["--shard-size", "256KiB", "--chunk-size", "64KiB", "--step-time", "0.02",
         "--files-per-rank", "4", "--every", "4"]        # 8 ranks x 4 = 32 shards + .metadata


def trained(cluster, steps: int, **kwargs: Any) -> Cluster:
    """Agents and trainer ran `steps` steps; everything flushed; agents stopped."""
    c = cluster(**kwargs)
    c.start_agents()
    finish(c.trainer("--steps", str(steps), *TRAIN))
    c.wait_level(f"step_{steps:05d}", "flushed")
    assert c.stop() == 0
    return c


def recover(c: Cluster, *args: str, nodes: int = 4) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(MPIEXEC), "-n", str(nodes), str(BIN / "cachex"), "recover",
                           "--config", str(c.config), *args],
                          capture_output=True, text=True, timeout=180)


def lose_node(c: Cluster, node: int) -> None:
    """Everything node-local is gone; a replacement node has an empty spool."""
    shutil.rmtree(c.root / f"node{node}")
    c.spool(node).mkdir(parents=True)


def unreadable_pfs(c: Cluster) -> None:
    os.rename(c.pfs, c.root / "pfs-gone")
    c.pfs.write_text("the parallel file system is down")


def reference_hash(tmp_path, steps: int) -> str:
    ref = Cluster(tmp_path / "reference", nodes=4)
    try:
        out = finish(ref.trainer("--steps", str(steps), *TRAIN))
    finally:
        ref.close()
    return out.strip().splitlines()[-1].split()[-1]


def snapshot(c: Cluster, ckpt: str) -> dict[int, dict[str, bytes]]:
    """Every node's own files (not the `.metadata` mirrored into nodes 1-3)."""
    parts = {n: files_of(c.spool(n) / ckpt) for n in range(4)}
    for node in range(1, 4):
        parts[node].pop(".metadata", None)
    return parts


def expected_after(before: dict[int, dict[str, bytes]]) -> dict[int, dict[str, bytes]]:
    """Each node gets its own files back, plus the global `.metadata` of node 0."""
    metadata = {".metadata": before[0][".metadata"]}
    return {n: {**files, **metadata} for n, files in before.items()}


def committed_since(c: Cluster, oldest: str) -> list[str]:
    """Checkpoints of node 0's spool with their commit marker, `oldest` and newer."""
    return sorted(d.name for d in c.spool(0).glob("step_*") if (d / ".metadata").exists()
                  and int(d.name[5:]) >= int(oldest[5:]))


def killed_after_a_replica(c, trainer) -> dict[str, dict[int, dict[str, bytes]]]:
    """Trainer and agents SIGKILLed once step_00008 is replicated; every checkpoint a
    recovery may then pick, with each node's files. status.json lags the replicas by up
    to one write: a newer checkpoint replicated everywhere just before the kill may be the
    one recovered, never an older one."""
    c.wait_level("step_00008", "replicated", "flushed", timeout=90)
    kill_tree(trainer)                       # node 0's loss ends the trainer and the agents
    kill_tree(c.agents)
    newest = max((ckpt for ckpt, level in c.levels().items()
                  if level in ("replicated", "flushed")), key=lambda k: int(k[5:]))
    assert sum(len(files) for files in snapshot(c, newest).values()) == 33
    return {ckpt: snapshot(c, ckpt) for ckpt in committed_since(c, newest)}


def test_drill_coordinator_node_lost_and_pfs_down(cluster, tmp_path):
    c = cluster()
    c.start_agents()
    candidates = killed_after_a_replica(c, c.trainer("--steps", "200", *TRAIN))
    lose_node(c, 0)
    unreadable_pfs(c)

    result = recover(c)
    assert result.returncode == 0, result.stdout + result.stderr
    recovered = re.search(r"recovered (step_\d+)", result.stdout)
    assert recovered and recovered.group(1) in candidates, result.stdout
    newest = recovered.group(1)
    before = candidates[newest]
    assert "replica on node 1" in result.stdout
    for node, files in expected_after(before).items():
        assert files_of(c.spool(node) / newest) == files
    # redundancy is back: node 0's restored part is again on its partner, with a manifest
    replica = c.root / "node1" / "nvme" / "t" / "replicas" / "node-00000"
    assert (replica / f"{newest}.manifest.json").exists()
    assert files_of(replica / newest) == before[0]

    out = finish(c.trainer("--steps", "16", "--resume", *TRAIN))
    assert f"resumed from {newest}" in out
    assert out.strip().splitlines()[-1].split()[-1] == reference_hash(tmp_path, 16)


def test_recovery_from_the_pfs_alone(cluster):
    c = trained(cluster, 8)
    before = snapshot(c, "step_00008")
    for node in range(4):
        lose_node(c, node)
    dry = recover(c, "--dry-run")
    assert dry.returncode == 0 and "from the PFS bundle" in dry.stdout, dry.stdout + dry.stderr
    assert not (c.spool(0) / "step_00008").exists()           # a dry run changes nothing
    result = recover(c)
    assert result.returncode == 0, result.stdout + result.stderr
    for node, files in expected_after(before).items():
        assert files_of(c.spool(node) / "step_00008") == files


def test_falls_back_to_an_older_checkpoint_and_says_why(cluster):
    c = trained(cluster, 8)
    before = snapshot(c, "step_00004")
    lose_node(c, 0)
    lose_node(c, 1)                                  # node 0's partner: its replicas too
    (c.pfs / "ckpt" / "step_00008" / "node-00000.h5").unlink()
    result = recover(c)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "step_00008: not recoverable: node 0's files" in result.stdout, result.stdout
    assert "recovered step_00004" in result.stdout
    for node, files in expected_after(before).items():
        assert files_of(c.spool(node) / "step_00004") == files
    assert not (c.spool(2) / "step_00008").exists()          # moved aside for the resume
    assert (c.spool(2) / ".cachex-unrecoverable-step_00008").is_dir()


def flip_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[123] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_replica_found_corrupt_in_transfer_gives_that_file_from_the_pfs(cluster):
    c = trained(cluster, 4)
    before = snapshot(c, "step_00004")
    lose_node(c, 0)
    shard = c.root / "node1/nvme/t/replicas/node-00000/step_00004/__0_1.distcp"
    flip_byte(shard)
    result = recover(c)
    assert result.returncode == 0, result.stdout + result.stderr
    # the replica is chosen (only sizes are checked before the move) and found corrupt as
    # it is moved: that one file comes from the next copy, the reason in the summary
    assert "node 0: 9 files of node 0 from replica on node 1" in result.stdout, result.stdout
    assert ("taken from another copy: node 0: __0_1.distcp of node 0: replica on node 1:"
            " checksum mismatch; taken from the PFS bundle") in result.stdout, result.stdout
    assert files_of(c.spool(0) / "step_00004") == before[0]
    # the bad replica was replaced by a good one
    assert shard.read_bytes() == before[0]["__0_1.distcp"]


@pytest.mark.parametrize("capture, source", [
    ("copy", "taken from its own stage"),
    # captured by hard link, the stage is the same file: found bad too, never served
    ("auto", "its own stage: checksum mismatch; taken from replica on node 3")])
def test_a_corrupt_file_kept_in_place_comes_from_another_copy(cluster, capture, source):
    c = trained(cluster, 4, extra=f'[stage]\ncapture = "{capture}"')
    before = snapshot(c, "step_00004")
    lose_node(c, 0)
    flip_byte(c.spool(2) / "step_00004" / "__4_0.distcp")      # a survivor's own file
    result = recover(c)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "node 2: 8 files of node 2 from its own spool" in result.stdout, result.stdout
    assert ("node 2: __4_0.distcp of node 2: its own spool: checksum mismatch; " + source
            ) in result.stdout, result.stdout
    for node, files in expected_after(before).items():
        assert files_of(c.spool(node) / "step_00004") == files
    # the bad file was the survivor's: set aside, not overwritten, and said
    flipped = files_of(c.spool(2) / ".cachex-unrecoverable-step_00004")
    assert flipped.keys() == {"__4_0.distcp"}
    assert flipped["__4_0.distcp"] != before[2]["__4_0.distcp"]
    assert ("set aside: node 2: step_00004/__4_0.distcp set aside as"
            " .cachex-unrecoverable-step_00004/__4_0.distcp") in result.stdout, result.stdout


def every_file(before: dict[int, dict[str, bytes]]) -> dict[str, bytes]:
    """The whole checkpoint in one directory: every node's files and `.metadata`."""
    return {**expected_after(before)[0], **{p: d for f in before.values() for p, d in f.items()}}


def test_a_dcp_resize_needs_to_then_goes_there_once_when_it_fits(cluster, tmpfs, tmp_path):
    """Onto fewer or more nodes a DCP checkpoint is not copied whole into every spool:
    refused without `--to` (exit 2, one line naming it), then restored once into DIR."""
    c = trained(cluster, 4)
    before = snapshot(c, "step_00004")
    lose_node(c, 0)                 # no spare: the job goes on with 3 nodes
    for onto in (3, 5):
        refused = recover(c, nodes=onto)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert refused.stderr.count("error:") == 1 and "Traceback" not in refused.stderr
        assert (f"step_00004: a PyTorch DCP checkpoint of 4 nodes onto {onto}: give"
                " `cachex recover --to DIR`") in refused.stderr, refused.stderr
    assert not list(c.spool(0).iterdir())   # nothing written anywhere
    out = tmp_path / "shared"
    tmpfs(out, "512k")              # the checkpoint is 2 MiB: the directory cannot hold it
    result = recover(c, "--to", str(out), nodes=3)
    assert result.returncode == 1
    assert re.search(r"needs 2\.\d MiB \(\d+ bytes\), 512\.0 KiB \(\d+ bytes\) free: the"
                     r" placement does not fit", result.stderr), result.stderr
    subprocess.run(["mount", "-o", "remount,size=64m", str(out)], check=True)
    result = recover(c, "--to", str(out), nodes=3)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "node 1: 9 files of node 0 from its own replica" in result.stdout, result.stdout
    assert files_of(out / "step_00004") == every_file(before)
    for node in range(1, 3):        # the spools are left as they were
        assert files_of(c.spool(node) / "step_00004") == expected_after(before)[node]


def test_recover_to_a_shared_directory_from_the_survivors(cluster, tmp_path):
    c = trained(cluster, 4)
    before = snapshot(c, "step_00004")
    lose_node(c, 0)
    unreadable_pfs(c)               # `cachex export` cannot: the replicas and spools can
    out = tmp_path / "gathered"
    result = recover(c, "--to", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "node 1: 9 files of node 0 from its own replica" in result.stdout, result.stdout
    assert f"assembled step_00004 in {out}: 33 files" in result.stdout, result.stdout
    assert files_of(out / "step_00004") == every_file(before)
    assert not list(c.spool(0).iterdir())          # the spools are left as they were
    assert not [p for p in out.iterdir() if p.name != "step_00004"]   # no temporaries
    inside = recover(c, "--to", str(c.spool(2) / "out"), nodes=3)
    assert inside.returncode == 2 and inside.stderr.count("error:") == 1, inside.stderr
    assert f"--to {c.spool(2) / 'out'}: overlaps paths.spool ({c.spool(2)})" in inside.stderr
    for bad, key in ((c.root, "paths.spool"), (c.pfs.parent / "other-run",
                                              "paths.pfs")):   # above a spool; another run
        refused = recover(c, "--to", str(bad), nodes=3)
        assert refused.returncode == 2 and f"--to {bad}: overlaps {key}" in refused.stderr, \
            refused.stderr


def test_single_process_recovery_of_a_one_node_job(cluster):
    c = cluster(nodes=1, model='path = "auto"')     # one failure domain: flush-only
    c.start_agents()
    finish(c.trainer("--steps", "8", *TRAIN, ranks=2, ranks_per_node=2))
    c.wait_level("step_00008", "flushed")
    assert c.stop() == 0
    before = files_of(c.spool(0) / "step_00008")
    shutil.rmtree(c.spool(0))                       # the trainer's spool is gone
    c.spool(0).mkdir()
    result = subprocess.run([str(BIN / "cachex"), "recover", "--config", str(c.config)],
                            capture_output=True, text=True, timeout=120)   # no mpiexec
    assert result.returncode == 0, result.stdout + result.stderr
    assert "9 files of node 0 from its own stage" in result.stdout, result.stdout
    assert files_of(c.spool(0) / "step_00008") == before


def test_the_global_manifest_is_rebuilt_from_the_survivors_when_no_holder_has_it(cluster):
    """As the agents of issue 24 leave it: only node 0 and the holders keep the whole
    manifest, every other journal a digest. Node 0 lost, the PFS down and the holders'
    copies gone: the survivors' local and replica manifests rebuild it."""
    c = trained(cluster, 4)
    before = snapshot(c, "step_00004")
    lose_node(c, 0)
    unreadable_pfs(c)
    for node in range(1, 4):
        journal = Journal(c.journal(node))
        for path in sorted(global_manifests_dir(c.journal(node)).glob("*.json")):
            manifest = GlobalManifest.load(path)
            journal.update(manifest.ckpt, **{"global": manifest.digest().to_json()})
            path.unlink()
    result = recover(c)
    assert result.returncode == 0, result.stdout + result.stderr
    assert ("step_00004: no holder or PFS has its global manifest; rebuilt from 4 parts'"
            " local and replica manifests") in result.stderr, result.stderr
    for node, files in expected_after(before).items():
        assert files_of(c.spool(node) / "step_00004") == files, node
