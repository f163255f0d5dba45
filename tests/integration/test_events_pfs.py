"""The model's history outlives a node: every node's events (the coordinator's are node
0's) reach the PFS with the flush, and `cachex model fit` reads them when node 0's disk
is gone. Real agents under mpiexec, SIGKILL, real directories removed."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from harness import Cluster, finish, kill_tree, wait_for

from cachex_agent.events import read_events
from cachex_agent.layout import pfs_events_path
from cachex_agent.outputs import problems

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
TRAIN = ["--shard-size", "256KiB", "--chunk-size", "64KiB", "--step-time", "0.02"]
STEPS = ("step_00004", "step_00008", "step_00012")


def copied(c: Cluster, node: int, event: str, ckpt: str) -> bool:
    path = pfs_events_path(c.pfs, node)
    return path.exists() and any(r.get("event") == event and r.get("ckpt") == ckpt
                                 for r in read_events(path))


def counts(c: Cluster) -> tuple[str, str]:
    """(samples line, level lines) of `cachex model fit`: what the model learnt from."""
    fit = c.cachex("model", "fit")
    assert fit.returncode == 0, fit.stderr
    samples = re.search(r"\d+ stage samples, \d+ level samples", fit.stdout)
    assert samples, fit.stdout
    levels = "\n".join(line for line in fit.stdout.splitlines() if line.startswith("level"))
    return samples.group(0), levels


def model_json_outputs_carry_their_schema(c: Cluster) -> None:
    """`--json` of the model commands: their shapes in cachex_agent/outputs.py."""
    def shaped(command: str, *args: str) -> dict:
        result = c.cachex(*command.split(), "--json", *args)
        assert result.returncode == 0, result.stderr
        doc = json.loads(result.stdout)
        assert problems(command, doc) == [], doc
        return doc

    fitted = shaped("model fit")
    assert fitted["format"] == "cachex-model" and {"capture", "flush"} <= set(fitted["stages"])
    predicted = shaped("model predict")
    assert predicted["level"] == "flushed"
    assert 0 < predicted["median"] <= predicted["at_quantile"]
    plan = shaped("model plan", "--period", "10s")
    assert plan["recommended"] in {p["name"] for p in plan["paths"]}


def test_model_fit_sees_node_0_and_the_coordinator_after_node_0_is_lost(cluster):
    c = cluster(nodes=2)
    c.start_agents()
    finish(c.trainer("--steps", "12", "--every", "4", *TRAIN, ranks=4))
    for step in STEPS:
        c.wait_level(step, "flushed")
    for node in range(2):       # the replication runs beside the flush: either ends last
        for event in ("flushed", "replicated"):
            wait_for(lambda n=node, e=event: copied(c, n, e, STEPS[-1]), 60,
                     f"node {node}'s {event} event on the PFS")
    wait_for(lambda: copied(c, 0, "level_flushed", STEPS[-1]), 60,
             "the coordinator's level_flushed on the PFS")
    kill_tree(c.agents)
    before = counts(c)
    assert "level flushed       3 checkpoints" in before[1], before
    model_json_outputs_carry_their_schema(c)

    shutil.rmtree(c.root / "node0" / "nvme")        # node 0's journal, events included
    shutil.rmtree(c.root / "node0" / "shm")
    assert not c.journal(0).exists()
    assert counts(c) == before

    for node in range(2):                           # each node's stages of every step
        records = read_events(pfs_events_path(c.pfs, node))
        for step in STEPS:
            done = {r["event"] for r in records if r.get("ckpt") == step}
            assert {"captured", "replicated", "flushed"} <= done, (node, step, done)
    coordinator = {(r["event"], r.get("ckpt")) for r in read_events(pfs_events_path(c.pfs, 0))}
    assert {(f"level_{level}", step) for level in ("captured", "replicated", "flushed")
            for step in STEPS} <= coordinator
