"""The job's start, after the job library has loaded the modules and handed its batch
shell over (`cachex job run`): the template's variables checked, the node set chosen,
the configuration written, the time left read, the environment staged; then the
supervisor. With CX_PLAN=1 every step's command line is printed instead, in the order
the job runs them."""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import ConfigError, OperationError
from ..fsutil import makedirs
from . import life, supervisor
from .adapters import Pbs, Slurm
from .config_file import JobConfig, write_job_config
from .nodes import choose, expand_hosts
from .shell import BatchShell
from .supervisor import log
from .variables import NAMES, JobVars, parse

HOSTS_FROM = {"slurm": "SLURM_JOB_NODELIST", "pbs": "PBS_NODEFILE"}
Launch = Callable[..., list[str]]      # shell.step bound to the node set


def run_job(shell: BatchShell) -> int:
    """The job from its start to its verdict: the exit status of the job."""
    v = parse(shell.read(NAMES))
    adapter = Slurm(v.job_id) if v.scheduler == "slurm" else Pbs(v.job_id)
    nodes, spares = node_set(v, adapter)
    config = job_config(v)
    # the values the library's launch lines read, as settled here
    shell.assigned.update(CACHEX_CONFIG=config, STAGE_VENV=v["STAGE_VENV"],
                          STAGE_TAR=v.stage_tar, MPIEXEC_FLAVOR=v["MPIEXEC_FLAVOR"])
    os.environ["CACHEX_CONFIG"] = config

    def launch(kind: str, ppn: int = 1, arg: str = "") -> list[str]:
        return shell.step(kind, ppn, nodes, spares, arg)

    if v.on("CX_PLAN"):
        print_plan(v, launch, config)
        return 0
    left = halt_window(time_left(v, adapter), v.number("HALT_MARGIN"))
    stage(v, launch, plan=False)
    return supervisor.run(settings(v, shell, config, left),
                          life.JobState(nodes, spares, v.number("MIN_NODES"),
                                        v.number("MAX_RELAUNCHES"),
                                        v.number("MAX_AGENT_RESTARTS"),
                                        v.number("HALT_MARGIN"), v["RUN_NAME"],
                                        full=len(nodes),
                                        load_from=bool(v["LOAD_FROM_ARGS"].strip())))


def settings(v: JobVars, shell: BatchShell, config: str,
             left: int | None) -> supervisor.Settings:
    n = v.number
    return supervisor.Settings(
        scheduler=v.scheduler, job_id=v.job_id, shell=shell, rundir=Path(v["CX_RUNDIR"]),
        cachex=f"{v['CX_BIN']}/cachex", config=config, run_name=v["RUN_NAME"],
        ranks_per_node=n("RANKS_PER_NODE"), time_left=left, vnodes=v.vnodes,
        resume=v["RESUME"], train_stop_grace=n("TRAIN_STOP_GRACE"),
        agent_start_timeout=n("AGENT_START_TIMEOUT"),
        agent_stop_timeout=n("AGENT_STOP_TIMEOUT"), drain_timeout=n("DRAIN_TIMEOUT"),
        recover_timeout=n("RECOVER_TIMEOUT"), halt_exit=n("HALT_EXIT"),
        poll=float(v["POLL"]), node_dirs=bool(v["NODE_DIRS"].strip()),
        master_addr_from=v["MASTER_ADDR_FROM"])


def node_set(v: JobVars, adapter: Slurm | Pbs) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The training nodes and the spares at the start (nodes.choose): the allocation
    less EXCLUDE_NODES and the nodes the scheduler marks failed already."""
    hosts = adapter.hosts(v[HOSTS_FROM[v.scheduler]])
    if not hosts:
        raise OperationError("no hosts in the allocation")
    if v.vnodes:
        log(f"node set: {v.vnodes} virtual nodes on {hosts[0]}")
        return (hosts[0],), ()
    exclude = expand_hosts(v["EXCLUDE_NODES"])
    bad = adapter.bad_at_start()
    if bad:
        log("the scheduler marks these nodes of the job down or offline at its start:"
            f" {' '.join(bad)} (left out)")
    chosen = choose(hosts, v.nodes, v.number("SPARES"), exclude + bad, v.number("MIN_NODES"))
    for note in chosen.notes:
        log(note)
    return tuple(chosen.nodes), tuple(chosen.spares)


def job_config(v: JobVars) -> str:
    """CACHEX_CONFIG when it names a file; else the file written from the variables
    (read back by the agents' own parser: a bad value ends the job here). A plan
    checks it in the job's own directory, not where the job would write it."""
    own = v["CACHEX_CONFIG"]
    if own and Path(own).is_file():
        log(f"configuration: {own}")
        return own
    for name in ("SPOOL", "STAGE", "CACHE", "PFS"):
        if not v[name]:
            raise ConfigError(f"{name} is not set and CACHEX_CONFIG names no file")
    out = v["CONFIG_OUT"] or f"{v['PFS']}/cachex-{v['RUN_NAME']}.toml"
    target = Path(v["CX_RUNDIR"]) / "plan.toml" if v.on("CX_PLAN") else Path(out)
    if not v.on("CX_PLAN"):
        try:
            makedirs(Path(v["PFS"]))
        except OSError as exc:
            raise OperationError(f"cannot create {v['PFS']} (PFS): {exc.strerror}") from exc
    write_job_config(target, JobConfig(
        run=v["RUN_NAME"], spool=v["SPOOL"], stage=v["STAGE"], cache=v["CACHE"],
        pfs=v["PFS"], domain=v["FAILURE_DOMAIN"], exclude=expand_hosts(v["EXCLUDE_NODES"]),
        min_nodes=v.number("MIN_NODES"), rule=v["COMMIT_RULE"], extra=v["CONFIG_EXTRA"],
        job=v.job_id))
    log(f"configuration: {out} (written from the template's variables)")
    return out


def time_left(v: JobVars, adapter: Slurm | Pbs) -> int | None:
    """The job's seconds left as the scheduler states them (JOB_END, epoch seconds on
    this host's clock, overrides); None: no limit known."""
    if v.job_end is not None:
        return v.job_end - int(time.time())
    return adapter.time_left()


def halt_window(left: int | None, margin: int) -> int | None:
    """`left`, said in the log; ConfigError when the halt would come before training."""
    if left is None:
        log("no job end time known: no halt before the walltime")
        return None
    if left <= margin:
        raise ConfigError(f"HALT_MARGIN={margin}s leaves no time to train: the job ends in"
                          f" {left}s")
    log(f"job ends in {left}s; halt {margin}s before (HALT_MARGIN)")
    return left


def stage(v: JobVars, launch: Launch, plan: bool) -> None:
    """STAGE_VENV=1: the venv packed, broadcast (sbcast can leave partial files when it
    fails: they are never used) and unpacked on every node of the job, spares too."""
    if not v.on("STAGE_VENV"):
        return
    if not plan:
        pack(Path(v["CX_BIN"]).parent, Path(v.stage_tar))
    if run_or_print("stage", launch("stage"), plan) != 0:
        raise OperationError(f"sbcast of {v.stage_tar} failed (STAGE_VENV=0 reads the venv"
                             " from the shared file system)")
    if run_or_print("unpack", launch("unpack"), plan) != 0:
        raise OperationError(f"unpacking the venv into {v['STAGE_DIR']} failed on a node")


def pack(venv: Path, tar: Path) -> None:
    """The packed copy of the venv: made once, again when a package changed (a
    site-packages directory newer than the copy)."""
    if tar.exists() and not any(sp.stat().st_mtime > tar.stat().st_mtime
                                for sp in venv.glob("lib/python*/site-packages")):
        return
    log(f"packing {venv} into {tar} (once; again after a package changes)")
    temp = tar.with_name(f"{tar.name}.tmp.{os.getpid()}")
    if subprocess.run(["tar", "-C", str(venv), "-cf", str(temp), "."],
                      stdin=subprocess.DEVNULL).returncode != 0:
        temp.unlink(missing_ok=True)
        raise OperationError(f"cannot pack {venv} into {tar} (STAGE_TAR)")
    os.replace(temp, tar)


def run_or_print(kind: str, argv: list[str], plan: bool) -> int:
    """Run a start-up step and wait; in a plan print it as `plan KIND: WORDS`."""
    if plan:
        print(f"plan {kind}: {shlex.join(argv)}", flush=True)
        return 0
    log(f"{kind}: {' '.join(argv)}")
    return subprocess.run(argv, stdin=subprocess.DEVNULL).returncode


def print_plan(v: JobVars, launch: Launch, config: str) -> None:
    """Every step's command line, in the order the job runs them."""
    stage(v, launch, plan=True)
    ranks = v.number("RANKS_PER_NODE")
    steps = [("check", launch("check")), ("agents", launch("agents")),
             ("recover", launch("recover")), ("train", launch("train", ranks)),
             ("train-resume", launch("train", ranks, "resume")),
             ("stop", [f"{v['CX_BIN']}/cachex", "stop", "--config", config, "--timeout",
                       v["DRAIN_TIMEOUT"]])]
    if v["NODE_DIRS"].strip():
        steps.insert(0, ("prepare", launch("prepare")))
    for kind, argv in steps:
        run_or_print(kind, argv, plan=True)

