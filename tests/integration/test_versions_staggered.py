"""Nodes that save one name at different times (issue 44, items 1 to 3): real agents on
two virtual nodes, each node's trainer saving its own `ckpt.pt` (rule `torch`), one
node after the other within each round and the order changing from round to round.
A version is one save of every node that saves it: as many versions as rounds, each
node's part of version n its save of round n (bytes checked in `cachex export`). A
save that never became part of a version is reported superseded; a save made while no
agent ran is a new version at the next start."""

from __future__ import annotations

import json
import os

import pytest
from harness import files_of, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
NAME = "ckpt.pt"
ORDERS = [(0, 1), (1, 0), (0, 1), (1, 0)]     # who saves first in each round


def version(n: int) -> str:
    return NAME if n == 1 else f"{NAME}@v{n}"


def save(c, node: int, data: bytes) -> None:
    (c.spool(node) / NAME).write_bytes(data)


def round_of(n: int) -> dict[int, bytes]:
    return {node: os.urandom(64 << 10) + bytes([node, n]) for node in range(2)}


def parts(c, tmp_path, ckpt: str) -> dict[int, bytes | None]:
    """Each node's part of `ckpt` as exported from the PFS (None: an empty part)."""
    dest = tmp_path / "export" / ckpt
    result = c.cachex("export", ckpt, str(dest), "--per-node")
    assert result.returncode == 0, result.stdout + result.stderr
    found = {}
    for node in range(2):
        files = files_of(dest / f"node-{node:05d}") if (dest / f"node-{node:05d}").is_dir() \
            else {}
        assert set(files) <= {f".cachex-root/{NAME}"}, files
        found[node] = files.get(f".cachex-root/{NAME}")
    return found


def superseded(c) -> list[dict]:
    return [e for e in c.events(0) if e["event"] == "superseded"]


def test_staggered_saves_make_one_version_per_round(cluster, tmp_path):
    c = cluster(nodes=2, rule="torch", commit='settle = "0.5s"\ntimeout = "60s"')
    c.start_agents()
    rounds = []
    for n, (first, second) in enumerate(ORDERS, 1):
        rounds.append(round_of(n))
        save(c, first, rounds[-1][first])
        if n == 1:      # the first version is cut before the other node's first save
            c.wait_level(version(1), "flushed", timeout=120)
        else:           # committed by the first node's save; the other saves after it
            wait_for(lambda n=n: version(n) in c.levels(), 60, f"{version(n)} committed")
        save(c, second, rounds[-1][second])
        c.wait_level(version(n), "flushed", timeout=120)
        if n == 1:      # counted (settled) before its next save: reported superseded
            wait_for(lambda: superseded(c), 60, "node 1's first save reported")
    assert c.stop() == 0

    rows = c.status()["checkpoints"]
    assert [(r["id"], r["level"]) for r in rows] == [
        (version(n), "flushed") for n in range(1, len(ORDERS) + 1)]
    for n in range(1, len(ORDERS) + 1):
        verify = c.cachex("verify", version(n))
        assert verify.returncode == 0, verify.stdout + verify.stderr
        expected = dict(rounds[n - 1])
        if n == 1:
            expected[1] = None      # node 1 had not saved when version 1 was captured
        assert parts(c, tmp_path, version(n)) == expected, version(n)
    # node 1's first save came after version 1 was captured: reported, not lost silently
    assert [r.get("superseded") for r in rows] == [1, None, None, None]
    assert [(e["ckpt"], e["by"], e["node_reporting"]) for e in superseded(c)] == [
        (NAME, None, 1)]
    shown = c.cachex("status", "--json")
    assert json.loads(shown.stdout)["superseded"] == {NAME: 1}, shown.stdout
    text = c.cachex("status").stdout
    assert f"superseded: {NAME}: 1 save(s)" in text, text


def test_a_save_made_while_no_agent_ran_is_a_new_version(cluster, tmp_path):
    """Agents stopped after version 2; both trainers save again; agents started: the
    journal recorded which save each version took, so the save found at start is
    version 3, captured and flushed; started once more with no new save, no version."""
    c = cluster(nodes=2, rule="torch", commit='settle = "0.5s"')
    c.start_agents()
    rounds = []
    for n in (1, 2):
        rounds.append(round_of(n))
        for node in range(2):
            save(c, node, rounds[-1][node])
        c.wait_level(version(n), "flushed", timeout=120)
    assert c.stop() == 0
    rounds.append(round_of(3))
    for node in range(2):
        save(c, node, rounds[-1][node])

    c.start_agents()
    c.wait_level(version(3), "flushed", timeout=120)
    assert parts(c, tmp_path, version(3)) == rounds[2]
    assert c.stop() == 0
    c.start_agents()
    assert c.stop() == 0
    assert [r["id"] for r in c.status()["checkpoints"]] == [version(n) for n in (1, 2, 3)]
