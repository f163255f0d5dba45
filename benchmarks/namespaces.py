"""Virtual nodes that cannot see each other (root): each in mount, UTS, PID and network
namespaces of its own, as on a real cluster. Used by the namespace test tier
(tests/netns/nsharness.py) and benchmarks/replicate_tcp.py; only the standard library
and psutil (the benchmarks import it from their own directory, the tests through
tests/conftest.py).

A node has its own hostname, its own /proc, a private tmpfs at the same path on every
node (`local`: spool and NVMe) and a private /dev/shm (stage, MPICH's shared memory).
Its network is one veth (`eth0`, 10.231.0.<10+k>) into a bridge that lives in a network
namespace of its own (10.231.0.1): nothing leaves the machine. The directories of the
host's root file system stay visible (the venv, the code, as a cluster's shared
software): a directory outside `local` and /dev/shm is what nodes share (the PFS).
mpiexec runs in the bridge's namespace (a login node) and starts its proxies with
Hydra's ssh launcher through a script that enters the node named by the host address.

UCX (the mpich wheel's default netmod) would reach a peer in the same PID namespace
through CMA (process_vm_writev), a path no real pair of nodes has, and the node's own
PID namespace plus `UCX_TLS=tcp,self` rule it out: MPI goes over TCP through eth0.

Losing a node kills its PID namespace's init: the kernel SIGKILLs every process in it,
its mount namespace (and the tmpfs in it) goes with the last one, then its network
namespace and veth are deleted. A replacement is a new node with a new hostname.

    nodes = Nodes(workdir, local)           # local: a directory, private on each node
    a, b = nodes.add(), nodes.add()         # cx-node0, cx-node1
    proc = subprocess.Popen(nodes.mpiexec(["python", "x.py"]), env=nodes.env())
    nodes.close()
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from itertools import count
from pathlib import Path
from typing import TypeVar

import psutil

SUBNET = "10.231.0"
BRIDGE = "br0"
NETWORK_ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0"}
LOCAL_SIZE, SHM_SIZE = "256m", "256m"
MPIEXEC = Path(sys.executable).parent / "mpiexec"
_serial = count()
T = TypeVar("T")

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
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {result.stderr.strip()}")
    return result.stdout


def wait_until(probe: Callable[[], T | None], timeout: float, what: str,
               poll: float = 0.05) -> T:
    """The first true value of `probe`; RuntimeError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(poll)
    raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")


def remove_stale_namespaces() -> None:
    """Network namespaces of processes that are gone (a run killed midway)."""
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
                 hostname: str | None = None, sizes: tuple[str, str] = (LOCAL_SIZE, SHM_SIZE)
                 ) -> None:
        self.network, self.index, self.sizes = network, index, sizes
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
        self.pid = wait_until(self._init_pid, 30, f"the init of {self.hostname}", poll=0.01)
        self.namespaces = {kind: os.stat(f"/proc/{self.pid}/ns/{kind}").st_ino
                           for kind in ("mnt", "uts", "net", "pid")}
        run("nsenter", "-t", str(self.pid), "-m", "-u", "-n", "--", "sh", "-ec",
            f"hostname {self.hostname}\n"
            f"mount -t tmpfs -o size={self.sizes[0]},mode=0755 tmpfs {local}\n"
            f"mount -t tmpfs -o size={self.sizes[1]},mode=1777 tmpfs /dev/shm\n"
            "mount -t sysfs sysfs /sys\n")
        (hosts / self.address).write_text(str(self.pid))

    def _init_pid(self) -> int | None:
        assert self._unshare is not None
        try:
            children = psutil.Process(self._unshare.pid).children()
        except psutil.NoSuchProcess:
            raise RuntimeError(f"unshare for {self.hostname} exited") from None
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
        """`path` as this node sees it (through its init's root: for checks from outside
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
                os.killpg(self._unshare.pid, signal.SIGKILL)    # its own session
            self._unshare.wait(timeout=30)
        if self.pid:
            wait_until(lambda: not self._members(), 30,
                       f"the processes of {self.hostname} to end")
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


class Nodes:
    """A network and the nodes on it; `live` in the order of their hostnames (the node
    index of `topology.domain = "node"`). `local` is the directory each node mounts its
    private tmpfs on (`sizes`: of it and of /dev/shm); `workdir` holds the launcher's
    host table."""

    def __init__(self, workdir: Path, local: Path,
                 sizes: tuple[str, str] = (LOCAL_SIZE, SHM_SIZE)) -> None:
        self.local, self.hosts, self.sizes = local, workdir / "hosts", sizes
        for directory in (local, self.hosts):
            directory.mkdir(parents=True, exist_ok=True)
        self.launcher = workdir / "launch.sh"
        self.launcher.write_text(_LAUNCHER.format(hosts=self.hosts))
        self.launcher.chmod(0o755)
        self.network = Network()
        self.all: list[Node] = []
        self.live: list[Node] = []

    def add(self, hostname: str | None = None) -> Node:
        node = Node(self.network, len(self.all), self.local, self.hosts, hostname, self.sizes)
        self.all.append(node)
        self.live.append(node)
        self.live.sort(key=lambda n: n.hostname)
        return node

    def lose(self, node: Node) -> None:
        node.destroy()
        self.live.remove(node)

    def mpiexec(self, command: list[str], per_node: int = 1) -> list[str]:
        """`command` on every live node, `per_node` ranks each, MPI over the veths; run
        it with `env()`."""
        hosts = ",".join(f"{n.address}:{per_node}" for n in self.live)
        return ["nsenter", f"--net=/run/netns/{self.network.netns}", str(MPIEXEC),
                "-iface", BRIDGE, "-launcher", "ssh", "-launcher-exec", str(self.launcher),
                "-hosts", hosts, "-n", str(per_node * len(self.live)), *command]

    @staticmethod
    def env(extra: dict[str, str] | None = None) -> dict[str, str]:
        return {**os.environ, **NETWORK_ENV, **(extra or {})}

    def close(self) -> None:
        """Every node destroyed, whatever happens to another; then the network."""
        failed: list[Exception] = []
        for node in self.all:
            try:
                node.destroy()
            except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
                failed.append(exc)
        self.network.close()
        if failed:
            raise failed[0]
