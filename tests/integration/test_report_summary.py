"""`cachex report` on a real run with an agent loss: the summary page first, no warning,
and the rows and incidents it draws are the run's."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from harness import BIN, finish, kill_tree, wait_for
from matplotlib import image

from cachex_agent.model.history import event_files
from cachex_agent.model.summary_plot import summary_from_files

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
TRAIN = ["--shard-size", "256KiB", "--chunk-size", "64KiB", "--step-time", "0.02"]
PNG = b"\x89PNG\r\n\x1a\n"


def test_report_writes_the_summary_first_without_a_warning(cluster, tmp_path):
    c = cluster(nodes=2)
    c.start_agents()
    finish(c.trainer("--steps", "4", "--every", "2", *TRAIN, ranks=4))
    c.wait_level("step_00004", "flushed")
    # flushed can hold before every replica is verified: wait for those too
    wait_for(lambda: all(any(e["event"] == "replicated" and e.get("ckpt") == "step_00004"
                             for e in c.events(node)) for node in range(2)), 60,
             "step_00004 replicated on both nodes")
    kill_tree(c.agents)                 # SIGKILL: the agents end without agent_exit
    c.start_agents()
    assert c.stop() == 0

    out = tmp_path / "report"
    result = subprocess.run([sys.executable, "-W", "error", str(BIN / "cachex"), "report",
                             str(c.root), "--out", str(out)],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    written = result.stdout.split()
    assert written[0] == str(out / "summary.png")
    assert [p.rsplit("/", 1)[1] for p in written[1:4]] == [
        "timeline.png", "distributions.png", "durability.png"]
    data = (out / "summary.png").read_bytes()
    assert data.startswith(PNG) and len(data) > 20_000
    pixels = image.imread(out / "summary.png")
    assert pixels.shape[0] > 400 and pixels.shape[1] > 800
    assert float(np.var(pixels[..., :3])) > 1e-3

    summary = summary_from_files(event_files([c.root]))
    assert [k.ckpt for k in summary.checkpoints] == ["step_00002", "step_00004"]
    assert summary.levels == ("captured", "replicated", "flushed")
    assert summary.paths == ("peer",)
    for k in summary.checkpoints:
        assert [r.node for r in k.rows] == [0, 1]
        assert all(set(r.reached) == set(summary.levels) and not r.missing for r in k.rows)
        assert all(0 <= t < 60 for r in k.rows for t in r.reached.values())
    kinds = {(i.kind, i.nodes) for i in summary.incidents}
    assert ("lost", (0, 1)) in kinds and ("restart", (0, 1)) in kinds
