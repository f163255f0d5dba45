"""What the benchmarks share: the agents' configuration file, the virtual nodes' directories
and checkpoints, real agents under mpiexec, CPU burners, the machine's state beside the
figures. Written once here, so that a benchmark says only what it measures.

A benchmark runs as `python benchmarks/<name>.py` (or under mpiexec): its own directory is
then first on sys.path, so `import common`, `import sources` or one benchmark importing
another needs no path set-up, and `cachex_agent` is the venv's editable install (this
checkout's code). The tests that import benchmark modules find benchmarks/ through
tests/conftest.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sources import MiB, write_files

from cachex_agent.config import Config, load
from cachex_agent.events import read_events
from cachex_agent.layout import events_path

#: the venv's commands (mpiexec of the mpich wheel, cachex-agent, cachex) beside this
#: interpreter, whatever PATH says: the agents run the code being measured
BIN = Path(sys.executable).parent
GiB = 1024 * MiB
Match = Callable[[dict[str, Any]], bool]


def machine() -> dict[str, Any]:
    """Date, cores and 1-minute load average, the head of a result: a figure from a shared
    2-core machine says little without the load it was taken under."""
    return {"date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(),
            "load": os.getloadavg()[0]}


# --------------------------------------------------------------------- configuration
def write_config(path: Path, run: str, **sections: Mapping[str, Any]) -> Path:
    """An agent configuration at `path`: `run`, then each section's keys in the order
    given (`paths={"spool": ...}, agent={"timeout": "60s"}`). Strings are written as TOML
    basic strings (a path with a quote or a backslash still reads back), numbers and
    booleans bare. `{node}` in a path is the agents' own template field."""
    lines = [f"run = {_toml(run)}"]
    for name, keys in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{key} = {_toml(value)}" for key, value in keys.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))           # a JSON string is a TOML basic string


def node_tree(root: Path, pfs: Path | str) -> dict[str, str]:
    """[paths] of virtual nodes on one host, each with its node-local directories under
    root/node<n>/: spool, stage (`shm`) and cache (`nvme`: journal, replicas); `pfs` is
    shared."""
    node = f"{root}/node{{node}}"
    return {"spool": f"{node}/spool", "stage": f"{node}/shm", "cache": f"{node}/nvme",
            "pfs": str(pfs)}


def make_spools(config: Path, nodes: int) -> Config:
    """Every node's spool as the configuration names it (the trainer's directory: an agent
    expects to find it); the configuration, loaded as the agents will load it."""
    cfg = load(config)
    for node in range(nodes):
        cfg.node_paths(node).spool.mkdir(parents=True, exist_ok=True)
    return cfg


# ------------------------------------------------------------------------ checkpoints
def write_parts(root: Path, nodes: int, ckpt: str, total: int, files: int, seed: int,
                where: str = "spool") -> None:
    """One checkpoint in DCP's shape on every node: root/node<n>/<where>/<ckpt> gets `files`
    files of `total` bytes in all (random, seeded by `seed` and the node), and node 0's
    part a `.metadata.tmp` that commit() renames into the marker the dcp rule waits for."""
    for node in range(nodes):
        part = root / f"node{node}" / where / ckpt
        write_files(part, total, files, seed=seed * nodes + node)
        if node == 0:
            (part / ".metadata.tmp").write_bytes(b"{}")


def commit(part: Path) -> float:
    """Commit node 0's `part` as DCP does (`.metadata.tmp` renamed to `.metadata`); the
    time of the rename on the events' clock (time.time)."""
    start = time.time()
    os.rename(part / ".metadata.tmp", part / ".metadata")
    return start


def remove_parts(root: Path, nodes: int, ckpt: str, where: str = "spool") -> None:
    """Every node's copy of `ckpt` under `where`, gone (the trainer's side of retention)."""
    for node in range(nodes):
        shutil.rmtree(root / f"node{node}" / where / ckpt, ignore_errors=True)


# ----------------------------------------------------------------------- real agents
class AgentJob:
    """`mpiexec -n nodes cachex-agent` in a session of its own, its log, each node's
    events, a bounded wait for an event, a drain at the end. `events_of(node)` is where
    node's events.jsonl is; by default where the configuration puts the journal."""

    def __init__(self, config: Path, nodes: int, log: Path,
                 events_of: Callable[[int], Path] | None = None,
                 env: dict[str, str] | None = None, poll: float = 0.005,
                 stop_timeout: float = 60) -> None:
        import private_state  # noqa: F401 (the agents record their runs apart from the user's)
        self.config, self.nodes = config, nodes
        environ = {**os.environ, **(env or {})}
        if events_of is None:
            cfg = load(config, environ=environ)
            files = [events_path(cfg.node_paths(node).journal) for node in range(nodes)]
            events_of = files.__getitem__
        self.events_of, self.poll, self.stop_timeout = events_of, poll, stop_timeout
        self.log = log.open("wb")
        self.proc = subprocess.Popen(
            [str(BIN / "mpiexec"), "-n", str(nodes), str(BIN / "cachex-agent"), "--config",
             str(config)], stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            env=environ)

    def started(self, timeout: float) -> list[dict[str, Any]]:
        """Every node's `agent_start` event (their pids)."""
        return [self.wait_event(node, lambda e: e["event"] == "agent_start", timeout)
                for node in range(self.nodes)]

    def events(self, node: int = 0) -> list[dict[str, Any]]:
        try:
            return read_events(self.events_of(node))
        except FileNotFoundError:
            return []

    def wait_event(self, node: int, match: Match, timeout: float) -> dict[str, Any]:
        """The newest event of `node` that matches; SystemExit if the agents exit or
        `timeout` passes first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [e for e in self.events(node) if match(e)]
            if found:
                return found[-1]
            if self.proc.poll() is not None:
                tail = Path(self.log.name).read_text()[-2000:]
                raise SystemExit(f"agents exited with {self.proc.returncode}:\n{tail}")
            time.sleep(self.poll)
        raise SystemExit(f"timed out after {timeout:.0f}s waiting for an event of node {node}")

    def close(self) -> None:
        """Drain (`cachex stop`), then wait; SIGKILL to the session if that hangs."""
        if self.proc.poll() is None:
            subprocess.run([str(BIN / "cachex"), "stop", "--timeout",
                            f"{self.stop_timeout:g}", "--config", str(self.config)],
                           capture_output=True, timeout=2 * self.stop_timeout)
        try:
            self.proc.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.log.close()


# --------------------------------------------------------------------------- burners
def burn(count: int) -> list[subprocess.Popen]:
    """`count` processes spinning on a core each: a node whose cores are training."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                             stdin=subprocess.DEVNULL, start_new_session=True)
            for _ in range(count)]


def stop_burning(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()
