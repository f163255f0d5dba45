"""`cachex demo`: the main job on one machine.

Four agents (`mpiexec -n 4 cachex-agent`, failure domain `rank`: each agent is a virtual
node) run beside the example trainer (`mpiexec -n 8`, two ranks per virtual node), which
writes DCP-like checkpoints into its node's spool. Then the agents are stopped (drain),
and every checkpoint is listed, verified at every level, and the newest one exported
from the PFS and compared byte for byte with the trainer's own files.
"""

from __future__ import annotations

import filecmp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click

from . import config as configuration
from .errors import OperationError
from .recovery.catalog import require_global
from .recovery.export import export
from .recovery.verify import verify
from .status import format_ls, load_status

BIN = Path(sys.executable).parent
TRAINER = Path(__file__).resolve().parents[1] / "examples" / "trainer.py"
MARK = ".cachex-demo"
STAGE = "/dev/shm/cachex-demo"


def write_config(workdir: Path, nodes: int, extra: str = "") -> Path:
    for node in range(nodes):
        (workdir / f"node{node}" / "spool").mkdir(parents=True, exist_ok=True)
    (workdir / "pfs").mkdir(exist_ok=True)
    path = workdir / "cachex.toml"
    path.write_text(f'''run = "demo"

[paths]
spool = "{workdir}/node{{node}}/spool"     # the trainer's checkpoint directory
stage = "{STAGE}/node{{node}}"   # local memory
cache = "{workdir}/node{{node}}/nvme"      # node-local NVMe: journal, replicas
pfs   = "{workdir}/pfs"                    # the parallel file system

[topology]
domain = "rank"                            # every agent is its own virtual node

[commit]
rule = "dcp"
{extra}''')
    return path


def start_agents(config: Path, nodes: int, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [str(BIN / "mpiexec"), "-n", str(nodes), str(BIN / "cachex-agent"), "--config",
         str(config)], stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise OperationError(f"timed out after {timeout:.0f}s waiting for {what}")


def agents_up(cfg: configuration.Config) -> bool:
    try:
        return load_status(cfg).get("state") == "running"
    except OperationError:
        return False


def stop_agents(cfg: configuration.Config, agents: subprocess.Popen[bytes],
                timeout: float) -> int:
    stop = cfg.node_paths(0).pfs / "control" / "stop"
    stop.parent.mkdir(parents=True, exist_ok=True)
    stop.write_text("{}")
    try:
        return agents.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(agents.pid, signal.SIGKILL)
        raise OperationError(f"agents did not drain within {timeout:.0f}s") from None


def run_trainer(workdir: Path, ranks: int, ranks_per_node: int, steps: int, every: int,
                shard_size: str, timeout: float, resume: bool = False) -> None:
    command = [str(BIN / "mpiexec"), "-n", str(ranks), sys.executable, str(TRAINER),
               "--spool", f"{workdir}/node{{node}}/spool", "--ranks-per-node",
               str(ranks_per_node), "--steps", str(steps), "--every", str(every),
               "--shard-size", shard_size, "--state-out", str(workdir / "state.json")]
    subprocess.run(command + (["--resume"] if resume else []), check=True, timeout=timeout)


def same_tree(left: Path, right: Path) -> bool:
    names = sorted(p.relative_to(left) for p in left.rglob("*") if p.is_file())
    if names != sorted(p.relative_to(right) for p in right.rglob("*") if p.is_file()):
        return False
    return all(filecmp.cmp(left / n, right / n, shallow=False) for n in names)


def run_demo(workdir: str, nodes: int, ranks_per_node: int, steps: int, every: int,
             shard_size: str) -> None:
    root = Path(workdir).resolve()
    _fresh(root)
    config_path = write_config(root, nodes)
    cfg = configuration.load(config_path)
    log = root / "agents.log"
    click.echo(f"demo: {nodes} agents (virtual nodes) + trainer on {nodes * ranks_per_node}"
               f" ranks; files under {root}; agent log {log}")
    agents = start_agents(config_path, nodes, log)
    try:
        wait_for(lambda: agents_up(cfg), 60, "the agents to start")
        start = time.monotonic()
        run_trainer(root, nodes * ranks_per_node, ranks_per_node, steps, every, shard_size,
                    timeout=600)
        click.echo(f"demo: trainer finished in {time.monotonic() - start:.1f}s; draining agents")
        code = stop_agents(cfg, agents, cfg.flush.drain_timeout + 60)
    finally:
        if agents.poll() is None:
            os.killpg(agents.pid, signal.SIGKILL)
    click.echo(format_ls(load_status(cfg)))
    _check(cfg, root, code)


def _check(cfg: configuration.Config, root: Path, agents_code: int) -> None:
    flushed = [r["id"] for r in load_status(cfg)["checkpoints"] if r["level"] == "flushed"]
    for ckpt in flushed:
        findings = verify(cfg, ckpt)
        bad = [p for f in findings for p in f.problems]
        click.echo(f"verify {ckpt}: {'ok' if not bad else 'BAD'}"
                   f" ({sum(f.ok for f in findings)} copies checked)")
        if bad:
            raise OperationError(f"{ckpt}: {bad[0]}")
    if len(flushed) < 3:
        raise OperationError(f"only {len(flushed)} checkpoints reached the PFS (expected >= 3)")
    newest = flushed[-1]
    exported = root / "export" / newest
    export(require_global(cfg, newest), cfg.node_paths(0).pfs, exported, per_node=True)
    for node in range(len(require_global(cfg, newest).nodes)):
        spool = cfg.node_paths(node).spool / newest
        if not same_tree(spool, exported / f"node-{node:05d}"):
            raise OperationError(f"export of {newest}, node {node}, differs from {spool}")
    click.echo(f"demo: {len(flushed)} checkpoints on the PFS, all verified; {newest} exported"
               f" to {exported} and identical to the trainer's files; agents exited with"
               f" {agents_code}")


def _fresh(root: Path) -> None:
    import shutil
    if root.exists():
        if any(root.iterdir()) and not (root / MARK).exists():
            raise OperationError(f"{root}: exists and is not a cachex demo directory")
        shutil.rmtree(root)
    shutil.rmtree(STAGE, ignore_errors=True)
    root.mkdir(parents=True)
    (root / MARK).write_text("")
