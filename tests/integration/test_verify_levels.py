"""`cachex verify` judges only the copies a checkpoint's level promises (issue 31): real
agents, a real PFS too small for any bundle (a tmpfs), real replicas removed."""

from __future__ import annotations

import json
import shutil
import subprocess

import h5py
import pytest
from harness import Cluster, finish

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
TRAIN = ["--shard-size", "256KiB", "--chunk-size", "64KiB", "--step-time", "0.02"]
CKPT = "step_00004"


def replicated_on_a_full_pfs(cluster, tmpfs) -> Cluster:
    c = cluster(nodes=2)
    tmpfs(c.root / "pfs", "96k")            # room for the status, none for a bundle
    c.start_agents()
    finish(c.trainer("--steps", "4", "--every", "4", *TRAIN, ranks=4))
    c.wait_level(CKPT, "replicated")
    return c


def verify_json(c: Cluster) -> tuple[int, dict]:
    result = c.cachex("verify", CKPT, "--json", "-q")
    return result.returncode, json.loads(result.stdout)


def test_unflushed_checkpoint_on_a_full_pfs_verifies(cluster, tmpfs):
    c = replicated_on_a_full_pfs(cluster, tmpfs)
    code, report = verify_json(c)
    assert code == 0, report
    assert report["ok"] and report["level"] == "replicated"
    by_level = {}
    for copy in report["copies"]:
        by_level.setdefault(copy["level"], []).append(copy)
    assert [(x["checked"], x["ok"]) for x in by_level["stage"]] == [(True, True)] * 2
    assert [(x["checked"], x["ok"]) for x in by_level["replica"]] == [(True, True)] * 2
    assert [(x["checked"], x["note"]) for x in by_level["pfs"]] == \
        [(False, "not yet flushed")] * 2
    text = c.cachex("verify", CKPT, "-q")
    assert text.returncode == 0 and text.stdout.count("not yet flushed") == 2, text.stdout


def test_a_missing_promised_replica_still_fails(cluster, tmpfs):
    c = replicated_on_a_full_pfs(cluster, tmpfs)
    replica = c.root / "node1" / "nvme" / "t" / "replicas" / "node-00000" / CKPT
    victim = next(p for p in sorted(replica.rglob("*")) if p.is_file())
    victim.unlink()
    code, report = verify_json(c)
    assert code == 1 and not report["ok"]
    bad = [x for x in report["copies"] if x["checked"] and not x["ok"]]
    assert [(x["level"], x["node"]) for x in bad] == [("replica", 0)]
    assert bad[0]["problems"] == [f"{victim}: missing"]
    shutil.rmtree(c.stage(1) / CKPT)        # a promised stage gone: not a skipped copy
    code, report = verify_json(c)
    assert code == 1


def test_once_flushed_a_corrupted_bundle_is_bad(cluster, tmpfs):
    c = replicated_on_a_full_pfs(cluster, tmpfs)
    subprocess.run(["mount", "-o", "remount,size=64m", str(c.root / "pfs")], check=True)
    c.wait_level(CKPT, "flushed", timeout=120)      # the flush retries, now with room
    code, report = verify_json(c)
    assert code == 0 and report["level"] == "flushed", report
    assert all(x["checked"] for x in report["copies"] if x["level"] == "pfs"), report
    bundle = c.pfs / "ckpt" / CKPT / "node-00001.h5"
    with h5py.File(bundle, "r+") as h5:
        h5["files"][sorted(h5["files"])[-1]][0] ^= 0xFF
    code, report = verify_json(c)
    assert code == 1
    bad = [(x["level"], x["node"]) for x in report["copies"] if x["checked"] and not x["ok"]]
    assert bad == [("pfs", 1)], report
    assert c.stop() == 0
