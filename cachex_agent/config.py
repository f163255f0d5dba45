"""One closed, typed configuration.

Precedence (lowest first): built-in defaults < `cachex.toml` (or `--config`, or
`$CACHEX_CONFIG`) < `CACHEX_<SECTION>_<KEY>` environment variables < `--set
section.key=value` flags. Unknown keys and bad values raise `ConfigError` naming the key.
The key names are a contract (DESIGN.md section 11): scripts and tests use them.
"""

from __future__ import annotations

import os
import re
import socket
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from .errors import ConfigError

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_DURATION_UNITS = {"": 1.0, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Any, key: str = "size") -> int:
    """`16MiB`, `1.5GB`, `4096` -> bytes."""
    return int(_parse_with_units(value, _SIZE_UNITS, key, "a size like 16MiB"))


def parse_duration(value: Any, key: str = "duration") -> float:
    """`2s`, `500ms`, `10min`, `1h`, `3` -> seconds."""
    return float(_parse_with_units(value, _DURATION_UNITS, key, "a duration like 2s"))


def _parse_with_units(value: Any, units: Mapping[str, float], key: str, what: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected {what}, got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        match = _NUMBER_UNIT.match(str(value))
        if not match:
            raise ConfigError(f"{key}: expected {what}, got {value!r}")
        number, unit = float(match.group(1)), match.group(2).lower()
    if unit not in units or number < 0:
        raise ConfigError(f"{key}: expected {what}, got {value!r}")
    return number * units[unit]


def _int(low: int) -> Callable[[Any, str], int]:
    def parse(value: Any, key: str) -> int:
        try:
            number = int(str(value), 10) if not isinstance(value, int) else value
        except ValueError:
            raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
        if isinstance(value, bool) or number < low:
            raise ConfigError(f"{key}: expected an integer >= {low}, got {value!r}")
        return number
    return parse


def _rate(value: Any, key: str) -> float:
    """Failures per hour: a plain number."""
    try:
        number = float(value) if not isinstance(value, bool) else -1.0
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected failures per hour (a number), got {value!r}") from None
    if not 0 <= number < 1e6:
        raise ConfigError(f"{key}: expected a rate >= 0 (failures per hour), got {value!r}")
    return number


def _choice(*options: str, prefixes: tuple[str, ...] = ()) -> Callable[[Any, str], str]:
    def parse(value: Any, key: str) -> str:
        text = str(value)
        if text in options or any(text.startswith(p) and len(text) > len(p) for p in prefixes):
            return text
        allowed = " | ".join(list(options) + [p + "<...>" for p in prefixes])
        raise ConfigError(f"{key}: expected one of {allowed}, got {value!r}")
    return parse


def _bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{key}: expected true or false, got {value!r}")


def _text(value: Any, key: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{key}: expected a non-empty string, got {value!r}")
    return value


def _names(value: Any, key: str) -> tuple[str, ...]:
    """A list of relative file names; a string is split on commas (environment, flags)."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(i, str) for i in items):
        raise ConfigError(f"{key}: expected a list of file names, got {value!r}")
    names = tuple(i.strip() for i in items if i.strip())
    if any(n.startswith("/") or ".." in n.split("/") for n in names):
        raise ConfigError(f"{key}: names must be relative to the checkpoint, got {value!r}")
    return names


def _size(value: Any, key: str) -> int:
    return parse_size(value, key)


def _buffer_size(value: Any, key: str) -> int:
    size = parse_size(value, key)
    if size < 4096:
        raise ConfigError(f"{key}: expected at least 4KiB, got {value!r}")
    return size


def _duration(value: Any, key: str) -> float:
    return parse_duration(value, key)


@dataclass(frozen=True)
class Paths:
    spool: str
    pfs: str
    stage: str = "/dev/shm/cachex-$USER"
    cache: str = "/tmp/cachex-$USER"


@dataclass(frozen=True)
class Topology:
    domain: str = "node"


@dataclass(frozen=True)
class Commit:
    rule: str = "auto"
    settle: float = 2.0
    timeout: float = 600.0      # how long an agent waits for its own files after a commit
    scan: float = 5.0           # polling rescan period (inotify is the fast path)
    mirror: bool = True         # mirror global metadata files to every node's spool
    globals: tuple[str, ...] = ()   # more coordinator-only files (DCP: "__0_0.distcp")


@dataclass(frozen=True)
class Peer:
    copies: int = 1
    stride: int = 1
    slot: int = 16 * 1024**2
    slots: int = 4


@dataclass(frozen=True)
class Flush:
    bandwidth: int = 0          # bytes/s per node, 0 = unlimited
    concurrency: int = 1
    every: int = 1
    chunk: int = 8 * 1024**2
    retry_max: float = 60.0     # cap of the exponential backoff between retries
    drain_timeout: float = 600.0
    verify: bool = True         # re-read the renamed bundle and compare checksums
    nice: int = 10


@dataclass(frozen=True)
class Keep:
    stage: int = 1
    replica: int = 2
    pfs: int = 0


@dataclass(frozen=True)
class Model:
    path: str = "auto"
    crash_rate: float = 0.05    # trainer crashes per hour (whole job)
    node_rate: float = 0.001    # node losses per node-hour
    job_rate: float = 0.01      # allocation losses per hour (preemption, system faults)
    period: float = 0.0         # checkpoint period for `model plan`; 0 = the observed one
    window: int = 32            # checkpoints the online path choice learns from
    explore: int = 16           # after this many direct checkpoints, one goes peer


@dataclass(frozen=True)
class Agent:
    poll: float = 0.02          # main loop tick
    timeout: float = 60.0       # bound on every wait for another agent
    log: str = "info"


_PARSERS: dict[str, dict[str, Callable[[Any, str], Any]]] = {
    "paths": {"spool": _text, "pfs": _text, "stage": _text, "cache": _text},
    "topology": {"domain": _choice("node", "rank", prefixes=("regex:", "file:"))},
    "commit": {
        "rule": _choice("auto", "dcp", "deepspeed", "megatron", "hf", "orbax", "torch",
                        "quiescence", prefixes=("marker:",)),
        "settle": _duration, "timeout": _duration, "scan": _duration, "mirror": _bool,
        "globals": _names,
    },
    "peer": {"copies": _int(1), "stride": _int(1), "slot": _buffer_size, "slots": _int(1)},
    "flush": {
        "bandwidth": _size, "concurrency": _int(1), "every": _int(1), "chunk": _buffer_size,
        "retry_max": _duration, "drain_timeout": _duration, "verify": _bool, "nice": _int(0),
    },
    "keep": {"stage": _int(0), "replica": _int(0), "pfs": _int(0)},
    "model": {"path": _choice("auto", "peer", "direct"), "crash_rate": _rate,
              "node_rate": _rate, "job_rate": _rate, "period": _duration,
              "window": _int(4), "explore": _int(0)},
    "agent": {"poll": _duration, "timeout": _duration,
              "log": _choice("debug", "info", "warning", "error")},
}
_SECTIONS = {"paths": Paths, "topology": Topology, "commit": Commit, "peer": Peer,
             "flush": Flush, "keep": Keep, "model": Model, "agent": Agent}
_RESERVED_ENV = {"CACHEX_CONFIG"}


@dataclass(frozen=True)
class Config:
    run: str
    paths: Paths
    topology: Topology = Topology()
    commit: Commit = Commit()
    peer: Peer = Peer()
    flush: Flush = Flush()
    keep: Keep = Keep()
    model: Model = Model()
    agent: Agent = Agent()
    source: str = ""            # the file it was read from, for messages

    def node_paths(self, node: int, rank: int | None = None, host: str | None = None
                   ) -> NodePaths:
        """The directories of one node, templates rendered."""
        values = {"node": str(node), "rank": str(node if rank is None else rank),
                  "host": host or socket.gethostname(), "run": self.run, "job": job_id()}
        rendered = {name: render(getattr(self.paths, name), values, f"paths.{name}")
                    for name in ("spool", "stage", "cache", "pfs")}
        return NodePaths(
            spool=Path(rendered["spool"]),
            stage=Path(rendered["stage"]) / self.run,
            cache=Path(rendered["cache"]) / self.run,
            pfs=Path(rendered["pfs"]) / self.run,
        )


@dataclass(frozen=True)
class NodePaths:
    """Where one node's data lives. `stage`, `cache` and `pfs` are already per run."""

    spool: Path
    stage: Path
    cache: Path
    pfs: Path

    @property
    def journal(self) -> Path:
        return self.cache / "journal"

    @property
    def replicas(self) -> Path:
        return self.cache / "replicas"


def job_id() -> str:
    for name in ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID"):
        if os.environ.get(name):
            return os.environ[name]
    return "local"


def render(template: str, values: Mapping[str, str], key: str) -> str:
    """`{node}`-style fields, then `$VARS` and `~`."""
    def field(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in values:
            raise ConfigError(f"{key}: unknown template field {{{name}}} in {template!r}"
                              f" (known: {', '.join('{' + v + '}' for v in values)})")
        return values[name]
    text = re.sub(r"\{([^{}]*)\}", field, template)
    return os.path.expanduser(os.path.expandvars(text))


def load(path: str | os.PathLike[str] | None = None, overrides: Mapping[str, Any] = (),
         environ: Mapping[str, str] | None = None) -> Config:
    """Build the configuration from file, environment and `section.key` overrides."""
    environ = os.environ if environ is None else environ
    path = path or environ.get("CACHEX_CONFIG")
    raw = _read_toml(Path(path)) if path else {}
    merged = _flatten(raw, source=str(path or "defaults"))
    merged.update(_from_environ(environ))
    for key, value in dict(overrides).items():
        merged[_check_key(key, "--set")] = value
    return _build(merged, str(path or ""), environ)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"{path}: configuration file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None


def _flatten(raw: Mapping[str, Any], source: str) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for name, value in raw.items():
        if name == "run":
            flat["run"] = value
        elif name in _PARSERS and isinstance(value, Mapping):
            for key, item in value.items():
                flat[_check_key(f"{name}.{key}", source)] = item
        else:
            flat[_check_key(name, source)] = value
    return flat


def _check_key(key: str, source: str) -> str:
    section, _, name = key.partition(".")
    if key == "run" or (section in _PARSERS and name in _PARSERS[section]):
        return key
    raise ConfigError(f"{key}: unknown configuration key (in {source})")


def _from_environ(environ: Mapping[str, str]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for var, value in environ.items():
        if not var.startswith("CACHEX_") or var in _RESERVED_ENV:
            continue
        rest = var[len("CACHEX_"):].lower()
        if rest == "run":
            found["run"] = value
            continue
        section = next((s for s in _PARSERS if rest.startswith(s + "_")), None)
        if section is None:
            continue        # not ours (a job script's CACHEX_ROOT); CACHEX_FLUSH_X still fails
        found[_check_key(f"{section}.{rest[len(section) + 1:]}", var)] = value
    return found


def _build(flat: Mapping[str, Any], source: str, environ: Mapping[str, str]) -> Config:
    sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    for key, value in flat.items():
        if key == "run":
            continue
        section, name = key.split(".", 1)
        sections[section][name] = _PARSERS[section][name](value, key)
    for required in ("spool", "pfs"):
        if required not in sections["paths"]:
            raise ConfigError(f"paths.{required}: required (set it in the configuration file,"
                              f" CACHEX_PATHS_{required.upper()} or --set paths.{required}=...)")
    run = flat.get("run") or environ.get("SLURM_JOB_NAME") or "cachex"
    run = _text(run, "run")
    if "/" in run or run in (".", ".."):
        raise ConfigError(f"run: must be a plain name without '/', got {run!r}")
    built = {name: cls(**sections[name]) for name, cls in _SECTIONS.items()}
    return Config(run=run, source=source, **built)


def as_dict(config: Config) -> dict[str, Any]:
    """The configuration as TOML-shaped data (for logs and the journal)."""
    out: dict[str, Any] = {"run": config.run}
    for name in _SECTIONS:
        section = getattr(config, name)
        out[name] = {f.name: getattr(section, f.name) for f in fields(section)}
    return out
