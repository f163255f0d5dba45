"""Real processes for the integration tests: agents under mpiexec, the example trainer,
the `cachex` command. Every wait is bounded; every process is killed at the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from support import virtual_nodes_config

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
MPIEXEC = BIN / "mpiexec"
TRAINER = ROOT / "examples" / "trainer.py"
SKEW = ROOT / "tests" / "skew"      # its sitecustomize.py skews a process's wall clock
assert MPIEXEC.exists(), f"no mpiexec next to {sys.executable}: run `make venv`"


def kill_tree(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL mpiexec's process group and every rank.

    Hydra starts each proxy and rank in a session of its own, so the group alone would
    leave ranks running (and possibly committing) for a moment after mpiexec dies.
    """
    try:
        ranks = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        ranks = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for child in ranks:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=10)
    # Orphaned ranks stay zombies until init reaps them; a zombie writes nothing more.
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in ranks):
        assert time.monotonic() < deadline, f"ranks survived SIGKILL: {ranks}"
        time.sleep(0.005)


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, poll: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def skewed(clock_file: Path, offset: float) -> dict[str, str]:
    """The environment of a process whose wall clock reads `offset` seconds off (as a
    host's clock that NTP has not corrected); `step_clock` moves it while it runs."""
    step_clock(clock_file, offset)
    path = [str(SKEW), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"CACHEX_TEST_CLOCK_FILE": str(clock_file), "PYTHONPATH": os.pathsep.join(path)}


def step_clock(clock_file: Path, offset: float) -> None:
    """Whole or not at all: the skewed processes read the file every 0.2 s."""
    temp = clock_file.with_name(clock_file.name + ".tmp")
    temp.write_text(repr(float(offset)))
    temp.replace(clock_file)


def settings(rule: str, agent_timeout: str, commit: str = "", extra: str = "") -> str:
    """The [commit] and [agent] sections of a test cluster's configuration."""
    return f'''[commit]
rule = "{rule}"
{commit}
[agent]
timeout = "{agent_timeout}"
{extra}'''


class Cluster:
    """N virtual nodes on this machine: spools, stage, cache and a PFS under `root`."""

    def __init__(self, root: Path, nodes: int = 4, extra: str = "", rule: str = "dcp",
                 agent_timeout: str = "20s", commit: str = "", model: str = 'path = "peer"',
                 bin: Path = BIN, spool: str = "spool") -> None:
        """`bin`: where `mpiexec`, `cachex-agent` and `cachex` come from (another venv);
        `spool`: the spool's path under each node's directory."""
        self.root, self.nodes, self.bin, self._spool = root, nodes, bin, spool
        for node in range(nodes):
            self.spool(node).mkdir(parents=True, exist_ok=True)
        (root / "pfs").mkdir(exist_ok=True)
        self.config = root / "cachex.toml"
        self.config.write_text(virtual_nodes_config(
            root, "t", settings(rule, agent_timeout, commit, extra), model=model, spool=spool))
        self.agents: subprocess.Popen[bytes] | None = None
        self.trainers: list[subprocess.Popen[bytes]] = []

    # ------------------------------------------------------------------ paths
    def spool(self, node: int) -> Path:
        return self.root / f"node{node}" / self._spool

    def stage(self, node: int) -> Path:
        return self.root / f"node{node}" / "shm" / "t"

    def journal(self, node: int) -> Path:
        return self.root / f"node{node}" / "nvme" / "t" / "journal"

    @property
    def pfs(self) -> Path:
        return self.root / "pfs" / "t"

    # -------------------------------------------------------------- processes
    def start_agents(self, *args: str, prefix: tuple[str, ...] = (),
                     env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """`prefix` wraps the launch (e.g. joining a cgroup first); `env` adds variables."""
        log = (self.root / "agents.log").open("ab")
        before = self.status()
        self.agents = subprocess.Popen(
            [*prefix, str(self.bin / "mpiexec"), "-n", str(self.nodes),
             str(self.bin / "cachex-agent"), "--config",
             str(self.config), *args], stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, env={**os.environ, **(env or {})})
        wait_for(lambda: self._started(before), 60, "agents to start")
        return self.agents

    def _started(self, before: dict[str, Any]) -> bool:
        """Running, said by these agents: a status rewritten since the launch (one that
        killed agents left does not change). No clock compared: theirs may be skewed."""
        assert self.agents is not None
        if self.agents.poll() is not None:
            log = (self.root / "agents.log").read_text()[-3000:]
            raise AssertionError(f"agents exited with {self.agents.returncode}:\n{log}")
        status = self.status()
        return status.get("state") == "running" and status != before

    def trainer(self, *args: str, ranks: int = 8, ranks_per_node: int = 2
                ) -> subprocess.Popen[bytes]:
        command = [str(MPIEXEC), "-n", str(ranks), sys.executable, str(TRAINER), "--spool",
                   f"{self.root}/node{{node}}/spool", "--ranks-per-node", str(ranks_per_node),
                   "--state-out", str(self.root / "state.json"), *args]
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.trainers.append(proc)
        return proc

    def cachex(self, *args: str, timeout: float = 60, env: dict[str, str] | None = None
               ) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.bin / "cachex"), *args, "--config", str(self.config)],
                              capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})

    def stop(self, timeout: float = 60) -> int:
        assert self.agents is not None
        result = self.cachex("stop", "--timeout", str(timeout), timeout=timeout + 10)
        assert result.returncode == 0, result.stderr
        return self.agents.wait(timeout)

    def close(self) -> None:
        for proc in [*self.trainers, self.agents]:
            if proc is not None and proc.poll() is None:
                kill_tree(proc)

    # ------------------------------------------------------------------ state
    def status(self) -> dict[str, Any]:
        for path in (self.journal(0) / "status.json", self.pfs / "status.json"):
            try:
                return json.loads(path.read_text())
            except (OSError, ValueError):
                continue
        return {}

    def levels(self) -> dict[str, str]:
        return {r["id"]: r["level"] for r in self.status().get("checkpoints", [])}

    def wait_level(self, ckpt: str, *levels: str, timeout: float = 60) -> None:
        """Until `ckpt` is at one of `levels`."""
        try:
            wait_for(lambda: self.levels().get(ckpt) in levels, timeout, f"{ckpt} in {levels}")
        except AssertionError as exc:
            raise AssertionError(f"{exc} (now {self.levels()}; log {self.root / 'agents.log'})"
                                 ) from None

    def events(self, node: int) -> list[dict[str, Any]]:
        lines = (self.journal(node) / "events.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]


def same_run_config(first: Cluster, root: Path) -> Path:
    """The configuration of another job of agents on `first`'s run and PFS, with spools,
    stages and caches of its own under `root`."""
    for node in range(first.nodes):
        (root / f"node{node}" / "spool").mkdir(parents=True, exist_ok=True)
    text = first.config.read_text()
    for key in ("spool", "stage", "cache"):
        text = text.replace(f'{key} = "{first.root}/node', f'{key} = "{root}/node')
    config = root.parent / f"{root.name}.toml"
    config.write_text(text)
    return config


def finish(proc: subprocess.Popen[bytes], timeout: float = 90) -> str:
    """Wait for a trainer; it must succeed."""
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out.decode()
    return out.decode()


def files_of(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}
