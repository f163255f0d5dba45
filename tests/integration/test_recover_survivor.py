"""`cachex recover` never destroys what a surviving node holds (issue 44, item 5).

Two virtual nodes, real agents SIGKILLed, node 0's directories deleted (its spool, stage,
journal and the replicas it held for node 1: the lost node's replica does not survive),
then `cachex recover` on both. A survivor whose spool holds a newer save under the
checkpoint's name (the trainer wrote it after the agents died) keeps it, set aside as
`.cachex-unrecoverable-<name>` and named in the summary, and the single-file checkpoint of
the `torch` rule is copied to the lost node's replica store again from the spool root."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from harness import BIN, MPIEXEC, Cluster, files_of, kill_tree

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
SINGLE = "ckpt.pt"
LATEST = "latest"


def lose_node0(c: Cluster, pfs: bool) -> None:
    """Agents SIGKILLed, node 0's disks gone (a replacement with an empty spool); the PFS
    down too unless `pfs`."""
    kill_tree(c.agents)
    shutil.rmtree(c.root / "node0")
    c.spool(0).mkdir(parents=True)
    if not pfs:
        os.rename(c.pfs, c.root / "pfs-gone")
        c.pfs.write_text("the parallel file system is down")


def recover(c: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(MPIEXEC), "-n", "2", str(BIN / "cachex"), "recover",
                             "--config", str(c.config), *args],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def replica_of_node1(c: Cluster, ckpt: str) -> dict[str, bytes]:
    """What node 0's replica store holds of node 1's part of `ckpt`."""
    held = c.root / "node0" / "nvme" / "t" / "replicas" / "node-00001"
    assert (held / f"{ckpt}.manifest.json").is_file(), list(held.parent.rglob("*"))
    return files_of(held / ckpt)


def torch_saves(c: Cluster) -> dict[int, bytes]:
    """Each node's trainer saves its own `ckpt.pt` at its spool root (torch.save)."""
    saved = {node: os.urandom(96 << 10) + bytes([node]) for node in range(2)}
    for node, data in saved.items():
        (c.spool(node) / SINGLE).write_bytes(data)
    c.wait_level(SINGLE, "flushed", timeout=120)
    return saved


@pytest.mark.parametrize("pfs", [True, False], ids=["pfs", "replicas-only"])
def test_a_single_file_checkpoint_comes_back_and_is_replicated_again(cluster, pfs):
    c = cluster(nodes=2, rule="torch", commit='settle = "0.5s"')
    c.start_agents()
    saved = torch_saves(c)
    lose_node0(c, pfs)

    result = recover(c)
    for node in range(2):
        assert (c.spool(node) / SINGLE).read_bytes() == saved[node], result.stdout
    # node 1's replica died with node 0: it is there again, taken from node 1's spool root
    assert replica_of_node1(c, SINGLE) == {f".cachex-root/{SINGLE}": saved[1]}
    assert "set aside" not in result.stdout, result.stdout


@pytest.mark.parametrize("pfs", [True, False], ids=["pfs", "replicas-only"])
def test_a_newer_single_file_save_on_a_survivor_is_set_aside(cluster, pfs):
    c = cluster(nodes=2, rule="torch", commit='settle = "0.5s"')
    c.start_agents()
    saved = torch_saves(c)
    kill_tree(c.agents)
    newer = os.urandom(80 << 10)
    (c.spool(1) / SINGLE).write_bytes(newer)        # torch.save again, in place
    lose_node0(c, pfs)

    result = recover(c)
    assert (c.spool(1) / SINGLE).read_bytes() == saved[1]
    aside = c.spool(1) / f".cachex-unrecoverable-{SINGLE}"
    assert aside.read_bytes() == newer
    assert f"set aside: node 1: {SINGLE} set aside as {aside.name}" in result.stdout, \
        result.stdout
    assert (c.spool(0) / SINGLE).read_bytes() == saved[0]


def marker_saves(c: Cluster) -> dict[int, dict[str, bytes]]:
    """Node 1 writes its part of `latest/`, node 0 its part and the marker last."""
    parts = {1: {"w1.bin": os.urandom(64 << 10)},
             0: {"w0.bin": os.urandom(64 << 10), "COMMITTED": b"step 100"}}
    for node in (1, 0):
        (c.spool(node) / LATEST).mkdir()
        for name, data in parts[node].items():
            (c.spool(node) / LATEST / name).write_bytes(data)
    c.wait_level(LATEST, "flushed", timeout=120)
    return parts


@pytest.mark.parametrize("capture, pfs", [("copy", False), ("link", True)],
                         ids=["copied-replicas-only", "linked-pfs"])
def test_a_rewritten_file_in_a_kept_directory_is_set_aside(cluster, capture, pfs):
    """Node 1 rewrites `latest/w1.bin` in place after the agents died: its spool copy
    fails its checksum, the file comes from the next copy (its own stage when copied;
    the PFS when captured by hard link, which the rewrite changed too), and the newer
    bytes are kept below `.cachex-unrecoverable-latest/`."""
    c = cluster(nodes=2, rule="marker:*/COMMITTED", commit='settle = "1s"',
                extra=f'[stage]\ncapture = "{capture}"')
    c.start_agents()
    parts = marker_saves(c)
    kill_tree(c.agents)
    newer = os.urandom(64 << 10)
    (c.spool(1) / LATEST / "w1.bin").write_bytes(newer)
    lose_node0(c, pfs)

    result = recover(c)
    # a stage linked to the spool file was rewritten with it: never served
    tried = ("taken from its own stage" if capture == "copy"
             else "its own stage: checksum mismatch; taken from the PFS bundle")
    assert f"w1.bin of node 1: its own spool: checksum mismatch; {tried}" in result.stdout, \
        result.stdout
    assert "latest/w1.bin set aside as .cachex-unrecoverable-latest/w1.bin" in result.stdout
    assert files_of(c.spool(1) / ".cachex-unrecoverable-latest") == {"w1.bin": newer}
    assert files_of(c.spool(1) / LATEST) == {**parts[1], "COMMITTED": b"step 100"}
    assert files_of(c.spool(0) / LATEST) == parts[0]
    assert replica_of_node1(c, LATEST) == parts[1]


def test_a_directory_not_kept_in_place_is_set_aside_whole_and_an_earlier_one_stays(cluster):
    """`--exclude spool`: node 1's part comes from its stage into a new directory, and
    the spool's `latest/` (a newer file in it) goes aside whole, beside the set-aside
    copy an earlier recovery left, which is not touched."""
    c = cluster(nodes=2, rule="marker:*/COMMITTED", commit='settle = "1s"',
                extra='[stage]\ncapture = "copy"')
    c.start_agents()
    parts = marker_saves(c)
    kill_tree(c.agents)
    (c.spool(1) / LATEST / "extra.bin").write_bytes(b"written after the agents died")
    earlier = c.spool(1) / ".cachex-unrecoverable-latest"
    earlier.mkdir()
    (earlier / "old.bin").write_bytes(b"an earlier recovery's")
    lose_node0(c, pfs=False)

    result = recover(c, "--exclude", "spool")
    aside = c.spool(1) / ".cachex-unrecoverable-latest.2"
    assert f"set aside: node 1: {LATEST} set aside as {aside.name}" in result.stdout, \
        result.stdout
    assert files_of(aside) == {**parts[1], "COMMITTED": b"step 100",
                               "extra.bin": b"written after the agents died"}
    assert files_of(earlier) == {"old.bin": b"an earlier recovery's"}
    assert files_of(c.spool(1) / LATEST) == {**parts[1], "COMMITTED": b"step 100"}
