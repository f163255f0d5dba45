"""Saves under a reused name are versions (issue 44, items 1 and 3): real agents on two
virtual nodes, `torch.save` into one path on every node (rule `torch`) and a `latest/`
directory refilled and marked again (rule `marker:*/COMMITTED`); every save waited to
`flushed` under its own id (`<name>`, `<name>@v2`, ...); then the agents SIGKILLed, node
0's directories deleted, and `cachex recover`: the newest version comes back, under the
trainer's name, byte for byte."""

from __future__ import annotations

import os
import re

import pytest
from harness import files_of, wait_for
from test_frameworks import train
from test_recover_survivor import lose_node0, recover, replica_of_node1

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
SAVES = 3


def version(name: str, n: int) -> str:
    return name if n == 1 else f"{name}@v{n}"


def torch_saves_on_every_node(c) -> list[dict[int, bytes]]:
    """SAVES saves into `ckpt.pt` on each node, each flushed as its own version."""
    c.start_agents()
    saves = []
    for n in range(1, SAVES + 1):
        saves.append({node: os.urandom(64 << 10) + bytes([node, n]) for node in range(2)})
        for node, data in saves[-1].items():
            (c.spool(node) / "ckpt.pt").write_bytes(data)
        c.wait_level(version("ckpt.pt", n), "flushed", timeout=120)
    assert [row["id"] for row in c.status()["checkpoints"]] == [
        version("ckpt.pt", n) for n in range(1, SAVES + 1)]
    return saves


@pytest.mark.parametrize("pfs", [True, False], ids=["pfs", "replicas-only"])
def test_torch_save_to_one_path_restores_the_newest_save(cluster, pfs):
    c = cluster(nodes=2, rule="torch", commit='settle = "0.5s"')
    saved = torch_saves_on_every_node(c)[-1]
    lose_node0(c, pfs)

    result = recover(c)
    assert re.search(r"recovered ckpt\.pt@v3\b", result.stdout), result.stdout
    for node in range(2):
        assert (c.spool(node) / "ckpt.pt").read_bytes() == saved[node]
    assert replica_of_node1(c, "ckpt.pt@v3") == {".cachex-root/ckpt.pt": saved[1]}
    assert "set aside" not in result.stdout, result.stdout


def test_an_older_version_asked_for_comes_back_under_the_name(cluster):
    c = cluster(nodes=2, rule="torch", commit='settle = "0.5s"')
    saves = torch_saves_on_every_node(c)
    lose_node0(c, pfs=True)

    result = recover(c, "--ckpt", "ckpt.pt@v2")
    for node in range(2):
        assert (c.spool(node) / "ckpt.pt").read_bytes() == saves[1][node]
    # the survivor's newest save is kept, not overwritten
    assert (c.spool(1) / ".cachex-unrecoverable-ckpt.pt").read_bytes() == saves[2][1]
    assert "node 1: ckpt.pt set aside as .cachex-unrecoverable-ckpt.pt" in result.stdout


@pytest.mark.parametrize("pfs", [True, False], ids=["pfs", "replicas-only"])
def test_a_reused_latest_directory_marked_again_restores_the_newest_save(cluster, pfs):
    c = cluster(nodes=2, rule="marker:*/COMMITTED", commit='settle = "1s"')
    c.start_agents()
    latest = [c.spool(node) / "latest" for node in range(2)]
    for n in range(1, SAVES + 1):
        parts = {1: {"w1.bin": os.urandom(64 << 10)}, 0: {"w0.bin": os.urandom(64 << 10)}}
        (latest[0] / "COMMITTED").unlink(missing_ok=True)      # the save begins
        for node in (1, 0):
            latest[node].mkdir(exist_ok=True)
            for name, data in parts[node].items():
                (latest[node] / name).write_bytes(data)
        (latest[0] / "COMMITTED").write_text(f"step {n}")        # and is committed
        c.wait_level(version("latest", n), "flushed", timeout=120)
    lose_node0(c, pfs)

    result = recover(c)
    assert re.search(r"recovered latest@v3\b", result.stdout), result.stdout
    assert files_of(c.spool(0) / "latest") == {**parts[0], "COMMITTED": b"step 3"}
    assert files_of(c.spool(1) / "latest")["w1.bin"] == parts[1]["w1.bin"]
    assert replica_of_node1(c, "latest@v3")["w1.bin"] == parts[1]["w1.bin"]


@pytest.mark.parametrize("pfs", [True, False], ids=["pfs", "replicas-only"])
def test_one_writer_saving_one_path_mirrors_and_restores_the_newest_save(cluster, pfs):
    """Lightning's `last.ckpt` and most `torch.save` scripts: global rank 0 alone saves.
    Node 1 gets each version through the mirror (its copy of the earlier one replaced,
    never taken for a save of its own) and, after node 0 is lost, the newest on both."""
    c = cluster(nodes=2, rule="torch", commit='settle = "0.5s"')
    c.start_agents()
    for n in range(1, SAVES + 1):
        saved = os.urandom(64 << 10) + bytes([n])
        (c.spool(0) / "last.ckpt").write_bytes(saved)
        c.wait_level(version("last.ckpt", n), "flushed", timeout=120)
    wait_for(lambda: (c.spool(1) / "last.ckpt").read_bytes() == saved, 60,
             "the newest save mirrored to node 1")
    assert [row["id"] for row in c.status()["checkpoints"]] == [
        version("last.ckpt", n) for n in range(1, SAVES + 1)]
    lose_node0(c, pfs)

    result = recover(c)
    assert re.search(r"recovered last\.ckpt@v3\b", result.stdout), result.stdout
    for node in range(2):
        assert (c.spool(node) / "last.ckpt").read_bytes() == saved
    assert "set aside" not in result.stdout, result.stdout


@pytest.mark.timeout(600)
@pytest.mark.parametrize("pfs", [True, False], ids=["pfs", "replicas-only"])
def test_lightning_save_last_resumes_from_the_newest_save(cluster, tmp_path, pfs):
    """`ModelCheckpoint(save_last=True)` rewrites `last.ckpt` at each of its 5 saves
    (epochs 2 to 10, 2 s apart: each settles before the next); every one is a version,
    flushed. The agents drain, node 0 is lost, `cachex recover` brings the 5th save back
    byte for byte on both nodes, and Lightning resumed from it ends where an
    uninterrupted run of 12 epochs does."""
    c = cluster(nodes=2, rule="auto", commit='settle = "0.5s"\ntimeout = "60s"')
    c.start_agents()
    args = ("--epochs", "12", "--every", "2")
    train("lightning_trainer.py", c.root, *args, "--stop-at", "10", "--pause", "2")
    fifth = (c.spool(0) / "last.ckpt").read_bytes()
    c.wait_level("last.ckpt@v5", "flushed", timeout=120)  # committed after the trainer ended
    assert c.stop() == 0
    versions = [row["id"] for row in c.status()["checkpoints"]
                if row["id"].split("@v")[0] == "last.ckpt" and row["level"] == "flushed"]
    assert versions == [version("last.ckpt", n) for n in range(1, 6)]
    lose_node0(c, pfs)

    result = recover(c)
    assert re.search(r"recovered last\.ckpt@v5\b", result.stdout), result.stdout
    for node in range(2):
        assert (c.spool(node) / "last.ckpt").read_bytes() == fifth
    resumed = train("lightning_trainer.py", c.root, *args, "--resume")
    assert resumed == train("lightning_trainer.py", tmp_path / "reference", *args)


def pattern(save: int, size: int = 1 << 20) -> bytes:
    """Save `save`'s bytes: one value throughout, so a mix of two saves shows."""
    return bytes([save]) * size


def test_a_save_in_place_during_the_capture_of_the_previous_one_is_never_mixed(
        cluster, tmp_path):
    """Node 0's capture of `latest` stops after its first file (a fault switch); the
    trainer meanwhile rewrites both files in place and marks the directory again. What
    the capture took before the rewrite must not be reported with what it takes after:
    the first version's save is gone, so its capture fails as superseded (reported), and
    the second version, flushed, holds the second save whole as verified and exported."""
    pause = tmp_path / "pause"
    pause.mkdir()
    c = cluster(nodes=2, rule="marker:*/COMMITTED", commit='settle = "1s"')
    c.start_agents(env={"CACHEX_TEST_CAPTURE_PAUSE": f"0:{pause}"})
    (c.spool(1) / "latest").mkdir()
    (c.spool(1) / "latest" / "w1.bin").write_bytes(pattern(9))
    latest = c.spool(0) / "latest"
    latest.mkdir()
    for save in (1, 2):
        for name in ("a.bin", "b.bin"):
            with open(latest / name, "r+b" if save > 1 else "wb") as f:     # in place
                f.write(pattern(save))
        (latest / "COMMITTED").write_text(str(save))
        if save == 1:
            wait_for(lambda: (pause / "paused-latest").exists(), 60, "the paused capture")
    (pause / "resume-latest").touch()
    wait_for(lambda: (pause / "paused-latest@v2").exists(), 60, "version 2's capture")
    (pause / "resume-latest@v2").touch()
    c.wait_level("latest", "failed", timeout=120)
    c.wait_level("latest@v2", "flushed", timeout=120)
    assert c.stop() == 0

    first = c.status()["checkpoints"][0]
    assert first["id"] == "latest" and "superseded" in first["reason"], first
    assert first["superseded"] == 1
    verify = c.cachex("verify", "latest@v2")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    dest = tmp_path / "export" / "latest@v2"
    exported = c.cachex("export", "latest@v2", str(dest))
    assert exported.returncode == 0, exported.stdout + exported.stderr
    files = files_of(dest)
    assert files["COMMITTED"] == b"2" and files["a.bin"] == files["b.bin"] == pattern(2)
