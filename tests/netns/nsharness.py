"""A cachex run on virtual nodes that cannot see each other (benchmarks/namespaces.py):
each node in namespaces of its own, its own hostname, a private tmpfs at `<root>/local`
(spool and NVMe) and /dev/shm (stage), MPI over TCP through its veth, and `<root>/pfs`
the only directory the nodes share data in.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness import BIN, TRAINER, Cluster, kill_tree, settings, wait_for
from namespaces import Node, Nodes
from support import cluster_config


class NsCluster(Cluster):
    """`nodes` namespaced nodes running one run, configured as a real cluster would be:
    `topology.domain = "node"`, the same paths on every node, no `{node}` in them."""

    def __init__(self, root: Path, nodes: int = 2, rule: str = "dcp",
                 agent_timeout: str = "20s", commit: str = "", extra: str = "",
                 model: str = 'path = "peer"') -> None:
        self.root, self.bin = root, BIN
        self.local = root / "local"
        (root / "pfs").mkdir(parents=True, exist_ok=True)
        self.virtual = Nodes(root, self.local)
        self.live: list[Node] = self.virtual.live       # node index = place in it
        self.agents: subprocess.Popen[bytes] | None = None
        self.trainers: list[subprocess.Popen[bytes]] = []
        try:
            for _ in range(nodes):
                self.add_node()
        except BaseException:
            self.close()
            raise
        self.config = root / "cachex.toml"
        self.config.write_text(cluster_config(
            "t", f"{self.local}/spool", "/dev/shm/cachex", f"{self.local}/nvme",
            f"{root}/pfs", "node", settings(rule, agent_timeout, commit, extra), model))

    @property
    def nodes(self) -> int:  # type: ignore[override]
        return len(self.live)

    def add_node(self, hostname: str | None = None) -> Node:
        return self.virtual.add(hostname)

    def lose(self, node: Node) -> None:
        self.virtual.lose(node)

    # ------------------------------------------------------------------ paths
    # Paths as node k sees them, through its /proc root: for the tests' checks only.
    def spool(self, node: int) -> Path:
        return self.live[node].path(self.local / "spool")

    def stage(self, node: int) -> Path:
        return self.live[node].path("/dev/shm/cachex/t")

    def journal(self, node: int) -> Path:
        return self.live[node].path(self.local / "nvme" / "t" / "journal")

    def replicas(self, node: int) -> Path:
        return self.live[node].path(self.local / "nvme" / "t" / "replicas")

    # -------------------------------------------------------------- processes
    def mpiexec(self, *command: str, per_node: int = 1, stdout: Any = subprocess.PIPE,
                env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """`command` on every live node, `per_node` ranks each, MPI over the veths."""
        return subprocess.Popen(self.virtual.mpiexec(list(command), per_node), stdout=stdout,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env=self.virtual.env(env))

    def start_agents(self, *args: str, prefix: tuple[str, ...] = (),
                     env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        assert not prefix, "no launch prefix in namespace mode"
        log = (self.root / "agents.log").open("ab")
        since = time.time()
        self.agents = self.mpiexec(str(self.bin / "cachex-agent"), "--config",
                                   str(self.config), *args, stdout=log, env=env)
        wait_for(lambda: self._started(since), 60, "agents to start")
        return self.agents

    def trainer(self, *args: str, ranks: int = 4, ranks_per_node: int = 2
                ) -> subprocess.Popen[bytes]:
        assert ranks == ranks_per_node * self.nodes, "the trainer fills every node"
        proc = self.mpiexec(sys.executable, str(TRAINER), "--spool", str(self.local / "spool"),
                            "--ranks-per-node", str(ranks_per_node), "--state-out",
                            str(self.root / "state.json"), *args,
                            per_node=ranks_per_node)
        self.trainers.append(proc)
        return proc

    def cachex(self, *args: str, timeout: float = 60, node: int = 0
               ) -> subprocess.CompletedProcess[str]:
        """`cachex` run inside live node `node` (a user on a compute node)."""
        return self.live[node].run(str(self.bin / "cachex"), *args, "--config",
                                   str(self.config), timeout=timeout)

    def close(self) -> None:
        for proc in [*self.trainers, self.agents]:
            if proc is not None and proc.poll() is None:
                kill_tree(proc)
        self.virtual.close()
