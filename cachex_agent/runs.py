"""Where each run's configuration is, so that `cachex ls`, `status`, `recover`, `index`...
work without `--config` after the job started its agents.

Rank 0 of the agents records the settings it was built from (file, CACHEX_* variables,
--set) in a per-user state directory, one file per run name:

    $XDG_STATE_HOME/cachex/runs/<run>.json     (default ~/.local/state/cachex/runs/)
    {"format": "cachex-run", "version": 1, "run", "config": <file or null>, "job",
     "host", "written", "settings": {"section.key": value}}

Path templates are recorded with `{job}`, `{run}`, `$VARS` and `~` already rendered (a
login node has neither the job's id nor its environment); `{node}`, `{rank}` and `{host}`
stay templates. A command finds its configuration: `--config` (or $CACHEX_CONFIG) first,
then the record of `--run NAME`, then `./cachex.toml`, then the one recorded run (of
several, the one whose configuration lies under the current directory). `cachex runs`
lists the records; `--prune` removes those whose configuration and PFS run directory are
both gone.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import Config, from_settings, job_id
from .errors import ConfigError
from .fsutil import makedirs, read_json, write_json
from .safepath import UnsafeInput, component

FORMAT = "cachex-run"
VERSION = 1
RENDERED_NOW = ("job", "run")       # known only where the agents run


def runs_dir(environ: Any = None) -> Path:
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "cachex" / "runs"


def record_path(run: str) -> Path:
    return runs_dir() / f"{run}.json"


def record(config: Config, flat: dict[str, Any]) -> Path:
    """Write (durably, replacing an older one) where `config.run`'s configuration is."""
    values = {"job": job_id(), "run": config.run}
    rendered = {key: _render_known(value, values) if key.startswith("paths.") else value
                for key, value in flat.items()}
    path = record_path(config.run)
    makedirs(path.parent)
    source = os.path.abspath(config.source) if config.source else None
    write_json(path, {"format": FORMAT, "version": VERSION, "run": config.run,
                      "config": source, "job": values["job"],
                      "host": socket.gethostname(), "written": time.time(),
                      "settings": rendered})
    return path


def _render_known(value: Any, values: dict[str, str]) -> Any:
    if not isinstance(value, str):
        return value
    text = re.sub(r"\{(job|run)\}", lambda m: values[m.group(1)], value)
    return os.path.expanduser(os.path.expandvars(text))


def known_runs() -> list[str]:
    directory = runs_dir()
    return sorted(p.stem for p in directory.glob("*.json")) if directory.is_dir() else []


@dataclass(frozen=True)
class Known:
    """One run record as `cachex runs` shows it."""

    run: str
    written: float | None       # when the agents recorded it (their clock, shown only)
    config: str | None          # the configuration file it was built from
    config_exists: bool
    pfs: str | None             # the run's directory on the PFS (paths.pfs/<run>)
    pfs_exists: bool
    job: str | None
    problem: str | None = None  # an unreadable record: why

    @property
    def gone(self) -> bool:
        """Neither its configuration nor its PFS run directory is left: nothing to ask."""
        return self.problem is None and not self.config_exists and not self.pfs_exists


def records() -> list[Known]:
    """Every run record, newest first by the time each says it was written (unreadable
    ones last, with the reason). Those times come from the hosts that ran the agents:
    the order is for a person to read, and decides nothing."""
    found = [_known(run) for run in known_runs()]
    return sorted(found, key=lambda k: -(k.written or 0))


def _known(run: str) -> Known:
    path = record_path(run)
    try:
        data = read_json(path)
        config = load_recorded(run, {})
        if config is None:
            raise FileNotFoundError(f"{path}: removed while read")
        source = data.get("config") if isinstance(data.get("config"), str) else None
        pfs = config.node_paths(0).pfs
        # a PFS whose root is not there (not mounted on this host) says nothing of the run
        pfs_exists = pfs.is_dir() or not pfs.parent.is_dir()
        config_exists = bool(source) and os.path.isfile(source)
    except (OSError, json.JSONDecodeError, ConfigError) as exc:    # EACCES, ESTALE too
        return Known(run, None, None, False, None, False, None, problem=str(exc))
    written = data.get("written")
    return Known(run, written if isinstance(written, (int, float)) else None, source,
                 config_exists, str(pfs), pfs_exists,
                 str(data.get("job")) if data.get("job") is not None else None)


def prune() -> list[str]:
    """Remove the records whose configuration and PFS run directory are both gone (a
    PFS root that is not there at all counts as present: unmounted here, not gone)."""
    gone = [k.run for k in records() if k.gone]
    for run in gone:
        record_path(run).unlink(missing_ok=True)
    return gone


def run_here(cwd: Path, known: list[Known]) -> str | None:
    """The one run of `known` whose configuration file lies in `cwd` or below it (a
    command run from a job's directory means that job's run); None when none or
    several do."""
    here = [k.run for k in known if k.config_exists and k.config
            and Path(k.config).resolve().is_relative_to(cwd.resolve())]
    return here[0] if len(here) == 1 else None


def load_recorded(run: str, overrides: dict[str, Any]) -> Config | None:
    """The configuration recorded for `run` with `overrides` on top; None: no record."""
    try:
        component(run, "--run", "run name")
    except UnsafeInput as exc:
        raise ConfigError(str(exc)) from None
    path = record_path(run)
    try:
        data = read_json(path)
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: unreadable run record ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(
            data.get("settings"), dict):
        raise ConfigError(f"{path}: not a {FORMAT} record")
    return from_settings({**data["settings"], **overrides, "run": run}, str(path))


def only_run(cwd: Path | None = None) -> str | None:
    """The run name when exactly one is recorded, or when one of several has its
    configuration under `cwd`; None when none is; ConfigError naming the newest three
    when several are."""
    runs = known_runs()
    if len(runs) <= 1:
        return runs[0] if runs else None
    known = records()
    here = run_here(cwd or Path.cwd(), known)
    if here is not None:
        return here
    newest = ", ".join(k.run for k in known[:3])
    raise ConfigError(f"{len(runs)} runs are known (newest: {newest}): give --run NAME or"
                      " --config FILE; 'cachex runs' lists them")
