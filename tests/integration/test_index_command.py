"""`cachex index` on a real run's PFS directory: list, pin the checkpoint that `recover`
and `export` pick, drop one with its PFS files; refused while agents run."""

from __future__ import annotations

import json
import subprocess

import pytest
from harness import BIN, files_of, finish

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
TRAIN = ["--shard-size", "256KiB", "--chunk-size", "64KiB", "--step-time", "0.02",
         "--every", "4"]


def test_list_pin_drop_and_what_recover_and_export_then_pick(cluster, tmp_path):
    c = cluster(nodes=2)
    c.start_agents()
    finish(c.trainer("--steps", "12", *TRAIN, ranks=4))
    c.wait_level("step_00012", "flushed")
    busy = c.cachex("index", "--current", "step_00008")
    assert busy.returncode == 1 and "agents are running" in busy.stderr, busy.stderr
    assert c.stop() == 0
    index = json.loads((c.pfs / "index.json").read_text())
    assert index["current"] == "step_00012" and "pinned" not in index

    listed = c.cachex("index")
    assert listed.returncode == 0, listed.stderr
    rows = [line.split()[:2] for line in listed.stdout.splitlines()[1:-1]]
    assert rows == [["step_00004", "1"], ["step_00008", "2"], ["*", "step_00012"]], listed.stdout
    assert "current: step_00012 (the newest valid)" in listed.stdout

    pinned = c.cachex("index", "--current", "step_00008")
    assert pinned.returncode == 0, pinned.stderr
    assert "current: step_00008 (pinned by cachex index --current)" in pinned.stdout
    index = json.loads((c.pfs / "index.json").read_text())
    assert index["current"] == "step_00008" and index["pinned"] is True

    exported = c.cachex("export", str(tmp_path / "out"))        # no CKPT: the pinned one
    assert exported.returncode == 0, exported.stderr
    assert exported.stdout.startswith("step_00008: exported")
    recovered = subprocess.run([str(BIN / "mpiexec"), "-n", "2", str(BIN / "cachex"),
                                "recover", "--config", str(c.config)],
                               capture_output=True, text=True, timeout=180)
    assert recovered.returncode == 0, recovered.stdout + recovered.stderr
    assert "recovered step_00008" in recovered.stdout, recovered.stdout
    assert "step_00008: pinned as current" in recovered.stderr, recovered.stderr
    assert (c.spool(0) / ".cachex-unrecoverable-step_00012").is_dir()   # the resume takes 8
    assert files_of(c.spool(0) / "step_00008")

    dropped = c.cachex("index", "--drop", "step_00004", "--json")
    assert dropped.returncode == 0, dropped.stderr
    data = json.loads(dropped.stdout)
    assert data["schema"] == 1 and data["action"] == "drop" and data["name"] == "step_00004"
    assert [r["id"] for r in data["checkpoints"]] == ["step_00008", "step_00012"]
    assert data["current"] == "step_00008" and data["pinned"] is True     # the pin stays
    assert not (c.pfs / "ckpt" / "step_00004").exists()
    assert (c.pfs / "ckpt" / "step_00008" / "manifest.json").is_file()

    for args, code, said in [
            (("--current", "step_00004"), 2, "step_00004: unknown checkpoint in the index of"
             " run t (known: step_00008, step_00012)"),
            (("--drop", "step_00099"), 2, "step_00099: unknown checkpoint"),
            (("--drop", "../t"), 2, "--drop"),
            (("--current", "step_00008", "--drop", "step_00012"), 2, "give one of them")]:
        bad = c.cachex("index", *args)
        assert bad.returncode == code and said in bad.stderr, (args, bad.stderr)
        assert len(bad.stderr.splitlines()) == 1 and "Traceback" not in bad.stderr
    assert (c.pfs / "ckpt" / "step_00012").is_dir()
