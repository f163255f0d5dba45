"""The DCP drill (tests/integration/test_dcp.py) with each node in namespaces of its own:
DCP's gloo and the agents' MPI over the veths, node 0's namespace destroyed, recovery on
a spare with another hostname."""

from __future__ import annotations

import sys

import pytest
from harness import finish
from test_dcp import DCP_COMMIT, TRAINER, run_dcp_drill

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]


def test_dcp_drill_across_namespaces(ns_cluster, tmp_path):
    c = ns_cluster(nodes=2, commit=DCP_COMMIT)
    c.start_agents()

    def train(rendezvous: str, *args: str) -> str:
        # gloo's file store on the shared directory; its TCP on eth0 (the hostnames do
        # not resolve)
        return finish(c.mpiexec(sys.executable, str(TRAINER), "--spool",
                                str(c.local / "spool"), "--rendezvous",
                                str(c.root / rendezvous), *args, per_node=2,
                                env={"GLOO_SOCKET_IFNAME": "eth0"}), timeout=240)

    def lose_node_0() -> None:
        c.lose(c.live[0])
        spare = c.add_node("cx-node0-spare")       # sorts where cx-node0 was: node 0
        assert spare.run("mkdir", "-p", str(c.local / "spool")).returncode == 0

    def recover() -> str:
        return finish(c.mpiexec(str(c.bin / "cachex"), "recover", "--config", str(c.config)),
                      timeout=180)

    run_dcp_drill(c, train, lose_node_0, recover, tmp_path)
