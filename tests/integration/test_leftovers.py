"""Nothing left behind (issue 26): a refused `cachex recover` removes its partial
directory, and an agent's start sweeps the ones a killed recover left in the spool.
Real agents, a real flushed checkpoint, real directories."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from harness import BIN, Cluster
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
