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
then the record of `--run NAME`, then `./cachex.toml`, then the one recorded run.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
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


def only_run() -> str | None:
    """The run name when exactly one is recorded; None when none is; ConfigError naming
    them when several are."""
    runs = known_runs()
    if len(runs) > 1:
        raise ConfigError(f"several runs are known ({', '.join(runs)}, in {runs_dir()}):"
                          " give --run NAME or --config FILE")
    return runs[0] if runs else None
