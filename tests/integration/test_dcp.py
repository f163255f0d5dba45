"""The failure drill on a trainer nobody here wrote: PyTorch Distributed Checkpoint
(torch 2.13, CPU, gloo), 4 ranks in 2 virtual nodes, each node saving to its own spool,
resumed through DCP's own `load`; and the drill with no spare left: 4 nodes of one rank,
node 0 lost, the checkpoint recovered once into a shared directory (`--to`) and resumed
from there on 3 ranks and on 2, DCP resharding on load."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from harness import BIN, MPIEXEC, ROOT, files_of, kill_tree

from cachex_agent.layout import pfs_manifest_path

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]
TRAINER = ROOT / "examples" / "dcp_trainer.py"


def dcp_train(root, rendezvous, *args: str, ranks: int = 4) -> str:
    result = subprocess.run(
        [str(MPIEXEC), "-n", str(ranks), sys.executable, str(TRAINER), "--spool",
         f"{root}/node{{node}}/spool", "--rendezvous", str(rendezvous), *args],
        capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


def final_hash(out: str) -> str:
    return out.strip().splitlines()[-1].split()[-1]


def test_dcp_drill(cluster, tmp_path):
    c = cluster(nodes=2, commit=DCP_COMMIT)
    c.start_agents()

    def lose_node_0() -> None:
        shutil.rmtree(c.root / "node0")
        c.spool(0).mkdir(parents=True)

    def recover() -> str:
        result = subprocess.run([str(MPIEXEC), "-n", "2", str(BIN / "cachex"), "recover",
                                 "--config", str(c.config)], capture_output=True, text=True,
                                timeout=180)
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    run_dcp_drill(c, lambda rdv, *args: dcp_train(c.root, tmp_path / rdv, *args),
                  lose_node_0, recover, tmp_path)


DCP_COMMIT = 'globals = ["__0_0.distcp"]'


def run_dcp_drill(c, train: Callable[..., str], lose_node_0: Callable[[], None],
                  recover: Callable[[], str], tmp_path: Path) -> None:
    """The drill on running agents, whatever the nodes are: `train(rendezvous, *args)`
    runs the DCP trainer on every node, `lose_node_0` takes node 0 and its files away
    (a node with an empty spool in its place), `recover` runs `cachex recover` on every
    node and returns its output."""
    train("rdv-1", "--steps", "8", "--every", "4")
    c.wait_level("step_00008", "flushed", timeout=120)
    # DCP's load on node 1 needs node 0's .metadata and __0_0.distcp: mirrored
    for name in (".metadata", "__0_0.distcp"):
        assert (c.spool(1) / "step_00008" / name).read_bytes() == (
            c.spool(0) / "step_00008" / name).read_bytes()
    before = {n: files_of(c.spool(n) / "step_00008") for n in range(2)}
    kill_tree(c.agents)                                 # node 0 is lost ...
    lose_node_0()
    os.rename(c.pfs, c.root / "pfs-gone")               # ... and the PFS is down
    c.pfs.write_text("down")

    out = recover()
    assert "from replica on node 1" in out, out
    for node in range(2):
        assert files_of(c.spool(node) / "step_00008") == before[node]

    resumed = train("rdv-2", "--steps", "12", "--every", "4", "--resume")
    assert "resumed from step_00008 with dcp.load" in resumed
    reference = dcp_train(tmp_path / "reference", tmp_path / "rdv-3", "--steps", "12",
                          "--every", "4")
    assert final_hash(resumed) == final_hash(reference)


@pytest.mark.parametrize("onto", [3, 2])
def test_dcp_drill_onto_fewer_nodes(cluster, tmp_path, onto):
    """Node 0 lost and no spare: plain `cachex recover` on `onto` nodes refuses (a DCP
    resize goes once into a directory every rank reads); with `--to DIR` every file is
    written there once (the lost node's part from its replica on node 1, the parts of
    nodes left out of the job from the PFS), and DCP's load on `onto` ranks reshards
    from DIR."""
    c = cluster(nodes=4, commit=DCP_COMMIT)
    c.start_agents()
    one_per_node = ("--ranks-per-node", "1")
    dcp_train(c.root, tmp_path / "rdv-1", "--steps", "8", "--every", "4", *one_per_node)
    c.wait_level("step_00008", "flushed", timeout=120)
    whole = {}
    for node in range(4):
        whole.update(files_of(c.spool(node) / "step_00008"))
    assert sum(name.endswith(".distcp") for name in whole) == 4
    kill_tree(c.agents)
    shutil.rmtree(c.root / "node0")
    c.spool(0).mkdir(parents=True)

    def recover(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(MPIEXEC), "-n", str(onto), str(BIN / "cachex"), "recover",
                               "--config", str(c.config), *args], capture_output=True,
                              text=True, timeout=180)
    refused = recover()
    assert refused.returncode == 2 and "give `cachex recover --to DIR`" in refused.stderr, \
        refused.stdout + refused.stderr
    shared = tmp_path / "shared"
    result = recover("--to", str(shared))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "of node 0 from its own replica" in result.stdout, result.stdout
    assert "of node 3 from the PFS bundle" in result.stdout, result.stdout
    assert files_of(shared / "step_00008") == whole

    c.nodes = onto                  # the agents go on with the job's nodes
    c.start_agents()
    resumed = dcp_train(c.root, tmp_path / "rdv-2", "--steps", "12", "--every", "4",
                        "--resume", "--load-from", str(shared), *one_per_node, ranks=onto)
    assert f"resumed from step_00008 with dcp.load on {onto} ranks" in resumed, resumed
    c.wait_level("step_00012", "flushed", timeout=120)     # protected on the new count
    manifest = json.loads(pfs_manifest_path(c.pfs, "step_00012").read_text())
    assert len(manifest["nodes"]) == onto
    # the same world-size change without cachex: every rank saves into one directory
    ref = tmp_path / "reference"
    dcp_train(ref, tmp_path / "rdv-3", "--steps", "8", "--every", "4", "--ranks-per-node",
              "4")
    reference = dcp_train(ref, tmp_path / "rdv-4", "--steps", "12", "--every", "4",
                          "--resume", "--ranks-per-node", str(onto), ranks=onto)
    assert f"on {onto} ranks" in reference
    assert final_hash(resumed) == final_hash(reference)
