"""Virtual nodes that cannot see each other (root): each in mount, UTS, PID and network
namespaces of its own, as on a real cluster.

A node has its own hostname (cx-node<k>), its own /proc, a private tmpfs at the same path
on every node (`<root>/local`: spool and NVMe) and a private /dev/shm (stage, MPICH's
shared memory). Its network is one veth (`eth0`, 10.231.0.<10+k>) into a bridge that
lives in a network namespace of its own (10.231.0.1): nothing leaves the machine. The
directories of the host's root file system stay visible (the venv, the code, as a
cluster's shared software), and `<root>/pfs` is the only directory the nodes share data
in. mpiexec runs in the bridge's namespace (a login node) and starts its proxies with
Hydra's ssh launcher through a script that enters the node named by the host address.

UCX (the mpich wheel's default netmod) would reach a peer in the same PID namespace
through CMA (process_vm_writev), a path no real pair of nodes has, and the node's own
PID namespace plus `UCX_TLS=tcp,self` rule it out: MPI goes over TCP through eth0.

Losing a node kills its PID namespace's init: the kernel SIGKILLs every process in it,
its mount namespace (and the tmpfs in it) goes with the last one, then its network
namespace and veth are deleted. A replacement is a new node with a new hostname.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from itertools import count
from pathlib import Path
from typing import Any

import psutil
from harness import BIN, TRAINER, Cluster, kill_tree, settings, wait_for
from support import cluster_config

SUBNET = "10.231.0"
BRIDGE = "br0"
NETWORK_ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0"}
LOCAL_SIZE, SHM_SIZE = "256m", "256m"
_serial = count()

# pid 1 of a node: reaps orphans (Hydra's proxies leave some) so that none stays a zombie.
_INIT = ("import os, time\nwhile True:\n    try:\n        os.wait()\n"
         "    except ChildProcessError:\n        time.sleep(0.2)\n")

_LAUNCHER = """#!/bin/sh
# Hydra's ssh launcher calls: <this> -x HOST COMMAND. COMMAND runs inside HOST's node.
[ "$1" = "-x" ] && shift
pid=$(cat "{hosts}/$1") || exit 255
shift
exec nsenter -t "$pid" -m -u -n -p --wd=/ -- sh -c "$*"
"""


def run(*args: str, timeout: float = 30) -> str:
    """A set-up command that must succeed; its output."""
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(args)}: {result.stderr.strip()}"
    return result.stdout


def remove_stale_namespaces() -> None:
    """Network namespaces of test processes that are gone (a run killed mid-test)."""
    for path in Path("/run/netns").glob("cxns-*"):
        owner = path.name.split("-")[1]
        if owner.isdigit() and not psutil.pid_exists(int(owner)):
            pids = subprocess.run(["ip", "netns", "pids", path.name], capture_output=True,
                                  text=True, timeout=30).stdout.split()
            for pid in pids:            # a node's init and whatever still runs in it
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", path.name], capture_output=True, timeout=30)


class Network:
    """A bridge in a network namespace of its own; nodes plug a veth into it."""

    def __init__(self) -> None:
        remove_stale_namespaces()
        self.prefix = f"cxns-{os.getpid()}-{next(_serial)}"
        self.netns = f"{self.prefix}-br"
        run("ip", "netns", "add", self.netns)
        for command in (("link", "add", BRIDGE, "type", "bridge"),
                        ("addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE),
                        ("link", "set", BRIDGE, "up"), ("link", "set", "lo", "up")):
            run("ip", "-n", self.netns, *command)

    def plug(self, netns: str, index: int) -> str:
        """A veth from `netns` (eth0) into the bridge; the node's address."""
        address, outside = f"{SUBNET}.{10 + index}", f"cxv{index}"
        run("ip", "-n", netns, "link", "add", "eth0", "type", "veth", "peer", "name",
            outside, "netns", self.netns)
        run("ip", "-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
        for link in ("eth0", "lo"):
            run("ip", "-n", netns, "link", "set", link, "up")
        run("ip", "-n", self.netns, "link", "set", outside, "master", BRIDGE)
        run("ip", "-n", self.netns, "link", "set", outside, "up")
        return address

    def unplug(self, index: int) -> None:
        subprocess.run(["ip", "-n", self.netns, "link", "del", f"cxv{index}"],
                       capture_output=True, timeout=30)

    def close(self) -> None:
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, timeout=30)


class Node:
    """One virtual node: its namespaces, hostname, private tmpfs mounts and veth."""

    def __init__(self, network: Network, index: int, local: Path, hosts: Path,
                 hostname: str | None = None) -> None:
        self.network, self.index = network, index
        self.hostname = hostname or f"cx-node{index}"
        self.netns = f"{network.prefix}-n{index}"
        self._unshare: subprocess.Popen[bytes] | None = None
        self.pid = 0
        try:
            self._start(local, hosts)
        except BaseException:
            self.destroy()
            raise

    def _start(self, local: Path, hosts: Path) -> None:
        run("ip", "netns", "add", self.netns)
        self.address = self.network.plug(self.netns, self.index)
        self._unshare = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{self.netns}", "unshare", "--mount", "--uts",
             "--pid", "--fork", "--mount-proc", "--propagation", "private",
             sys.executable, "-c", _INIT], start_new_session=True)
        self.pid = wait_for(self._init_pid, 30, f"the init of {self.hostname}", poll=0.01)
        self.namespaces = {kind: os.stat(f"/proc/{self.pid}/ns/{kind}").st_ino
                           for kind in ("mnt", "uts", "net", "pid")}
        run("nsenter", "-t", str(self.pid), "-m", "-u", "-n", "--", "sh", "-ec",
            f"hostname {self.hostname}\n"
            f"mount -t tmpfs -o size={LOCAL_SIZE},mode=0755 tmpfs {local}\n"
            f"mount -t tmpfs -o size={SHM_SIZE},mode=1777 tmpfs /dev/shm\n"
            "mount -t sysfs sysfs /sys\n")
        (hosts / self.address).write_text(str(self.pid))

    def _init_pid(self) -> int | None:
        assert self._unshare is not None
        try:
            children = psutil.Process(self._unshare.pid).children()
        except psutil.NoSuchProcess:
            raise AssertionError(f"unshare for {self.hostname} exited") from None
        return children[0].pid if children else None

    @property
    def alive(self) -> bool:
        return self._unshare is not None and self._unshare.poll() is None

    def command(self, *args: str) -> list[str]:
        """`args` run inside this node."""
        return ["nsenter", "-t", str(self.pid), "-m", "-u", "-n", "-p", "--wd=/", "--", *args]

    def run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.command(*args), capture_output=True, text=True,
                              timeout=timeout)

    def path(self, path: str | Path) -> Path:
        """`path` as this node sees it (through its init's root: for the tests' checks
        only; nothing of cachex reads a node's files from outside)."""
        return Path(f"/proc/{self.pid}/root") / Path(path).relative_to("/")

    def sent(self) -> int:
        """Bytes sent on eth0 so far."""
        return int(self.run("cat", "/sys/class/net/eth0/statistics/tx_bytes").stdout)

    def destroy(self) -> None:
        """The node is gone: every process SIGKILLed (with its PID namespace's init), its
        mounts with its mount namespace, its veth and network namespace deleted."""
        if self.alive:
            assert self._unshare is not None
            if self.pid:
                os.kill(self.pid, signal.SIGKILL)
            else:
                kill_tree(self._unshare)
            self._unshare.wait(timeout=30)
        if self.pid:
            wait_for(lambda: not self._members(), 30, f"the processes of {self.hostname} to end")
        self.network.unplug(self.index)
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, timeout=30)

    def _members(self) -> list[int]:
        """Processes still in this node's mount or PID namespace (not zombies)."""
        found = []
        for proc in psutil.process_iter():
            try:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                if any(os.stat(f"/proc/{proc.pid}/ns/{kind}").st_ino == self.namespaces[kind]
                       for kind in ("mnt", "pid")):
                    found.append(proc.pid)
            except (psutil.Error, OSError):     # gone, or not ours to look at
                continue
        return found


class NsCluster(Cluster):
    """`nodes` namespaced nodes running one run, configured as a real cluster would be:
    `topology.domain = "node"`, the same paths on every node, no `{node}` in them."""

    def __init__(self, root: Path, nodes: int = 2, rule: str = "dcp",
                 agent_timeout: str = "20s", commit: str = "", extra: str = "",
                 model: str = 'path = "peer"') -> None:
        self.root, self.bin = root, BIN
        self.local, self.hosts = root / "local", root / "hosts"
        for directory in (self.local, self.hosts, root / "pfs"):
            directory.mkdir(parents=True, exist_ok=True)
        self.launcher = root / "launch.sh"
        self.launcher.write_text(_LAUNCHER.format(hosts=self.hosts))
        self.launcher.chmod(0o755)
        self.network = Network()
        self.all_nodes: list[Node] = []
        self.live: list[Node] = []
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
        node = Node(self.network, len(self.all_nodes), self.local, self.hosts, hostname)
        self.all_nodes.append(node)
        self.live.append(node)
        self.live.sort(key=lambda n: n.hostname)    # node index = place in sorted hostnames
        return node

    def lose(self, node: Node) -> None:
        node.destroy()
        self.live.remove(node)

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
        hosts = ",".join(f"{n.address}:{per_node}" for n in self.live)
        return subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{self.network.netns}", str(self.bin / "mpiexec"),
             "-iface", BRIDGE, "-launcher", "ssh", "-launcher-exec", str(self.launcher),
             "-hosts", hosts, "-n", str(per_node * self.nodes), *command],
            stdout=stdout, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **NETWORK_ENV, **(env or {})})

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
        failed: list[AssertionError] = []
        for node in self.all_nodes:             # every one, whatever happens to another
            try:
                node.destroy()
            except AssertionError as exc:
                failed.append(exc)
        self.network.close()
        if failed:
            raise failed[0]
