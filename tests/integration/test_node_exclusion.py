"""Node exclusion as SCR offers it (topology.exclude, topology.min_nodes): real agents
under mpiexec refuse, with one line and exit 2, before they touch the run."""

from __future__ import annotations

import socket
import subprocess

import pytest
from harness import BIN, Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def with_topology(c: Cluster, line: str) -> Cluster:
    text = c.config.read_text()
    assert text.count('domain = "rank"\n') == 1
    c.config.write_text(text.replace('domain = "rank"\n', f'domain = "rank"\n{line}\n'))
    return c


def refused(c: Cluster, *args: str) -> list[str]:
    result = subprocess.run(
        [str(BIN / "mpiexec"), "-n", str(c.nodes), str(BIN / "cachex-agent"), "--config",
         str(c.config), *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    said = [line for line in result.stderr.splitlines() if "cachex-agent" in line]
    assert len(said) == 1, result.stderr
    assert not (c.pfs / "coordinator.lock").exists()    # nothing taken on the PFS
    return said


def test_an_agent_on_an_excluded_node_refuses(tmp_path):
    host = socket.gethostname()
    # virtual nodes: every agent of the cluster runs on this host, which is excluded
    c = with_topology(Cluster(tmp_path, nodes=2), f'exclude = ["other-host", "{host}"]')
    for args in ((), ("--check",)):
        said = refused(c, *args)
        assert said == [f"cachex-agent: error: topology.exclude: node {host} must never be"
                        " used, but an agent was started there; leave it out of the job"
                        " (srun --exclude, or the template's EXCLUDE_NODES)"], said


def test_fewer_nodes_than_the_minimum_refuse(tmp_path):
    c = with_topology(Cluster(tmp_path, nodes=3), "min_nodes = 4")
    said = refused(c)
    assert said == ["cachex-agent: error: topology.min_nodes: 3 nodes, fewer than the 4"
                    " needed to go on"], said
    # the same minimum met: the agents start and run
    c.config.write_text(c.config.read_text().replace("min_nodes = 4", "min_nodes = 3"))
    c.start_agents()
    assert c.status()["state"] == "running"
    assert c.stop() == 0
