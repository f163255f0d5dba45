"""`cachex demo`: the main job on one machine.

Four agents (`mpiexec -n 4 cachex-agent`, failure domain `rank`: each agent is a virtual
node) run beside the example trainer (`mpiexec -n 8`, two ranks per virtual node), which
writes DCP-like checkpoints into its node's spool. Then the agents are stopped (drain),
and every checkpoint is listed, verified at every level, and the newest one exported
from the PFS and compared byte for byte with the trainer's own files.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import click
import psutil

from . import config as configuration
from .errors import OperationError
from .layout import node_dir_name, pfs_stop_file
from .model.distributions import have_scipy
from .model.history import History, event_files, load_history
from .model.predict import SystemModel, fit_system
from .model.summary import fit_text
from .recovery.catalog import require_global
from .recovery.export import export
from .recovery.verify import verify
from .rules import natural_key
from .shipped import trainer as shipped_trainer
from .status import format_ls, load_status

BIN = Path(sys.executable).parent
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

[model]
path = "peer"   # the drill rebuilds node 0 from its replica; here, where the "PFS" is
                # this machine's own disk, `auto` would soon choose the direct path
{extra}''')
    return path


class Children:
    """Every process the demo starts, each the leader of a process group of its own that
    its MPI ranks share: whatever ends the demo (an error, SIGTERM, SIGHUP, ^C) ends
    them with it, not only the ones a `finally` next to them knows of."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[Any]] = []

    def start(self, command: list[str], **options: Any) -> subprocess.Popen[Any]:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True,
                                **options)
        self.started.append(proc)
        return proc

    def run(self, command: list[str]) -> str:
        proc = self.start(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate(timeout=600)
        if proc.returncode:
            raise OperationError(f"{' '.join(command[:6])}...: exit {proc.returncode}:"
                                 f" {out[-500:]}{err[-500:]}")
        return out

    def end(self, proc: subprocess.Popen[Any]) -> None:
        """SIGKILL `proc` and its descendants. Hydra starts each proxy and rank in a
        session of its own, so mpiexec's group alone would leave the ranks running; the
        tree is stopped first so that no rank forked meanwhile escapes the second look."""
        if proc.poll() is not None:
            return
        for action in (psutil.Process.suspend, psutil.Process.kill):
            for process in _tree(proc.pid):
                try:
                    action(process)
                except psutil.NoSuchProcess:
                    pass
        proc.wait()

    def end_all(self) -> None:
        for proc in self.started:
            self.end(proc)


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _ended_by(signum: int, frame: Any) -> None:
    raise OperationError(f"demo ended by {signal.Signals(signum).name}; its agents and"
                         " trainers are ended too")


def start_agents(children: Children, config: Path, nodes: int,
                 log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return children.start([str(BIN / "mpiexec"), "-n", str(nodes), str(BIN / "cachex-agent"),
                               "--config", str(config)], stdout=out, stderr=subprocess.STDOUT)


def wait_for(predicate: Any, timeout: float, what: str,
             watched: subprocess.Popen[Any] | None = None) -> None:
    """Until `predicate()`; an error at once if `watched`, which should bring it about,
    has exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if watched is not None and watched.poll() is not None:
            command = " ".join(Path(str(arg)).name for arg in watched.args[:5])
            raise OperationError(f"{command} exited with {watched.returncode} while waiting"
                                 f" for {what}")
        time.sleep(0.2)
    raise OperationError(f"timed out after {timeout:.0f}s waiting for {what}")


def coordinator_life(cfg: configuration.Config) -> str | None:
    """The `heartbeat.life` of the status there is now (None: none)."""
    try:
        return load_status(cfg).get("heartbeat", {}).get("life")
    except OperationError:
        return None


def agents_up(cfg: configuration.Config, before: str | None) -> bool:
    """Agents started after the coordinator life `before` are live: a status of a new
    coordinator, not one that agents killed earlier left saying `running` (no time
    compared)."""
    life = coordinator_life(cfg)
    return life is not None and life != before and load_status(cfg)["state"] == "running"


def stop_agents(cfg: configuration.Config, agents: subprocess.Popen[bytes],
                timeout: float) -> int:
    stop = pfs_stop_file(cfg.node_paths(0).pfs)
    stop.parent.mkdir(parents=True, exist_ok=True)
    stop.write_text("{}")
    try:
        return agents.wait(timeout)
    except subprocess.TimeoutExpired:
        raise OperationError(f"agents did not drain within {timeout:.0f}s") from None


def trainer_command(workdir: Path, ranks: int, ranks_per_node: int, steps: int, every: int,
                    shard_size: str, *extra: str) -> list[str]:
    return [str(BIN / "mpiexec"), "-n", str(ranks), sys.executable, str(shipped_trainer()),
            "--spool", f"{workdir}/node{{node}}/spool", "--ranks-per-node", str(ranks_per_node),
            "--steps", str(steps), "--every", str(every), "--shard-size", shard_size,
            "--files-per-rank", "4", *extra]


def final_hash(output: str) -> str:
    return output.strip().splitlines()[-1].split()[-1]


def run_demo(workdir: str, nodes: int, ranks_per_node: int, steps: int, every: int,
             shard_size: str) -> None:
    children = Children()
    signals = (signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, _ended_by) for s in signals}
    try:
        _demo(children, Path(workdir).resolve(), nodes, ranks_per_node, steps, every,
              shard_size)
    finally:
        # a second signal (or ^C) must not cut the clean-up short
        previous[signal.SIGINT] = signal.getsignal(signal.SIGINT)
        for s in previous:
            signal.signal(s, signal.SIG_IGN)
        children.end_all()
        for s, handler in previous.items():
            signal.signal(s, handler)


def _demo(children: Children, root: Path, nodes: int, ranks_per_node: int, steps: int,
          every: int, shard_size: str) -> None:
    _fresh(root)
    config_path = write_config(root, nodes)
    cfg = configuration.load(config_path)
    ranks = nodes * ranks_per_node
    train = (ranks, ranks_per_node, steps, every, shard_size)
    click.echo(f"demo: {nodes} agents (virtual nodes) + trainer on {ranks} ranks"
               f" ({ranks * 4} shard files per checkpoint); files under {root}")
    before = coordinator_life(cfg)
    agents = start_agents(children, config_path, nodes, root / "agents.log")
    wait_for(lambda: agents_up(cfg, before), 60, "the agents to start", agents)
    lost = _lose_node_zero(children, cfg, root, agents, train)
    _drill(children, cfg, config_path, root, lost, nodes)
    before = coordinator_life(cfg)
    agents = start_agents(children, config_path, nodes, root / "agents.log")
    wait_for(lambda: agents_up(cfg, before), 60, "the agents to restart", agents)
    out = children.run(trainer_command(root, *train, "--resume"))
    click.echo(f"demo: the trainer resumed from {lost} and finished step {steps}")
    code = stop_agents(cfg, agents, cfg.flush.drain_timeout + 60)
    reference = final_hash(children.run(trainer_command(root / "reference", *train)))
    if final_hash(out) != reference:
        raise OperationError("the resumed run ends in another state than an uninterrupted one")
    click.echo(f"demo: final state equals an uninterrupted run's (sha256 {reference[:16]}...)")
    click.echo(format_ls(load_status(cfg)))
    _check(cfg, root, code)
    _model(root, cfg)


def _lose_node_zero(children: Children, cfg: configuration.Config, root: Path,
                    agents: subprocess.Popen[bytes], train: tuple[Any, ...]) -> str:
    """Train until a checkpoint is replicated, then node 0 dies: trainer and agents."""
    trainer = children.start(trainer_command(root, *train[:2], 10**6, *train[3:]),
                             stdout=subprocess.DEVNULL)
    every = train[3]
    target = f"step_{3 * every:05d}"
    wait_for(lambda: _level(cfg, target) in ("replicated", "flushed"), 300,
             f"{target} to be replicated", trainer)
    for proc in (trainer, agents):
        children.end(proc)
    levels = {r["id"]: r["level"] for r in load_status(cfg)["checkpoints"]}
    safe = [c for c, level in levels.items() if level in ("replicated", "flushed")]
    newest = max(safe, key=natural_key)
    click.echo(f"demo: node 0 lost (trainer and agents SIGKILLed) at {levels}")
    return newest


def _drill(children: Children, cfg: configuration.Config, config_path: Path, root: Path,
           ckpt: str, nodes: int) -> None:
    before = {n: _files(cfg.node_paths(n).spool_dir(ckpt)) for n in range(nodes)}
    shutil.rmtree(root / "node0")
    shutil.rmtree(f"{STAGE}/node0", ignore_errors=True)
    (root / "node0" / "spool").mkdir(parents=True)
    pfs = cfg.node_paths(0).pfs
    os.rename(pfs, pfs.with_name("pfs-unreachable"))
    click.echo("demo: node 0's spool, stage and NVMe deleted; the PFS made unreachable;"
               f" cachex recover on {nodes} nodes (node 0 a fresh replacement):")
    try:
        out = children.run([str(BIN / "mpiexec"), "-n", str(nodes), str(BIN / "cachex"), "recover",
                    "--config", str(config_path)])
    finally:
        os.rename(pfs.with_name("pfs-unreachable"), pfs)
    click.echo("\n".join("  " + line for line in out.strip().splitlines()))
    metadata = before[0][".metadata"]
    for node, files in before.items():
        if _files(cfg.node_paths(node).spool_dir(ckpt)) != {**files, ".metadata": metadata}:
            raise OperationError(f"node {node}: recovered files of {ckpt} differ")
    click.echo(f"demo: every shard and the metadata of {ckpt} are back, byte for byte")


def _level(cfg: configuration.Config, ckpt: str) -> str | None:
    try:
        rows = load_status(cfg)["checkpoints"]
    except OperationError:
        return None
    return next((r["level"] for r in rows if r["id"] == ckpt), None)


def _files(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


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
    manifest = require_global(cfg, newest)
    export(manifest, cfg.node_paths(0).pfs, exported, per_node=True)
    for node in range(len(manifest.nodes)):
        spool = cfg.node_paths(node).spool_dir(newest)
        own = {e.path for e in manifest.node_files(node)}     # not the mirrored globals
        if {p: b for p, b in _files(spool).items() if p in own} != _files(
                exported / node_dir_name(node)):
            raise OperationError(f"export of {newest}, node {node}, differs from {spool}")
    click.echo(f"demo: {len(flushed)} checkpoints on the PFS, all verified; {newest} exported"
               f" to {exported} and identical to the trainer's files; agents exited with"
               f" {agents_code}")


def _model(root: Path, cfg: configuration.Config) -> None:
    """The durability model fitted on this run's events: what `cachex model fit` says."""
    if not have_scipy():
        click.echo("demo: the durability model is skipped: its libraries are the [model]"
                   " extra (pip install 'cachex-agent[model]')")
        return
    history = load_history(event_files([root]))
    model = fit_system(history)
    click.echo(f"demo: the durability model, fitted on this run's events (cachex model fit"
               f" {root}):")
    click.echo(textwrap.indent(fit_text(model, history, "aic"), "  "))
    observed = sorted(s.latency for s in history.level("flushed", "peer"))
    if observed and model.size and model.nodes:
        predicted = model.predict("flushed", "peer", model.size, model.nodes)
        click.echo(f"demo: flushed after {statistics.median(observed):.2f} s (median of"
                   f" {len(observed)}); the model predicts {predicted.quantile(0.5):.2f} s,"
                   f" 95% by {predicted.quantile(0.95):.2f} s")
    if model.size and model.nodes and model.period:
        _advice(cfg, history, model)


def _advice(cfg: configuration.Config, history: History, model: SystemModel) -> None:
    """What `cachex advise` says of this run: the save interval that loses least time.
    The node lost above was a drill: recorded as one, shown, and kept out of the rates."""
    from .model.advise_run import run_advise
    text, _ = run_advise(cfg, history, model, model.size, model.nodes, model.period,
                         record="node", drill=True)
    click.echo(f"demo: how often to save (cachex advise --config {cfg.source}):")
    click.echo(textwrap.indent(text, "  "))


def _fresh(root: Path) -> None:
    if root.exists():
        if any(root.iterdir()) and not (root / MARK).exists():
            raise OperationError(f"{root}: exists and is not a cachex demo directory")
        shutil.rmtree(root)
    shutil.rmtree(STAGE, ignore_errors=True)
    root.mkdir(parents=True)
    (root / MARK).write_text("")
