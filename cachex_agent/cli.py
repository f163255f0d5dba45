"""Command line: thin click commands that build the configuration and call a module.

`CachexError` becomes one line on stderr and its exit code (2 for configuration and
usage, 1 for failed operations); no traceback for expected errors.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import secrets
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from . import __version__, faults
from . import config as configuration
from .errors import CachexError, ConfigError, OperationError
from .fsutil import makedirs, write_json
from .job.run_cli import run_command as job_run_command
from .layout import journal_stop_file, pfs_stop_file
from .mpi_env import choose_netmod
from .outputs import SCHEMA
from .recovery.plan import KINDS as COPY_KINDS
from .topology import agents_on_host, check_one_job, launch_rank


def _overrides(values: tuple[str, ...]) -> dict[str, str]:
    parsed = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        parsed[key.strip()] = value
    return parsed


def config_options(func: Callable[..., Any] | None = None, *, lookup: bool = True) -> Any:
    """--config/--set/--run, shared by every command; passes `cfg`. `lookup`: without
    --config, find the configuration the run's agents recorded (runs.py)."""
    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        @click.option("--config", "config_path", envvar="CACHEX_CONFIG", metavar="FILE",
                      type=click.Path(dir_okay=False),
                      help="cachex.toml (default: $CACHEX_CONFIG, the configuration the"
                      " run's agents recorded, ./cachex.toml)")
        @click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
                      help="override one key, e.g. --set flush.bandwidth=100MiB (repeatable)")
        @click.option("--run", "run_name", metavar="NAME", help="the run name (key `run`);"
                      " its recorded configuration when no --config is given")
        @functools.wraps(func)
        def wrapper(config_path: str | None, sets: tuple[str, ...], run_name: str | None,
                    **kwargs: Any) -> Any:
            overrides = _overrides(sets)
            if run_name:
                overrides["run"] = run_name
            return func(cfg=_find_config(config_path, overrides, run_name, lookup), **kwargs)
        return wrapper
    return decorate(func) if func is not None else decorate


def _find_config(config_path: str | None, overrides: dict[str, str], run_name: str | None,
                 lookup: bool) -> configuration.Config:
    """--config, else the record of --run NAME, else ./cachex.toml, else the one run
    recorded (runs.py); the settings used are kept for the agent's own record."""
    from . import runs
    if not config_path and lookup and run_name:
        found = runs.load_recorded(run_name, overrides)
        if found is not None:
            return found
    path = config_path or ("cachex.toml" if Path("cachex.toml").exists() else None)
    if path is None and lookup:
        only = None if run_name else runs.only_run()
        if only is not None:
            return runs.load_recorded(only, overrides)
        if "paths.spool" not in overrides and "CACHEX_PATHS_SPOOL" not in os.environ:
            known = ", ".join(runs.known_runs()) or "none"
            what = f"run {run_name} is not recorded" if run_name else "no run is recorded"
            raise ConfigError(f"no configuration: {what} in {runs.runs_dir()} (known: {known});"
                              " give --config FILE (the agents record theirs when they start)")
    flat = configuration.settings(path, overrides)
    click.get_current_context().meta["cachex.settings"] = flat
    return configuration.from_settings(flat, str(path or ""))


class Duration(click.ParamType):
    """`90`, `90s`, `5min`: what the configuration accepts for a time."""
    name = "duration"

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        if isinstance(value, float):
            return value
        try:
            return configuration.parse_duration(value, f"--{param.name}" if param else "time")
        except ConfigError as exc:
            self.fail(str(exc), param, ctx)


def _echo_json(data: dict[str, Any]) -> None:
    """Every --json output: one object, its shape in outputs.SHAPES."""
    click.echo(json.dumps({"schema": SCHEMA, **data}, indent=1))


def quiet_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("-q", "--quiet", is_flag=True, help="no progress on stderr (errors"
                        " only)")(func)


def _progress(prog: str, quiet: bool) -> Any:
    """Steps and bytes on stderr: a bar on a terminal, a line per step elsewhere."""
    from .progress import Progress, mode_for
    return Progress(prog, mode_for(quiet))


def _checkpoint_argument(value: str | None, name: str) -> str | None:
    """A checkpoint id given on the command line is a usage error when unsafe."""
    from .safepath import UnsafeInput, checkpoint_id
    try:
        return value if value is None else checkpoint_id(value, name)
    except UnsafeInput as exc:
        raise ConfigError(str(exc)) from None


# the `[model]` extra: the model's fits and the report's figures, never the data path
OPTIONAL_MODULES = ("scipy", "matplotlib")


def _run_guarded(func: Callable[[], Any], prog: str = "cachex", report: bool = True) -> None:
    """`report=False`: exit with the code, silently (another process says it)."""
    try:
        func()
    except CachexError as exc:
        if report:
            click.echo(f"{prog}: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] not in OPTIONAL_MODULES:
            raise
        click.echo(f"{prog}: error: this command needs {exc.name}: pip install"
                   " 'cachex-agent[model]'", err=True)
        sys.exit(1)


def _setup_logging(level: str, prefix: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format=f"%(asctime)s [{prefix}] %(levelname)s %(message)s")


# ------------------------------------------------------------------ cachex-agent
@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="cachex-agent")
@config_options(lookup=False)
@click.option("-v", "--verbose", count=True, help="more log output")
@click.option("-q", "--quiet", is_flag=True, help="warnings and errors only")
@click.option("--check", is_flag=True, help="run the start-up checks under the same"
              " launcher, print the plan and exit (0, or 2 naming what failed)")
def agent_command(cfg: configuration.Config, verbose: int, quiet: bool, check: bool) -> None:
    """Run the agent: one per node, beside the training step (srun/mpiexec).

    Watches the spool, captures committed checkpoints into the stage and flushes them to
    the PFS; runs until `cachex stop` or SIGTERM, then drains.
    """
    faults.install()    # before any work starts: the one reading of a test's faults
    short_of_memory = _memory_error(cfg)
    netmod = choose_netmod()
    from mpi4py import MPI  # only the agent needs MPI: `cachex status` must not

    from .agent import Agent
    from .collective import agree
    from .inbox import exit_watchdog
    comm = MPI.COMM_WORLD
    level = "debug" if verbose else "warning" if quiet else cfg.agent.log
    _setup_logging(level, f"{comm.Get_rank()}@{socket.gethostname()}")
    try:
        # before the window and the directories: every agent refuses together
        agree(comm, "start-up check", lambda: _start_checks(comm.Get_size(), short_of_memory))
        if check:
            from .preflight import check as preflight
            for line in preflight(cfg, comm):
                click.echo(line)
            sys.exit(0)
        agent = Agent(cfg, comm)
    except CachexError as exc:
        if comm.Get_rank() == 0 and launch_rank() == 0:   # said once, also by lone agents
            click.echo(f"cachex-agent: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except Exception as exc:    # a bug on this rank alone: the others would wait on it
        click.echo(f"cachex-agent: error: rank {comm.Get_rank()}: start-up failed:"
                   f" {type(exc).__name__}: {exc}; aborting the agent job", err=True)
        comm.Abort(1)
    _say_mpi(comm, netmod)
    if comm.Get_rank() == 0:
        _record_run(cfg)
    try:
        code = agent.run()
    except Exception as exc:
        agent.fatal("main thread", exc)     # never leave other agents waiting on a dead one
    if agent.left_behind():
        # MPI's finalize would wait on an agent that is gone or stopped, holding the GIL
        # (no watchdog thread runs then): what this agent had to write is written
        logging.shutdown()
        os._exit(code)
    exit_watchdog(2 * cfg.agent.timeout)    # MPI finalize, at exit, waits on every agent
    sys.exit(code)


def _record_run(cfg: configuration.Config) -> None:
    """Where this run's configuration is, for commands started without --config; a
    state directory that cannot be written costs only that convenience."""
    from .runs import record
    try:
        path = record(cfg, click.get_current_context().meta["cachex.settings"])
        logging.getLogger("cachex").info("configuration recorded in %s", path)
    except OSError as exc:
        logging.getLogger("cachex").warning("run %s not recorded: %s", cfg.run, exc)


def _say_mpi(comm: Any, netmod: str | None) -> None:
    """Which MPI library the agents use (and the network module cachex chose for it),
    and a warning when it is a PyPI wheel's on a system that has its own (said by rank
    0; every agent loads the same venv)."""
    from .preflight import loaded_mpi_library, mpi_warning
    if comm.Get_rank() == 0:
        library = loaded_mpi_library()
        logging.getLogger("cachex").info("MPI library: %s", library)
        if netmod:
            logging.getLogger("cachex").info("%s", netmod)
        warning = mpi_warning(library)
        if warning:
            logging.getLogger("cachex").warning("%s", warning)


def _start_checks(world: int, short_of_memory: ConfigError | None) -> None:
    check_one_job(world)
    _raise_if(short_of_memory)


def _memory_error(cfg: configuration.Config) -> ConfigError | None:
    """Measured before MPI allocates anything. Raised only inside a collective step, once
    MPI is up: an agent that left before MPI_Init would leave the others waiting in it
    for good, and hosts (or the moment each agent looks) differ."""
    try:
        configuration.check_memory(cfg, agents_on_host())
    except ConfigError as exc:
        return exc
    return None


def _raise_if(error: Exception | None) -> None:
    if error is not None:
        raise error


def agent_main() -> None:
    # A configuration error is the same in every agent (same file): rank 0 says it.
    _run_guarded(lambda: _click_main(agent_command), "cachex-agent", report=launch_rank() == 0)


def _click_main(command: click.Command) -> None:
    try:
        command.main(standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        sys.exit(1)
    except click.ClickException as exc:
        exc.show()
        sys.exit(2)


# ------------------------------------------------------------------------ cachex
@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="cachex")
def main_group() -> None:
    """cachex: inspect and operate the checkpoint tier."""


@main_group.command("status")
@config_options
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--at-risk", "risk_only", is_flag=True,
              help="only the work at risk now (what the job templates print)")
def status_command(cfg: configuration.Config, as_json: bool, risk_only: bool) -> None:
    """Every checkpoint, the highest level that holds, and work in flight."""
    from .risk import risk_lines
    from .status import format_status, load_status
    status = load_status(cfg, settle=True)
    if as_json:
        from .model.advice_store import load_advice
        _echo_json({**status, "advice": load_advice(cfg)})
    elif risk_only:
        click.echo("\n".join(risk_lines(status))
                   or "at risk now: not known (no status of the agents, only the PFS index)")
    else:
        click.echo(format_status(status))


def _interval(ctx: click.Context, param: click.Parameter, value: float) -> float:
    if not 0 < value <= 60:             # NaN too, which click.FloatRange lets through
        raise click.BadParameter(f"{value}: must be more than 0 and at most 60 seconds")
    return value


@main_group.command("watch")
@config_options
@click.option("--interval", type=float, default=2.0, show_default=True, metavar="S",
              callback=_interval, help="seconds between frames (more than 0, at most 60)")
@click.option("--once", is_flag=True, help="print one frame, without escape codes, and exit")
def watch_command(cfg: configuration.Config, interval: float, once: bool) -> None:
    """A live view of the run until Ctrl-C: checkpoints as a bar per node, work at risk,
    flush bandwidth, errors."""
    from .watch_view import watch
    watch(cfg, interval, once)


@main_group.command("ls")
@config_options
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def ls_command(cfg: configuration.Config, as_json: bool) -> None:
    """List checkpoints and their levels."""
    from .status import format_ls, listing, load_status
    status = load_status(cfg)
    if as_json:
        _echo_json(listing(status))
    else:
        click.echo(format_ls(status))


@main_group.command("runs")
@click.option("--prune", is_flag=True,
              help="remove the records whose configuration and PFS run directory are gone")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def runs_command(prune: bool, as_json: bool) -> None:
    """The runs the agents recorded (what --run NAME can name), newest first."""
    from . import runs
    pruned = runs.prune() if prune else []
    known = runs.records()
    if as_json:
        _echo_json({"dir": str(runs.runs_dir()), "pruned": pruned, "runs": [
            {"run": k.run, "written": k.written, "job": k.job, "config": k.config,
             "config_exists": k.config_exists, "pfs": k.pfs, "pfs_exists": k.pfs_exists,
             "gone": k.gone, "problem": k.problem} for k in known]})
        return
    for run in pruned:
        click.echo(f"pruned {run}: its configuration and PFS run directory are gone")
    click.echo(f"{len(known)} runs recorded in {runs.runs_dir()}")
    for k in known:
        when = (time.strftime("%Y-%m-%d %H:%M", time.localtime(k.written)) if k.written
                else "?")
        where = k.problem or (f"config {k.config or '-'}{'' if k.config_exists else ' (gone)'},"
                              f" pfs {k.pfs}{'' if k.pfs_exists else ' (gone)'}")
        click.echo(f"  {k.run:<24} {when}  job {k.job or '-'}  {where}")
    if any(k.gone for k in known):
        click.echo("runs marked gone in both places: 'cachex runs --prune' removes them")


@main_group.command("verify")
@config_options
@click.argument("ckpt")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@quiet_option
def verify_command(cfg: configuration.Config, ckpt: str, as_json: bool, quiet: bool) -> None:
    """Check the checksums of every copy of CKPT visible from this machine."""
    from .recovery.catalog import level_of
    from .recovery.verify import verify
    findings = verify(cfg, _checkpoint_argument(ckpt, "CKPT"),
                      _progress("cachex verify", quiet))
    bad = [f for f in findings if f.checked and f.problems]
    seen = any(f.checked for f in findings)
    if as_json:
        _echo_json({"ckpt": ckpt, "ok": not bad and seen, "level": level_of(cfg, ckpt),
                    "copies": [{"level": f.level, "node": f.node, "where": f.where,
                                "checked": f.checked, "ok": f.ok, "problems": f.problems,
                                "note": None if f.checked else f.note} for f in findings]})
    else:
        _say_findings(ckpt, findings)
    if bad or not seen:
        raise OperationError(f"{ckpt}: {len(bad)} bad copies" if bad
                             else f"{ckpt}: no promised copy visible from this machine")
    if not as_json:
        click.echo(f"{ckpt}: verified {sum(f.ok for f in findings)} copies")


def _say_findings(ckpt: str, findings: list[Any]) -> None:
    for f in findings:
        state = "ok" if f.ok else f.note if not f.checked else "BAD"
        click.echo(f"{ckpt} {f.level:<7} node {f.node:<4} {state:<16} {f.where}")
        for problem in f.problems:
            click.echo(f"    {problem}")


@main_group.command("export")
@config_options
@click.argument("args", nargs=-1, metavar="[CKPT] DEST")
@click.option("--per-node", is_flag=True, help="one sub-directory per node")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@quiet_option
def export_command(cfg: configuration.Config, args: tuple[str, ...], per_node: bool,
                   as_json: bool, quiet: bool) -> None:
    """Write CKPT from the PFS bundles to DEST in the trainer's layout (no MPI).

    Without CKPT: the index's current checkpoint (`cachex index`)."""
    from .recovery.catalog import require_global
    from .recovery.export import export
    ckpt, dest = _export_arguments(cfg, args)
    manifest = require_global(cfg, ckpt)
    start = time.monotonic()
    total = export(manifest, cfg.node_paths(0).pfs, Path(dest), per_node,
                   _progress("cachex export", quiet))
    seconds = time.monotonic() - start
    if as_json:
        _echo_json({"ckpt": ckpt, "dest": str(dest), "files": len(manifest.files),
                    "bytes": total, "seconds": round(seconds, 3)})
    else:
        click.echo(f"{ckpt}: exported {len(manifest.files)} files, {total} bytes to {dest}"
                   f" in {seconds:.1f}s")


def _export_arguments(cfg: configuration.Config, args: tuple[str, ...]) -> tuple[str, str]:
    if len(args) not in (1, 2):
        raise ConfigError(f"export: expected [CKPT] DEST, got {len(args)} arguments")
    if len(args) == 2:
        return str(_checkpoint_argument(args[0], "CKPT")), args[1]
    from .index import NotAnIndex, read_index
    pfs = cfg.node_paths(0).pfs
    try:
        current = read_index(pfs).current
    except (OSError, NotAnIndex) as exc:
        raise OperationError(f"export: no CKPT given and no index to take the current one"
                             f" from ({exc})") from None
    if current is None:
        raise OperationError(f"export: no CKPT given and run {cfg.run} has no valid"
                             " checkpoint in its index")
    return current, args[0]


@main_group.command("index")
@config_options
@click.option("--current", "pin", metavar="NAME", help="make NAME the checkpoint `recover`"
              " and `export` pick by default")
@click.option("--drop", metavar="NAME", help="remove NAME from the index and its PFS files")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def index_command(cfg: configuration.Config, pin: str | None, drop: str | None,
                  as_json: bool) -> None:
    """List the checkpoints of the PFS index; pin the current one or drop one.

    Changes are refused while the run's agents are running (they rewrite the index)."""
    from . import index as pfs_index
    pfs = cfg.node_paths(0).pfs
    if pin and drop:
        raise ConfigError("index: --current and --drop: give one of them")
    name = _checkpoint_argument(pin or drop, "--current" if pin else "--drop")
    if name is not None:
        _refuse_while_running(cfg)
    index = _read_pfs_index(pfs) if name is None else (
        pfs_index.set_current(pfs, name) if pin else pfs_index.drop(pfs, name))
    if as_json:
        _echo_json({"run": index.run, "current": index.current, "pinned": index.pinned,
                    "action": "current" if pin else "drop" if drop else "list",
                    "name": name, "checkpoints": [
                        {"id": r.id, "seq": r.seq, "state": r.state, "bytes": r.bytes,
                         "flushed_at": r.flushed_at} for r in index.checkpoints]})
        return
    if pin:
        click.echo(f"current: {pin} (recover and export pick it by default)")
    elif drop:
        click.echo(f"dropped {drop} and its PFS files")
    click.echo(_format_index(index))


def _read_pfs_index(pfs: Path) -> Any:
    from .index import NotAnIndex, read_index
    from .layout import index_path
    try:
        return read_index(pfs)
    except FileNotFoundError:
        raise OperationError(f"{index_path(pfs)}: no index (nothing flushed yet?)") from None
    except (OSError, NotAnIndex) as exc:
        raise OperationError(str(exc)) from None


def _refuse_while_running(cfg: configuration.Config) -> None:
    from .status import load_status
    try:
        live = load_status(cfg, settle=True).get("live", False)
    except CachexError:
        live = False
    if live:
        raise OperationError(f"run {cfg.run}: agents are running and rewrite the index;"
                             " stop them first (cachex stop)")


def _format_index(index: Any) -> str:
    from .status import human_size
    lines = [f"  {'checkpoint':<24} {'seq':>5}  {'state':<7} {'size':>10}  flushed"]
    for row in index.checkpoints:
        mark = "*" if row.id == index.current else " "
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row.flushed_at)) \
            if row.flushed_at else "-"
        lines.append(f"{mark} {row.id:<24} {row.seq:>5}  {row.state:<7}"
                     f" {human_size(row.bytes):>10}  {when}")
    how = "pinned by cachex index --current" if index.pinned else "the newest valid"
    lines.append(f"current: {index.current} ({how})" if index.current
                 else "current: none (no valid checkpoint)")
    return "\n".join(lines)


@main_group.command("recover")
@config_options
@click.option("--ckpt", metavar="ID", help="recover this checkpoint (default: the one pinned"
              " by `cachex index --current`, else the newest recoverable one)")
@click.option("--exclude", multiple=True, metavar="SOURCE",
              type=click.Choice(COPY_KINDS),
              help="do not use copies of this kind (repeatable)")
@click.option("--dry-run", is_flag=True, help="print the plan, change nothing")
@click.option("--to", "to", metavar="DIR", type=click.Path(path_type=Path),
              help="assemble the checkpoint in DIR (a directory every rank sees, in the"
              " spool's layout) instead of the spools")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@quiet_option
def recover_command(cfg: configuration.Config, ckpt: str | None, exclude: tuple[str, ...],
                    dry_run: bool, to: Path | None, as_json: bool, quiet: bool) -> None:
    """Rebuild a checkpoint into every node's spool from what survived.

    Run with one rank per node (replacement nodes included), e.g.
    `srun --ntasks-per-node=1 cachex recover`, or as one process for one node. The job
    may have fewer or more nodes than the checkpoint (see docs/levels.md). Rank 0
    shows the steps and its own node's bytes on stderr.
    """
    faults.install()    # before any work starts: the one reading of a test's faults
    choose_netmod()
    from mpi4py import MPI

    from .recovery.rebuild import recover
    ckpt = _checkpoint_argument(ckpt, "--ckpt")
    comm = MPI.COMM_WORLD
    _setup_logging(cfg.agent.log, f"{comm.Get_rank()}@{socket.gethostname()}")
    try:
        outcome = recover(cfg, comm, ckpt, frozenset(exclude), dry_run,
                          _progress("cachex recover", quiet or comm.Get_rank() != 0),
                          to=None if to is None else to.absolute())
    except CachexError as exc:      # raised alike on every rank
        if comm.Get_rank() == 0:
            click.echo(f"cachex recover: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except Exception:
        logging.getLogger("cachex").exception("recover failed; aborting the job")
        comm.Abort(1)
    if comm.Get_rank() == 0 and as_json:
        _echo_json(_recovery_json(outcome, dry_run))
    elif comm.Get_rank() == 0:
        click.echo("\n".join([*outcome.erasure, *outcome.plan.describe()]))
        if not dry_run:
            click.echo(_recovery_summary(outcome))


def _recovery_json(outcome: Any, dry_run: bool) -> dict[str, Any]:
    plan = outcome.plan
    moves = [{"target": m.target, "owner": m.owner, "kind": m.source.kind,
              "holder": m.source.holder, "files": list(m.paths)} for m in plan.moves]
    data: dict[str, Any] = {"ckpt": plan.ckpt, "seq": plan.seq, "dry_run": dry_run,
                            "nodes": len(plan.manifest.nodes),
                            "onto": plan.nodes or len(plan.manifest.nodes), "to": plan.to,
                            "placement": plan.notes, "moves": moves,
                            "erasure": outcome.erasure}
    if not dry_run:
        data.update(bytes_by_kind=outcome.bytes_by_kind,
                    replicated_bytes=outcome.replicated_bytes,
                    seconds=round(outcome.seconds, 3), plan_seconds=round(
                        outcome.plan_seconds, 3), move_seconds=round(outcome.move_seconds, 3),
                    fallbacks=outcome.fallbacks, moved_aside=outcome.moved_aside)
    return data


def _recovery_summary(outcome: Any) -> str:
    from .status import human_size
    total = sum(outcome.bytes_by_kind.values())
    rate = total / outcome.move_seconds if outcome.move_seconds else 0.0
    sources = ", ".join(f"{kind} {human_size(n)}" for kind, n in
                        sorted(outcome.bytes_by_kind.items())) or "all in place"
    what = (f"assembled {outcome.plan.ckpt} in {outcome.plan.to}" if outcome.plan.to
            else f"recovered {outcome.plan.ckpt}")
    lines = [f"{what}: {len(outcome.plan.manifest.files)} files;"
             f" moved {human_size(total)} ({sources}) in {outcome.move_seconds:.2f}s"
             f" ({human_size(rate)}/s), each file verified as it moved; listed copies and"
             f" planned in {outcome.plan_seconds:.2f}s; re-replicated"
             f" {human_size(outcome.replicated_bytes)}; {outcome.seconds:.2f}s in all"]
    lines += [f"taken from another copy: {note}" for note in outcome.fallbacks]
    lines += [f"set aside: {line}" for line in outcome.moved_aside]
    return "\n".join(lines)


@main_group.command("stop")
@config_options
@click.option("--wait/--no-wait", default=True, help="wait until the agents have exited")
@click.option("--timeout", type=Duration(), default=None, help="how long to wait, e.g. 90s,"
              " 10min (default: drain timeout + agent timeout)")
@click.option("--json", "as_json", is_flag=True, help="one JSON object at the end")
def stop_command(cfg: configuration.Config, wait: bool, timeout: float | None,
                 as_json: bool) -> None:
    """Ask the agents of this run to drain and exit.

    Two requests: on the PFS, read by the coordinator, and in the journal of the agent
    on this machine (node 0's on a shared host; this node's own with `topology.domain =
    "node"`), which passes it on to the coordinator over MPI: a stop run on any node
    reaches the agents while the PFS is down."""
    here = cfg.node_paths(0)
    targets = {pfs_stop_file(here.pfs): "on the PFS, for the coordinator"}
    if here.journal.is_dir():
        targets[journal_stop_file(here.journal)] = "in this node's journal, for its agent"
    written = []
    # the agents act on a token they have not seen (not on the file's time: the clocks
    # of this host, the file server and the coordinator's host may differ)
    token = secrets.token_hex(8)
    for target, what in targets.items():
        try:
            makedirs(target.parent)
            write_json(target, {"requested": time.time(), "token": token})
            written.append((target, what))
        except OSError:
            continue
    if not written:
        raise OperationError(f"could not write a stop request to {', '.join(map(str, targets))}"
                             + ("" if here.journal.is_dir() else
                                f" (no agent journal at {here.journal} on this node)"))
    say = (lambda _line: None) if as_json else click.echo
    say(f"stop requested ({'; '.join(f'{what}: {path}' for path, what in written)})")
    state = _wait_stopped(cfg, timeout or cfg.flush.drain_timeout + cfg.agent.timeout,
                          say, token) if wait else "requested"
    if as_json:
        _echo_json({"run": cfg.run, "requested": [str(path) for path, _ in written],
                    "state": state})


def _wait_stopped(cfg: configuration.Config, timeout: float,
                  say: Callable[[str], None], token: str) -> str:
    """Until the agents stopped; says what they are still doing whenever that changes,
    and when the coordinator took this request (its `stop_ack`). Dead agents read `not
    running` once their heartbeat stood still for the stale period (status.py)."""
    from .beats import Unchanged
    from .status import load_status
    deadline = time.monotonic() + timeout
    said, seen, acked = "", Unchanged(), False
    while time.monotonic() < deadline:
        try:
            status = load_status(cfg, seen)
        except CachexError:
            status = {}
        if status.get("stop_ack") == token and not acked:
            say("the coordinator took the stop request")
            acked = True
        state = status.get("state")
        if state in ("stopped", "not running"):
            say(f"agents {state}")
            return str(state)
        waiting = _waiting_for(status)
        if waiting != said:
            say(f"{waiting} (giving up in {deadline - time.monotonic():.0f}s)")
            said = waiting
        time.sleep(0.5)
    raise OperationError(f"agents of run {cfg.run} did not stop within {timeout:.0f}s")


def _waiting_for(status: dict[str, Any]) -> str:
    """One line: the agents' state and the checkpoints not yet at their final level."""
    busy = [f"{row['id']} {row['level']}" for row in status.get("checkpoints", [])
            if row.get("level") in ("written", "captured", "replicated")
            and row.get("flush", True)]
    what = f"{', '.join(busy[-4:])} not yet flushed" if busy else "the agents to exit"
    return f"waiting ({status.get('state', 'no status yet')}): {what}"


# ------------------------------------------------------------------------ model
def model_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """EVENTS... (files or directories), and a configuration that may be absent."""
    @click.argument("events", nargs=-1, type=click.Path(exists=True, path_type=Path))
    @click.option("--config", "config_path", envvar="CACHEX_CONFIG", metavar="FILE",
                  type=click.Path(dir_okay=False), help="cachex.toml: its run's events and"
                  " failure rates (default: $CACHEX_CONFIG)")
    @click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
                  help="override one key, e.g. --set model.node_rate=0.01")
    @click.option("--model", "model_path", type=click.Path(dir_okay=False, path_type=Path),
                  help="a model saved by `cachex model fit --save` instead of the events")
    @functools.wraps(func)
    def wrapper(events: tuple[Path, ...], config_path: str | None, sets: tuple[str, ...],
                model_path: Path | None, **kwargs: Any) -> Any:
        from .model.history import config_event_files, event_files, load_history
        overrides = _overrides(sets)
        path = config_path or ("cachex.toml" if Path("cachex.toml").exists() else None)
        if path is None:        # the model needs no directories: only events and rates
            # placeholders: never made or read, but apart (the overlap check runs on load)
            overrides = {"paths.spool": "-spool", "paths.pfs": "-pfs", **overrides}
        cfg = configuration.load(path, overrides)
        if events:
            files = event_files(events)
        elif path is not None:
            files = config_event_files(cfg)
        elif model_path is None:
            raise ConfigError("give event files or directories (e.g. demo-run), or --config")
        else:
            files = []
        if not files and model_path is None:
            raise OperationError(f"no events.jsonl found in {', '.join(map(str, events))}"
                                 if events else f"run {cfg.run}: no events.jsonl under"
                                 f" paths.cache ({cfg.paths.cache})")
        return func(cfg=cfg, history=load_history(files), model_path=model_path, **kwargs)
    return wrapper


def _system(history: Any, model_path: Path | None, criterion: str = "aic") -> Any:
    from .model.predict import SystemModel, fit_system
    return SystemModel.load(model_path) if model_path else fit_system(history, criterion)


def _size_option(func: Callable[..., Any]) -> Callable[..., Any]:
    func = click.option("--nodes", type=click.IntRange(1), help="node count (default: the"
                        " most common in the events)")(func)
    return click.option("--size", metavar="SIZE", help="checkpoint size, e.g. 64GiB"
                        " (default: the median in the events)")(func)


def _size_and_nodes(model: Any, size: str | None, nodes: int | None) -> tuple[float, int]:
    value = configuration.parse_size(size, "--size") if size else model.size
    count = nodes or model.nodes
    if not value or not count:
        raise ConfigError("--size and --nodes: not in the events; give them")
    return float(value), int(count)


def _period(cfg: configuration.Config, model: Any, period: str | None) -> float:
    """--period, else model.period, else the period seen in the events."""
    value = (configuration.parse_duration(period, "--period") if period
             else cfg.model.period or model.period)
    if not value:
        raise ConfigError("--period: no checkpoint period in the events; give one")
    return float(value)


@main_group.group("model")
def model_group() -> None:
    """The durability model: fit stage statistics, predict completion, plan the path."""


@model_group.command("fit")
@model_options
@click.option("--criterion", type=click.Choice(["aic", "bic"]), default="aic", show_default=True)
@click.option("--save", type=click.Path(dir_okay=False, path_type=Path),
              help="write the fitted model (JSON) for predict/plan --model")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def model_fit_command(cfg: configuration.Config, history: Any, model_path: Path | None,
                      criterion: str, save: Path | None, as_json: bool) -> None:
    """Fit every stage's duration and bandwidth (log-normal, gamma, Weibull)."""
    from .model.predict import fit_system
    from .model.summary import fit_text
    model = fit_system(history, criterion)
    if save:
        model.save(save)
    if as_json:
        _echo_json(model.to_json())
    else:
        click.echo(fit_text(model, history, criterion))


@model_group.command("predict")
@model_options
@_size_option
@click.option("--level", type=click.Choice(["captured", "replicated", "flushed"]),
              default="flushed", show_default=True)
@click.option("--path", "write_path", type=click.Choice(["peer", "direct"]), default="peer",
              show_default=True)
@click.option("--quantile", type=click.FloatRange(0, 1, min_open=True, max_open=True),
              default=0.95, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def model_predict_command(cfg: configuration.Config, history: Any, model_path: Path | None,
                          size: str | None, nodes: int | None, level: str, write_path: str,
                          quantile: float, as_json: bool) -> None:
    """When a checkpoint of SIZE on NODES nodes reaches LEVEL (median and a quantile)."""
    from .model.summary import predict_json, predict_text
    model = _system(history, model_path)
    prediction = model.predict(level, write_path, *_size_and_nodes(model, size, nodes))
    if as_json:
        _echo_json(predict_json(prediction, quantile))
    else:
        click.echo(predict_text(prediction, quantile))


@model_group.command("plan")
@model_options
@_size_option
@click.option("--period", metavar="DURATION", help="checkpoint period (default: model.period,"
              " else the observed one)")
@click.option("--stall", metavar="DURATION", help="trainer blocking cost per checkpoint"
              " (default: the observed write time)")
@click.option("--every", type=click.IntRange(2), help="k of the path flushing every k-th")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def model_plan_command(cfg: configuration.Config, history: Any, model_path: Path | None,
                       size: str | None, nodes: int | None, period: str | None,
                       stall: str | None, every: int | None, as_json: bool) -> None:
    """Expected lost work per path, the recommended path and checkpoint period."""
    from .model.plan import Rates, make_plan
    from .model.protection import Protection
    from .model.summary import plan_json, plan_text
    model = _system(history, model_path)
    size_value, count = _size_and_nodes(model, size, nodes)
    every_t = _period(cfg, model, period)
    write = model.stages.get("write")
    blocking = (configuration.parse_duration(stall, "--stall") if stall
                else float(write.ppf(0.5 ** (1 / count), size_value / count, count))
                if write else 0.0)
    plan = make_plan(model, size_value, count, every_t, blocking, Rates.of(cfg.model), every,
                     cfg.flush.concurrency, Protection.of(cfg.peer, count))
    if as_json:
        _echo_json(plan_json(plan))
    else:
        click.echo(plan_text(plan))


@main_group.command("report")
@model_options
@_size_option
@click.option("--out", default="cachex-report", show_default=True,
              type=click.Path(file_okay=False, path_type=Path), help="directory for the PNGs")
def report_command(cfg: configuration.Config, history: Any, model_path: Path | None,
                   size: str | None, nodes: int | None, out: Path) -> None:
    """PNG figures: stage timeline, fitted distributions, P(durable by t) per level."""
    from .model.report import write_report
    model = _system(history, model_path)
    size_value, count = _size_and_nodes(model, size, nodes)
    makedirs(out)
    for written in write_report(history, model, out, size_value, count):
        click.echo(str(written))


@main_group.command("advise")
@model_options
@_size_option
@click.option("--period", metavar="DURATION", help="the save interval in use (default:"
              " model.period, else the observed one)")
@click.option("--record", type=click.Choice(["crash", "node", "job"]), help="first record"
              " one failure of this kind in the run's history (the job, at a relaunch)")
@click.option("--lost", type=click.IntRange(0), default=1, show_default=True,
              help="with --record node: how many nodes were lost")
@click.option("--drill", is_flag=True, help="with --record: a drill, kept out of the rates")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def advise_command(cfg: configuration.Config, history: Any, model_path: Path | None,
                   size: str | None, nodes: int | None, period: str | None, as_json: bool,
                   **options: Any) -> None:
    """The save interval that loses least time, what each level protects, the rates."""
    from .model.advise_run import run_advise
    model = _system(history, model_path)
    size_value, count = _size_and_nodes(model, size, nodes)
    text, data = run_advise(cfg, history, model, size_value, count,
                            _period(cfg, model, period), **options)
    _echo_json(data) if as_json else click.echo(text)


@main_group.command("demo")
@click.option("--workdir", default="demo-run", type=click.Path(file_okay=False),
              help="where the demo's spools, stage, cache and PFS live")
@click.option("--nodes", default=4, show_default=True, help="virtual nodes (agents)")
@click.option("--ranks-per-node", default=2, show_default=True)
@click.option("--steps", default=40, show_default=True)
@click.option("--every", default=5, show_default=True, help="checkpoint period in steps")
@click.option("--shard-size", default="8MiB", show_default=True)
def demo_command(**options: Any) -> None:
    """Train the example model beside 4 agents on this machine, then verify."""
    from .demo import run_demo
    run_demo(**options)


@main_group.group("job")
def job_group() -> None:
    """The job templates' side of the package: `run` takes the batch shell over
    (scripts/lib/cachex-job.sh); `state` and `withdraw-stop` are its own queries."""


job_group.add_command(job_run_command)     # the supervisor (cachex_agent/job/supervisor.py)


@job_group.command("state")
@config_options
def job_state_command(cfg: configuration.Config) -> None:
    """One line for the supervisor: STATE LIFE NEWEST LEVEL USABLE FLUSHED (`-` unknown)."""
    from .job.state import state_words
    from .status import load_status
    try:
        status = load_status(cfg, settle=True)
    except CachexError:
        status = {}
    click.echo(" ".join(state_words(status)))


@job_group.command("withdraw-stop")
@config_options
def job_withdraw_stop_command(cfg: configuration.Config) -> None:
    """Remove this run's stop requests (the PFS's and this node's journal's): one that no
    agent read, because they had died, would stop the next agents at once."""
    here = cfg.node_paths(0)
    for path in (pfs_stop_file(here.pfs), journal_stop_file(here.journal)):
        path.unlink(missing_ok=True)


@main_group.command("templates")
@click.argument("dest", type=click.Path(file_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="overwrite files that exist")
def templates_command(dest: Path, force: bool) -> None:
    """Write the Slurm and PBS job templates to DEST/slurm, DEST/pbs and DEST/lib."""
    from .shipped import shipped_root, write_templates
    for written in write_templates(dest, force):
        click.echo(str(written))
    for line in _templates_next(dest.resolve(), shipped_root()):
        click.echo(line)


def _templates_next(dest: Path, shipped: Path) -> list[str]:
    """The next commands. The templates source $CX_ROOT/scripts/lib/cachex-job.sh and run
    $CX_BIN/cachex-agent, and local.sbatch's trainer is $CX_ROOT/examples/trainer.py:
    the shipped root has both, DEST's parent has the lib when DEST is named scripts."""
    bin_dir = Path(sys.executable).parent
    root = (f"CX_ROOT={dest.parent}" if dest.name == "scripts" else
            f"CX_ROOT=<the directory holding scripts/lib/cachex-job.sh: {dest} must be"
            f" named scripts, or give {shipped}>")
    return [f"next: edit the values at the top of {dest}/slurm/<site>.sbatch (TRAIN_CMD:"
            f" your trainer), then {root} CX_BIN={bin_dir} sbatch"
            f" {dest}/slurm/<site>.sbatch (docs/jobs.md)",
            f"or try it on a one-host Slurm with the example trainer: CX_ROOT={shipped}"
            f" CX_BIN={bin_dir} sbatch {dest}/slurm/local.sbatch"]


def main() -> None:
    _run_guarded(lambda: _click_main(main_group))
