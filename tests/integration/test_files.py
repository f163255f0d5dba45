"""How cachex creates and names files, with real agents: private modes whatever the umask,
no setuid/setgid carried, any name the file system allows, no temporary left for good
after a SIGKILL mid-flush (issue 10, points 4, 5 and 7)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from harness import BIN, MPIEXEC, Cluster, files_of, kill_tree, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
CKPT = "step_00001"
NOBODY = 65534
Part = dict[str, tuple[bytes, int]]         # relative path -> (bytes, mode)


@pytest.fixture
def umask022():
    old = os.umask(0o022)           # inherited by every agent, `cachex` and mpiexec rank
    yield
    os.umask(old)


def write_checkpoint(c: Cluster, parts: dict[int, Part], foreign: tuple[str, ...] = ()
                     ) -> None:
    """What a DCP trainer does: every node's files, then node 0's `.metadata` renamed in
    last. Paths in `foreign` belong to another user (chown before chmod: chown clears
    the setuid and setgid bits)."""
    for node in sorted(parts, reverse=True):
        for rel, (data, mode) in parts[node].items():
            if rel == ".metadata":
                continue
            path = c.spool(node) / CKPT / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            if rel in foreign:
                os.chown(path, NOBODY, NOBODY)
            os.chmod(path, mode)
    metadata, mode = parts[0][".metadata"]
    temp = c.spool(0) / CKPT / ".metadata.tmp"
    temp.write_bytes(metadata)
    os.chmod(temp, mode)
    os.rename(temp, c.spool(0) / CKPT / ".metadata")


def recover(c: Cluster, *args: str) -> None:
    result = subprocess.run([str(MPIEXEC), "-n", str(c.nodes), str(BIN / "cachex"), "recover",
                             "--config", str(c.config), *args],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr


def lose_node(c: Cluster, node: int) -> None:
    shutil.rmtree(c.root / f"node{node}")
    c.spool(node).mkdir(parents=True)


def cachex_roots(c: Cluster) -> list[Path]:
    """Every directory cachex created for the run: stage and cache (journal, replicas) of
    each node, from the first directory it made, and the PFS run directory."""
    return [*(c.root / f"node{n}" / kind for n in range(c.nodes) for kind in ("shm", "nvme")),
            c.pfs]


def modes_under(root: Path) -> dict[str, int]:
    """Mode (with setuid/setgid/sticky) of `root` and of everything below it."""
    return {str(p): stat.S_IMODE(p.lstat().st_mode) for p in [root, *root.rglob("*")]}


def assert_private(root: Path, trainers: frozenset[tuple[int, int]] = frozenset()) -> None:
    """Every directory 0700, every file 0600, but for the trainer's own files (device,
    inode in `trainers`) that a capture by hard link put in the stage: never chmodded."""
    wrong = {path: oct(mode) for path, mode in modes_under(root).items()
             if mode != (0o700 if Path(path).is_dir() else 0o600)
             and inode(Path(path)) not in trainers}
    assert not wrong, f"not 0700 (directories) / 0600 (files): {wrong}"


def inode(path: Path) -> tuple[int, int]:
    st = path.lstat()
    return st.st_dev, st.st_ino


def spooled(c: Cluster) -> frozenset[tuple[int, int]]:
    """The trainer's files in every node's spool."""
    return frozenset(inode(p) for n in range(c.nodes) for p in c.spool(n).rglob("*")
                     if p.is_file())


def assert_trainer_files(directory: Path, expected: Part) -> None:
    """Restored or exported files: the bytes, the permission bits without setuid, setgid,
    sticky, owned by whoever runs cachex; every directory cachex made in between 0700."""
    assert {rel: data for rel, data in files_of(directory).items()} == {
        rel: data for rel, (data, _) in expected.items()}
    for rel, (_, mode) in expected.items():
        st = (directory / rel).stat()
        assert stat.S_IMODE(st.st_mode) == mode & 0o777, (rel, oct(st.st_mode))
        assert (st.st_uid, st.st_gid) == (os.getuid(), os.getgid()), rel
    made = {path: oct(mode) for path, mode in modes_under(directory).items()
            if Path(path).is_dir() and mode != 0o700}
    assert not made, f"directories not 0700: {made}"


# -------------------------------------------------------------- point 4: modes
def test_files_are_private_whatever_the_umask_and_never_setuid(cluster, tmp_path, umask022):
    parts = {0: {".metadata": (b"dcp metadata\n", 0o600), "__0_0.distcp": (b"a" * 70000, 0o600)},
             1: {"__1_0.distcp": (b"b" * 50000, 0o600),
                 "bin/resume.sh": (b"#!/bin/sh\nexec train\n", 0o6755)}}
    c = cluster(nodes=2)
    c.start_agents()
    write_checkpoint(c, parts, foreign=("bin/resume.sh",))
    c.wait_level(CKPT, "flushed")

    out = tmp_path / "export"
    result = c.cachex("export", CKPT, str(out))
    assert result.returncode == 0, result.stderr
    assert_trainer_files(out, {**parts[0], **parts[1]})
    assert c.stop() == 0
    linked = spooled(c)
    for root in cachex_roots(c):        # stage copies, replicas, journal, events, bundles
        assert_private(root, linked)
    # the setuid file was copied into the stage (0600): never linked
    assert (c.stage(1) / CKPT / "bin/resume.sh").stat().st_nlink == 1
    assert (c.root / "node0/nvme/t/replicas/node-00001" / CKPT / "bin/resume.sh").is_file()

    lose_node(c, 1)                     # node 1's part comes back from node 0's replica
    recover(c, "--exclude", "pfs")
    assert_trainer_files(c.spool(1) / CKPT, {**parts[1], ".metadata": parts[0][".metadata"]})
    assert (c.root / "node1/nvme/t/replicas/node-00000" / CKPT).is_dir()
    for root in cachex_roots(c):        # e.g. the replica of node 0 that recover made on node 1
        if root.exists():
            assert_private(root, linked)


# ---------------------------------------------------------------- point 5: names
def test_longest_names_and_deep_paths_round_trip(cluster, tmp_path):
    longest = "n" * 251 + ".bin"                        # 255 bytes, the limit of a name
    wide = "é" * 127 + "w"                              # 255 bytes of UTF-8
    deep = "/".join(f"{level:02d}" + "d" * 198 for level in range(8)) + "/" + "f" * 255
    parts = {0: {".metadata": (b"dcp metadata\n", 0o644), longest: (b"zero" * 9000, 0o644)},
             1: {longest: (b"one" * 9000, 0o644), wide: (b"wide", 0o600),
                 deep: (b"deep" * 5000, 0o640)}}
    c = cluster(nodes=2)
    c.start_agents()
    write_checkpoint(c, parts)
    c.wait_level(CKPT, "flushed")

    result = c.cachex("export", CKPT, str(tmp_path / "export"), "--per-node")
    assert result.returncode == 0, result.stderr
    for node, part in parts.items():
        assert_trainer_files(tmp_path / "export" / f"node-{node:05d}", part)
    assert c.stop() == 0

    restored = {**parts[1], ".metadata": parts[0][".metadata"]}
    lose_node(c, 1)
    recover(c, "--exclude", "pfs")      # over MPI from node 0's replica
    assert_trainer_files(c.spool(1) / CKPT, restored)
    lose_node(c, 1)
    recover(c, "--exclude", "replica")  # from the PFS bundle
    assert_trainer_files(c.spool(1) / CKPT, restored)


# ------------------------------------------------------ point 7: stale temporaries
def test_restart_after_sigkill_mid_flush_leaves_no_temporary(cluster):
    c = cluster(nodes=2, extra='[flush]\nbandwidth = "256KiB"\nchunk = "1MiB"')
    c.start_agents()
    big = os.urandom(16 << 20)
    write_checkpoint(c, {0: {".metadata": (b"dcp metadata\n", 0o644), "__0_0.distcp":
                             (big, 0o644)}, 1: {"__1_0.distcp": (big[::-1], 0o644)}})
    pfs_ckpt = c.pfs / "ckpt" / CKPT
    wait_for(lambda: all(list(pfs_ckpt.glob(f".node-{n:05d}.h5*")) for n in range(2)), 90,
             "both nodes to be writing their bundles")
    kill_tree(c.agents)

    # Also what an agent killed in other places leaves: a capture, a replica and a
    # journal write cut short; and another node's bundle being written right now.
    earlier = [c.stage(0) / ".step_00002.tmp-cachex-partial",
               c.root / "node0/nvme/t/replicas/node-00001/.step_00002.tmp-cachex-partial",
               c.journal(1) / ".state.json.tmp-cachex-4242"]
    for path in earlier[:2]:
        path.mkdir(parents=True)
        (path / "__0_0.distcp").write_bytes(b"half")
    earlier[2].write_bytes(b"half")
    live = pfs_ckpt / ".node-00007.h5.tmp-cachex-4242"
    live.write_bytes(b"another node's flush in progress")

    c.start_agents("--set", "flush.bandwidth=0")
    c.wait_level(CKPT, "flushed")
    assert c.stop() == 0
    assert sorted(p.name for p in pfs_ckpt.iterdir()) == [
        live.name, "manifest.json", "node-00000.h5", "node-00001.h5"]
    left = [str(p) for root in cachex_roots(c)[:-1] for p in root.rglob("*")
            if ".tmp-" in p.name or "partial" in p.name]
    assert not left, f"temporaries left: {left}"
    removed = {path for node in range(2) for e in c.events(node)
               if e["event"] == "stale_removed" for path in e["paths"]}
    assert {str(p) for p in earlier} <= removed
    assert {Path(p).name.split(".tmp-")[0] for p in removed if Path(p).parent == pfs_ckpt
            } == {".node-00000.h5", ".node-00001.h5"}
