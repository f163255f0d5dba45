"""Nothing left behind (issue 26): a refused `cachex recover` removes its partial
directory, and an agent's start sweeps the ones a killed recover left in the spool.
Real agents, a real flushed checkpoint, real directories."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time

import h5py
import pytest
from harness import BIN, Cluster, kill_tree, wait_for
from test_hostile import CKPT, flushed_one_node

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
PARTIAL = f".{CKPT}.tmp-cachex-partial"


def corrupt(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_refused_recover_removes_its_partial_directory(tmp_path):
    c = flushed_one_node(tmp_path / "run")
    shutil.rmtree(c.spool(0) / CKPT)
    shard = next(p for p in sorted((c.stage(0) / CKPT).rglob("*.distcp")))
    corrupt(shard)      # the stage is the only copy left once the PFS is excluded
    result = subprocess.run([str(BIN / "cachex"), "recover", "--exclude", "pfs",
                             "--config", str(c.config)],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "no intact copy left" in result.stderr, result.stderr
    assert sorted(p.name for p in c.spool(0).iterdir()) == [], \
        sorted(c.spool(0).rglob("*"))


def test_agent_start_sweeps_a_killed_recovers_partial_directory(tmp_path):
    c = Cluster(tmp_path, nodes=1, model='path = "auto"')
    partial = c.spool(0) / PARTIAL
    (partial / "sub").mkdir(parents=True)
    (partial / "sub" / "__0_0.distcp").write_bytes(b"half")
    mine = c.spool(0) / ".trainer-hidden"       # the trainer's own: never touched
    mine.mkdir()
    try:
        c.start_agents()
        assert not partial.exists()
        assert mine.is_dir()
        assert c.stop() == 0
    finally:
        c.close()


def test_a_failed_checkpoints_complete_bundles_leave_the_pfs(cluster):
    # node 0 commits and flushes its part; node 1 never writes one, so the checkpoint
    # fails at the commit timeout with node 0's bundle complete on the PFS
    c = cluster(nodes=2, rule="marker:*/COMMITTED", commit='settle = "1s"\ntimeout = "8s"',
                agent_timeout="5s")
    c.start_agents()
    part = c.spool(0) / "step_1"
    part.mkdir()
    (part / "data.bin").write_bytes(b"node 0 data" * 1000)
    (part / "COMMITTED").write_bytes(b"")
    bundle = c.pfs / "ckpt" / "step_1" / "node-00000.h5"
    wait_for(lambda: bundle.is_file() or c.levels().get("step_1") == "failed", 60,
             "node 0's bundle")
    assert bundle.is_file(), f"failed before node 0 flushed: {c.status()}"
    c.wait_level("step_1", "failed", timeout=60)
    wait_for(lambda: not (c.pfs / "ckpt" / "step_1").exists(), 10,
             f"the failed checkpoint's PFS directory to go ({sorted(c.pfs.rglob('*'))})")
    assert c.cachex("export", "step_1", str(c.root / "out")).returncode != 0
    assert c.stop() == 0


def test_one_sigterm_stops_a_one_round_restore_within_a_file(tmp_path):
    # large files: the whole restore is one round that takes seconds
    c = flushed_one_node(tmp_path / "run", "--shard-size", "48MiB", "--chunk-size", "8MiB")
    shutil.rmtree(c.spool(0))
    c.spool(0).mkdir()
    proc = subprocess.Popen([str(BIN / "cachex"), "recover", "--config", str(c.config)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        wait_for(lambda: any(p.is_file() for p in c.spool(0).rglob("*"))
                 or proc.poll() is not None, 120, "recover to start writing", poll=0.001)
        assert proc.poll() is None, "recover finished before the signal"
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)        # one only: a second one kills at once
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        kill_tree(proc)
    assert proc.returncode == 1, out
    assert "cancelled by a signal" in out, out
    assert took < 10, f"{took:.1f}s after the signal"    # a second plus one 48 MiB file
    assert sorted(c.spool(0).iterdir()) == [], sorted(c.spool(0).rglob("*"))


def corrupt_last_dataset(bundle) -> None:
    with h5py.File(bundle, "r+") as h5:
        name = sorted(h5["files"])[-1]
        h5["files"][name][0] ^= 0xFF


def test_a_failed_export_removes_what_it_wrote(tmp_path):
    c = flushed_one_node(tmp_path / "run")
    corrupt_last_dataset(c.pfs / "ckpt" / CKPT / "node-00000.h5")
    fresh = tmp_path / "out" / "fresh"
    result = c.cachex("export", CKPT, str(fresh))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "checksum" in result.stderr or "mismatch" in result.stderr, result.stderr
    assert not (tmp_path / "out").exists(), sorted((tmp_path / "out").rglob("*"))

    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "mine.txt").write_text("kept")
    result = c.cachex("export", CKPT, str(existing))
    assert result.returncode == 1, result.stdout + result.stderr
    assert [p.name for p in existing.rglob("*") if p.is_file()] == ["mine.txt"]
