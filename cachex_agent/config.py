"""One closed, typed configuration.

Precedence (lowest first): built-in defaults < `cachex.toml` (or `--config`, or
`$CACHEX_CONFIG`) < `CACHEX_<SECTION>_<KEY>` environment variables < `--set
section.key=value` flags. Unknown keys and bad values raise `ConfigError` naming the key.
The key names are a contract: scripts and tests use them. Each key is declared once, as
a field of its section's dataclass (`key`: default, parser with its type and range,
meaning); the parsers, the meanings and the reference are read from those fields.

Every number has a finite range (docs/configuration.md, generated from `reference()` by
`python -m cachex_agent.config_doc`): a value past it is a typo or
an overflow, and is refused here, before the agent starts MPI, rather than crashing a
thread or an allocation later. `check_paths` refuses overlapping directories and
`check_memory` an agent whose up-front buffers do not fit in the node's memory.
"""

from __future__ import annotations

import math
import os
import re
import socket
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

import psutil

from .errors import ConfigError
from .layout import NodePaths
from .rules.registry import MARKER, RULE_MEANING, RULE_NAMES, SETTLED

KiB, MiB, GiB, TiB = 1024, 1024**2, 1024**3, 1024**4
MAX_BUFFER = GiB            # peer.slot, flush.chunk: past 1GiB nothing gets faster, memory goes
MAX_BANDWIDTH = TiB         # per node per second: beyond any network or file system
MAX_DURATION = 720 * 3600.0     # 30 days: longer than any job
MAX_COUNT = 1_000_000
MEMORY_RESERVE = GiB        # what the agent's up-front buffers must leave to the trainer and OS

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
        raise ConfigError(f"{key}: expected {what}, got {_shown(value)}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        match = _NUMBER_UNIT.match(str(value))
        if not match:
            raise ConfigError(f"{key}: expected {what}, got {_shown(value)}")
        number, unit = float(match.group(1)), match.group(2).lower()
    if unit not in units or number < 0:
        raise ConfigError(f"{key}: expected {what}, got {_shown(value)}")
    # float() of 400 digits is inf, and nan passes `< 0`: neither is a size or a duration
    if not math.isfinite(number * units[unit]):
        raise ConfigError(f"{key}: expected {what}, got {_shown(value)} (not a finite number)")
    return number * units[unit]


def _shown(value: Any, limit: int = 40) -> str:
    """`repr(value)`, shortened: a message stays one readable line whatever was given."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(str(value))} characters)"


def _check_range(number: float, low: float, high: float, key: str, value: Any,
                 show: Callable[[float], str]) -> None:
    if not low <= number <= high:
        raise ConfigError(f"{key}: expected {show(low)} to {show(high)}, got {_shown(value)}")


_UNITS = (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB))


def _format_size(size: float) -> str:
    """4KiB, 1GiB (exact: how the limits are written), else 2.3TiB, else 3000."""
    for name, unit in _UNITS:
        if size and size % unit == 0:
            return f"{int(size // unit)}{name}"
    return _approximate_size(size)


def _approximate_size(size: float) -> str:
    """2.3TiB: a reading that moves (free memory) shows alike on every agent."""
    for name, unit in _UNITS:
        if size >= unit:
            return f"{size / unit:.1f}{name}"
    return f"{size:g}"


def _format_duration(seconds: float) -> str:
    if seconds and seconds % 3600 == 0:
        return f"{seconds / 3600:g}h"
    return f"{seconds * 1000:g}ms" if 0 < seconds < 1 else f"{seconds:g}s"


@dataclass(frozen=True)
class Parser:
    """A key's parser, with what the reference says of its values (type and range)."""
    parse: Callable[[Any, str], Any]
    kind: str
    limits: str = ""

    def __call__(self, value: Any, key: str) -> Any:
        return self.parse(value, key)


def _int(low: int, high: int = MAX_COUNT) -> Parser:
    def parse(value: Any, key: str) -> int:
        try:
            number = int(str(value), 10) if not isinstance(value, int) else value
        except ValueError:      # also a string of more digits than int() converts
            raise ConfigError(f"{key}: expected an integer, got {_shown(value)}") from None
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {_shown(value)}")
        _check_range(number, low, high, key, value, str)
        return number
    return Parser(parse, "integer", f"{low} to {high}")


def _parse_rate(value: Any, key: str) -> float:
    """Failures per hour: a plain number."""
    try:
        number = float(value) if not isinstance(value, bool) else -1.0
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{key}: expected failures per hour (a number), got {_shown(value)}"
                          ) from None
    if not 0 <= number < 1e6:       # also refuses nan
        raise ConfigError(f"{key}: expected a rate from 0 to 1e6 failures per hour,"
                          f" got {_shown(value)}")
    return number


_rate = Parser(_parse_rate, "failures per hour", "0 to 1e6, exclusive")


def _choice(*options: str, prefixes: tuple[str, ...] = ()) -> Parser:
    allowed = " | ".join(list(options) + [p + "<...>" for p in prefixes])

    def parse(value: Any, key: str) -> str:
        text = str(value)
        if text in options or any(text.startswith(p) and len(text) > len(p) for p in prefixes):
            return text
        raise ConfigError(f"{key}: expected one of {allowed}, got {_shown(value)}")
    return Parser(parse, "choice", allowed)


def _parse_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{key}: expected true or false, got {_shown(value)}")


def _parse_text(value: Any, key: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{key}: expected a non-empty string, got {_shown(value)}")
    return value


def _parse_names(value: Any, key: str) -> tuple[str, ...]:
    """A list of relative file names; a string is split on commas (environment, flags)."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(i, str) for i in items):
        raise ConfigError(f"{key}: expected a list of file names, got {_shown(value)}")
    names = tuple(i.strip() for i in items if i.strip())
    if any(n.startswith("/") or ".." in n.split("/") for n in names):
        raise ConfigError(f"{key}: names must be relative to the checkpoint, got {_shown(value)}")
    return names


def _parse_hosts(value: Any, key: str) -> tuple[str, ...]:
    """Host names; a string is split on commas and blanks (environment, flags)."""
    items = value.replace(",", " ").split() if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(i, str) for i in items):
        raise ConfigError(f"{key}: expected a list of host names, got {_shown(value)}")
    hosts = tuple(i.strip() for i in items if i.strip())
    if any(any(c.isspace() or c in "/," for c in h) for h in hosts):
        raise ConfigError(f"{key}: expected host names, got {_shown(value)}")
    return hosts


def _parse_prom(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected a file path, got {_shown(value)}")
    if value and not value.endswith(".prom"):
        raise ConfigError(f"{key}: must end in .prom (node_exporter's textfile collector"
                          f" reads only those), got {_shown(value)}")
    return value


def parse_cpus(value: Any, key: str) -> tuple[int, ...]:
    """A CPU list as Linux writes it ("0-3,8"); empty: the job step's binding."""
    if isinstance(value, list | tuple) and all(type(c) is int for c in value):
        value = ",".join(map(str, value))       # a TOML list of CPU numbers
    text = str(value).replace(" ", "") if isinstance(value, str) else None
    if text is None or not re.fullmatch(r"(\d{1,5}(-\d{1,5})?(,\d{1,5}(-\d{1,5})?)*)?", text):
        raise ConfigError(f"{key}: expected a CPU list such as 0-3,8, got {_shown(value)}")
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        low, _, high = part.partition("-")
        if high and int(high) < int(low):
            raise ConfigError(f"{key}: {part} runs backwards")
        cpus.update(range(int(low), int(high or low) + 1))
    return tuple(sorted(cpus))


_bool = Parser(_parse_bool, "boolean", "true | false")
_cpus = Parser(parse_cpus, "CPU list", "empty (the job step's binding) or like `0-3,8`")
_prom = Parser(_parse_prom, "file path", "empty (off) or ending in `.prom`")
_text = Parser(_parse_text, "string", "not empty")
_hosts = Parser(_parse_hosts, "list of host names", "a string is split on commas and blanks")
_names = Parser(_parse_names, "list of file names",
                "relative to the checkpoint, no `..`; a string is split on commas")


def _size(low: int, high: int) -> Parser:
    def parse(value: Any, key: str) -> int:
        size = parse_size(value, key)
        _check_range(size, low, high, key, value, _format_size)
        return size
    return Parser(parse, "size", f"{_format_size(low)} to {_format_size(high)}")


def _duration(low: float = 0.0, high: float = MAX_DURATION) -> Parser:
    def parse(value: Any, key: str) -> float:
        seconds = parse_duration(value, key)
        _check_range(seconds, low, high, key, value, _format_duration)
        return seconds
    return Parser(parse, "duration", f"{_format_duration(low)} to {_format_duration(high)}")


_buffer_size = _size(4 * KiB, MAX_BUFFER)
MAX_GROUP = 256             # zfec's limit on the symbols of one Reed-Solomon codeword
_RS = re.compile(r"^rs:([0-9]{1,3})\+([0-9]{1,3})$")


def _parse_scheme(value: Any, key: str) -> str:
    text = str(value).strip()
    match = _RS.match(text)
    if text in ("copy", "xor") or (match and int(match.group(1)) >= 1
                                   and int(match.group(2)) >= 1
                                   and int(match.group(1)) + int(match.group(2)) <= MAX_GROUP):
        return text
    raise ConfigError(f"{key}: expected copy | xor | rs:K+M (K, M >= 1, K+M <= {MAX_GROUP}),"
                      f" got {_shown(value)}")


_scheme = Parser(_parse_scheme, "choice", f"copy | xor | rs:K+M (K+M <= {MAX_GROUP})")


def scheme_shape(scheme: str, group: int) -> tuple[int, int] | None:
    """(K, M) of `peer.scheme` over groups of `group` nodes; None for `copy`."""
    if scheme == "copy":
        return None
    if scheme == "xor":
        return group - 1, 1
    k, m = (int(n) for n in scheme[3:].split("+"))
    return k, m


def check_scheme(peer: Peer) -> None:
    """`rs:K+M` spreads each codeword over K+M nodes: the group must be that size."""
    shape = scheme_shape(peer.scheme, peer.group)
    if shape is not None and peer.scheme != "xor" and sum(shape) != peer.group:
        raise ConfigError(f"peer.group: {peer.scheme} needs groups of {sum(shape)} nodes"
                          f" (K+M), got {peer.group}")


def key(default: Any, parse: Parser, meaning: str) -> Any:
    """A configuration key, declared once: its default (MISSING: required), its parser
    (type and range: the checks) and its meaning. The parsers by section, the meanings
    and docs/configuration.md are all read from these declarations."""
    extra = {} if default is MISSING else {"default": default}
    return field(**extra, metadata={"parse": parse, "meaning": meaning})


@dataclass(frozen=True)
class Paths:
    spool: str = key(MISSING, _text,
                     "The trainer's checkpoint directory on this node, the one the agent watches."
                     " Created if its parent exists.")
    pfs: str = key(MISSING, _text,
                   "The parallel file system's directory for cachex. Must exist; `<pfs>/<run>/`"
                   " is created.")
    stage: str = key("/dev/shm/cachex-$USER", _text,
                     "Local memory (tmpfs), owned by the agent: the captured copies.")
    cache: str = key("/tmp/cachex-$USER", _text,
                     "Node-local disk (NVMe), owned by the agent: the journal, events and the"
                     " replicas kept for partners.")


@dataclass(frozen=True)
class Topology:
    domain: str = key("node", _choice("node", "rank", prefixes=("regex:", "file:")),
                      "Failure domains, so that partners sit in another one: `node` (one agent"
                      " per host name), `rank` (every agent its own node: tests on one machine),"
                      " `regex:<re>` (the domain is the first match of <re> in the host name, or"
                      " its first group), `file:<path>` (lines `host domain`, `#` comments; every"
                      " host must be listed).")
    exclude: tuple[str, ...] = key((), _hosts,
                                   "Nodes never to use (host names, as `hostname` prints them):"
                                   " an agent started on one refuses, and the job templates leave"
                                   " them out of the node set (`EXCLUDE_NODES`).")
    min_nodes: int = key(0, _int(0),
                         "The fewest nodes to go on with: agents started on fewer refuse (exit"
                         " 2); the job templates start on fewer nodes than `NODES` when some are"
                         " excluded or missing, down to this many (`MIN_NODES`). 0: no minimum.")


@dataclass(frozen=True)
class Commit:
    rule: str = key("auto", _choice(*RULE_NAMES, prefixes=(MARKER,)), RULE_MEANING)
    settle: float = key(2.0, _duration(),
                        "How long a node's files must stay unchanged before they are captured"
                        f" when the rule's marker does not vouch for every node ({SETTLED});"
                        " also how long a capture waits for a tracker written just after the"
                        " save that committed it (Megatron-LM's, after `metadata.json`).")
    timeout: float = key(600.0, _duration(1.0),
                         "How long every node may take to capture its part after a commit (its"
                         " directory may appear late); past it the checkpoint fails.")
    scan: float = key(5.0, _duration(1e-3),
                      "Period of the polling rescan of the spool; inotify is the fast path.")
    mirror: bool = key(True, _bool,
                       "Put the global files (written by one node only, e.g. DCP's `.metadata`)"
                       " into every node's spool once every node captured.")
    globals: tuple[str, ...] = key((), _names,
                                   "More files that only one node writes and every rank reads,"
                                   " e.g. `[\"__0_0.distcp\"]` for DCP saved with"
                                   " `dedup_save_to_lowest_rank=True`.")


@dataclass(frozen=True)
class Staging:
    capture: str = key("auto", _choice("auto", "link", "copy"),
                       "How a node's part goes from the spool into the stage: `auto` hard-links"
                       " the files of a framework that writes every save into new files (`dcp`,"
                       " `deepspeed`, `megatron`, `hf`, `orbax`) when spool and stage share a"
                       " file system, and copies the others; `link` hard-links every file it can"
                       " (trackers excepted); `copy` always copies. A linked file is the"
                       " trainer's own: one rewritten in place later fails its checksum and is"
                       " never served (docs/levels.md).")
    lease: bool = key(True, _bool,
                      "Hash and send a linked file from a mapping of it, held under a read lease"
                      " (no copy into a buffer): a trainer's later write or truncate of it waits"
                      " until the agent lets go, at most the time of one piece. Off, or where"
                      " the kernel or file system refuses leases, the file is read.")


@dataclass(frozen=True)
class Peer:
    copies: int = key(1, _int(1, 64), "Partners per node, each in a different failure domain.")
    stride: int = key(1, _int(1),
                      "The partners of node i are i+stride, i+2*stride, ... on the ring of nodes,"
                      " skipping the node's own failure domain.")
    slot: int = key(16 * 1024**2, _buffer_size,
                    "Size of one RMA slot. Each owner replicating to a partner has `peer.slots`"
                    " slots in the partner's window.")
    slots: int = key(4, _int(1, 1024),
                     "Slots per owner in each partner's window: transfers in flight.")
    streams: int = key(0, _int(0, 16),
                       "Files of one part in flight to each partner at once (their slots"
                       " interleaved), and the partner's threads writing them, one file per"
                       " thread. 0: one per two CPUs the agent is given (`agent.cpus`), at most"
                       " 4. A part streamed while its capture hashes it goes one file at a time"
                       " whatever this says: the capture reads them in turn.")
    scheme: str = key("copy", _scheme,
                      "Redundancy of the node-local copies: `copy` (a full copy on each of"
                      " `peer.copies` partners), `xor` (one parity over each group of"
                      " `peer.group` nodes: survives one lost node per group), `rs:K+M`"
                      " (Reed-Solomon, M parities over groups of K+M nodes: survives M lost nodes"
                      " per group; needs MPI_THREAD_MULTIPLE). See docs/redundancy.md.")
    group: int = key(4, _int(2, MAX_GROUP),
                     "Nodes per erasure group, each in a different failure domain (`xor`: any"
                     " size, K = group-1; `rs:K+M`: must be K+M). Ignored by `copy`.")


@dataclass(frozen=True)
class Flush:
    bandwidth: int = key(0, _size(0, MAX_BANDWIDTH),
                         "Bytes per second per node written to the PFS, enforced by a token"
                         " bucket; 0 is unlimited.")
    concurrency: int = key(1, _int(1, 64),
                           "Bundles in flight per node, each of another checkpoint.")
    writers: int = key(1, _int(1, 64),
                       "Threads copying files into one bundle at once, a `flush.chunk` buffer"
                       " each.")
    every: int = key(1, _int(1),
                     "Flush every k-th checkpoint. The newest is always flushed at the drain, and"
                     " a direct-path checkpoint always.")
    chunk: int = key(8 * 1024**2, _buffer_size,
                     "I/O size of capture and flush, and the verify's window.")
    retry_max: float = key(60.0, _duration(),
                           "Cap of the jittered exponential backoff between flush retries.")
    drain_timeout: float = key(600.0, _duration(),
                               "How long `cachex stop` or SIGTERM waits for pending flushes.")
    verify: bool = key(True, _bool,
                       "Re-read each renamed bundle and compare checksums before reporting it"
                       " flushed.")
    nice: int = key(10, _int(0, 19),
                    "CPU nice value of the flush threads (their I/O runs best-effort at the"
                    " lowest priority).")


@dataclass(frozen=True)
class Keep:
    stage: int = key(1, _int(0),
                     "Captured checkpoints kept in the stage; one whose replication or flush is"
                     " pending is never evicted. 0 keeps all.")
    replica: int = key(2, _int(0), "Replicas kept per owner on each partner. 0 keeps all.")
    pfs: int = key(0, _int(0),
                   "Flushed checkpoints kept on the PFS; older ones are purged. 0 keeps all.")


@dataclass(frozen=True)
class Model:
    path: str = key("auto", _choice("auto", "peer", "direct"),
                    "The write path: `peer` (replicate to the partners, and flush beside it),"
                    " `direct` (flush right after capture, no replica), `auto` (per checkpoint,"
                    " the path the model expects to lose less work).")
    crash_rate: float = key(0.05, _rate, "Trainer crashes per hour, for the whole job.")
    node_rate: float = key(0.001, _rate,
                           "Node losses per node-hour; with the checkpoint period it gives the"
                           " chance that a group loses more than `peer.scheme` rebuilds"
                           " (docs/model.md).")
    job_rate: float = key(0.01, _rate, "Allocation losses per hour (preemption, system faults).")
    period: float = key(0.0, _duration(),
                        "Checkpoint period for `cachex model plan`; 0 takes the observed one.")
    window: int = key(32, _int(4), "Checkpoints the online path choice learns from.")
    explore: int = key(16, _int(0),
                       "After this many direct checkpoints in a row, one goes by the peer path to"
                       " refresh the replication estimate.")


@dataclass(frozen=True)
class Metrics:
    path: str = key("", _prom,
                    "A Prometheus text-format file the coordinator rewrites (node_exporter's"
                    " textfile collector: point its `--collector.textfile.directory` here);"
                    " `{run}`, `{host}`, `{job}` and `$VARS` are filled in. Written 0644: the"
                    " collector may run as another user. Empty: none. docs/commands.md lists the"
                    " metrics.")
    period: float = key(15.0, _duration(1.0),
                        "How often the metrics file is rewritten (at the next status write after"
                        " it).")


@dataclass(frozen=True)
class Agent:
    poll: float = key(0.02, _duration(1e-3), "Main loop tick; 100ms after 2s with nothing to do.")
    timeout: float = key(60.0, _duration(1.0),
                         "Bound on every wait for another agent (credits, collectives, recovery"
                         " transfers). A node silent this long, by the clock of whoever waited"
                         " net of its own stalls, is suspect: routed around and named in"
                         " status, taken back when it speaks (docs/levels.md, slow versus"
                         " dead).")
    dead_after: float = key(300.0, _duration(1.0),
                            "A suspect node still silent this long is taken for dead: its"
                            " partners stop waiting and send it nothing more in this run. At"
                            " least `agent.timeout`. 5 min, as Slurm's default SlurmdTimeout"
                            " before it marks a node DOWN: longer than a Lustre client's"
                            " reconnect (obd_timeout 100 s) or a swap storm, so a stalled"
                            " node is waited for and a lost one still let go.")
    log: str = key("info", _choice("debug", "info", "warning", "error"), "Log level.")
    fanout: int = key(16, _int(2, 1024),
                      "Children per agent in the tree that carries the coordinator's messages to"
                      " every agent: each message is serialized once and forwarded, never sent N"
                      " times by one thread (docs/architecture.md).")
    nice: int = key(0, _int(0, 19),
                    "CPU nice value of every agent thread, set at start-up (the flush threads run"
                    " at the larger of this and `flush.nice`).")
    sched: str = key("other", _choice("other", "batch", "idle"),
                     "Scheduling policy of every agent thread: `other` (the default), `batch` (no"
                     " wake-up preemption of the trainer), `idle` (only CPU nothing else wants)."
                     " See docs/benchmarks.md for what each costs partner-durable.")
    cpus: tuple[int, ...] = key((), _cpus,
                                "CPUs every agent thread runs on, a subset of the job step's"
                                " binding (`srun --cpu-bind`, a cgroup's cpuset): empty keeps the"
                                " binding. The agent sizes its threads (`peer.streams` = 0) from"
                                " this set, and refuses to start if a CPU named here is not in"
                                " the binding.")


_SECTIONS = {"paths": Paths, "topology": Topology, "commit": Commit, "stage": Staging,
             "peer": Peer, "flush": Flush, "keep": Keep, "model": Model, "agent": Agent,
             "metrics": Metrics}
_PARSERS: dict[str, dict[str, Parser]] = {
    name: {f.name: f.metadata["parse"] for f in fields(cls)} for name, cls in _SECTIONS.items()}
_RESERVED_ENV = {"CACHEX_CONFIG"}

# What each key means (from its declaration): docs/configuration.md is generated from these
# (`python -m cachex_agent.config_doc`) and a unit test keeps the file equal to the output.
MEANINGS: dict[str, str] = {
    "run": "The run's name. Checkpoints of a run survive relaunches and later jobs: every"
           " directory of the run is `<root>/<run>`.",
    **{f"{name}.{f.name}": f.metadata["meaning"]
       for name, cls in _SECTIONS.items() for f in fields(cls)}}


@dataclass(frozen=True)
class KeyReference:
    """One configuration key as the reference shows it."""
    key: str
    kind: str
    default: str
    limits: str
    meaning: str


def reference() -> list[KeyReference]:
    """Every key, in the order of the sections, with its type, default, range and meaning."""
    rows = [KeyReference("run", "string", "`$SLURM_JOB_NAME`, else `cachex`",
                         "a plain name without `/`", MEANINGS["run"])]
    for section, cls in _SECTIONS.items():
        for declared in fields(cls):
            name, parser = f"{section}.{declared.name}", _PARSERS[section][declared.name]
            rows.append(KeyReference(name, parser.kind, _shown_default(declared, parser),
                                     parser.limits, MEANINGS[name]))
    return rows


def _shown_default(field: Any, parser: Parser) -> str:
    if field.default is MISSING:
        return "required"
    value = field.default
    if parser.kind == "size":
        return f"`{_format_size(value) if value else 0}`"
    if parser.kind == "duration":
        minutes = value / 60
        shown = (f"{minutes:g}min" if value >= 60 and minutes.is_integer() and value < 3600
                 else _format_duration(value) if value else "0")
        return f"`{shown}`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, tuple):
        return "`[]`" if not value else f"`{list(value)}`"
    return f'`"{value}"`' if isinstance(value, str) else f"`{value}`"


@dataclass(frozen=True)
class Config:
    run: str
    paths: Paths
    topology: Topology = Topology()
    commit: Commit = Commit()
    stage: Staging = Staging()
    peer: Peer = Peer()
    flush: Flush = Flush()
    keep: Keep = Keep()
    model: Model = Model()
    agent: Agent = Agent()
    metrics: Metrics = Metrics()
    source: str = ""            # the file it was read from, for messages

    def node_paths(self, node: int, rank: int | None = None, host: str | None = None
                   ) -> NodePaths:
        """The directories of one node, templates rendered."""
        values = {"node": str(node), "rank": str(node if rank is None else rank),
                  "host": host or socket.gethostname(), "run": self.run, "job": job_id()}
        spool, stage, cache, pfs = (Path(render(getattr(self.paths, name), values,
                                                f"paths.{name}"))
                                    for name in ("spool", "stage", "cache", "pfs"))
        return NodePaths.of_run(spool, stage, cache, pfs, self.run)


def check_paths(paths: NodePaths) -> None:
    """Spool, stage, cache and PFS run directory of one node: no two the same, none inside
    another (symlinks and `..` resolved). Overlap would make the watcher capture the
    agent's own files, or an eviction or recovery remove the trainer's or the PFS's."""
    dirs = [("paths.spool", paths.spool), ("paths.stage", paths.stage),
            ("paths.cache", paths.cache), ("paths.pfs", paths.pfs)]
    real = [(key, Path(os.path.realpath(path)), path) for key, path in dirs]
    for index, (key_a, real_a, path_a) in enumerate(real):
        for key_b, real_b, path_b in real[index + 1:]:
            if real_a == real_b:
                relation = "is the same directory as"
            elif real_a.is_relative_to(real_b):
                relation = "is inside"
            elif real_b.is_relative_to(real_a):
                key_a, path_a, key_b, path_b = key_b, path_b, key_a, path_a
                relation = "is inside"
            else:
                continue
            raise ConfigError(f"{key_a} and {key_b} overlap: {path_a} {relation} {path_b};"
                              " give each its own directory")


def upfront_memory(config: Config) -> int:
    """Bytes one agent allocates at start and keeps: its receive window (one region per
    owner replicating to it, `peer.copies` on the ring), send buffer and feed (two slots,
    one partner), unless the run is flush-only, and one `flush.chunk` buffer per bundle
    writer (`flush.writers` for each of the `flush.concurrency` bundles in flight) and for
    capture."""
    peer, flush = config.peer, config.flush
    # the window's regions, the send buffer, and with one partner the feed's two buffers
    feed = 2 if peer.copies == 1 and scheme_shape(peer.scheme, peer.group) is None else 0
    window = (0 if config.model.path == "direct"
              else (peer.copies * peer.slots + 1 + feed) * peer.slot)
    return window + (flush.concurrency * flush.writers + 1) * flush.chunk


def check_memory(config: Config, agents: int = 1, available: int | None = None,
                 host: str = "") -> None:
    """The up-front buffers of the `agents` agents of this host must fit in the memory
    available now, keeping MEMORY_RESERVE: refused here, not by an MPI out-of-memory
    abort after other agents have started."""
    if available is None:
        available = psutil.virtual_memory().available
    need = agents * upfront_memory(config)
    if need + MEMORY_RESERVE <= available:
        return
    keys = ("flush.chunk, flush.concurrency, flush.writers" if config.model.path == "direct"
            else "peer.slot, peer.slots, peer.copies, flush.chunk, flush.concurrency,"
                 " flush.writers")
    where = f"{agents} agents on {host or socket.gethostname()}" if agents > 1 else "the agent"
    raise ConfigError(f"{keys}: {where} would allocate {_format_size(need)} at start;"
                      f" {_approximate_size(available)} is available and"
                      f" {_format_size(MEMORY_RESERVE)} is kept for the trainer")


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
    return _build(settings(path, overrides, environ), str(path or ""), environ)


def settings(path: str | os.PathLike[str] | None, overrides: Mapping[str, Any] = (),
             environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The `section.key` values before parsing: file, then CACHEX_* variables, then
    overrides (what runs.py records for commands started elsewhere)."""
    environ = os.environ if environ is None else environ
    raw = _read_toml(Path(path)) if path else {}
    merged = _flatten(raw, source=str(path or "defaults"))
    merged.update(_from_environ(environ))
    for key, value in dict(overrides).items():
        merged[_check_key(key, "--set")] = value
    return merged


def from_settings(flat: Mapping[str, Any], source: str) -> Config:
    """A configuration from recorded `section.key` values (settings)."""
    for key in flat:
        _check_key(key, source)
    return _build(flat, source, os.environ)


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
    config = Config(run=run, source=source, **built)
    check_scheme(config.peer)
    if config.agent.dead_after < config.agent.timeout:
        raise ConfigError(f"agent.dead_after: {_format_duration(config.agent.dead_after)} is"
                          f" shorter than agent.timeout"
                          f" ({_format_duration(config.agent.timeout)})")
    check_paths(config.node_paths(0))   # the agent checks its own node's rendering too
    return config


def as_dict(config: Config) -> dict[str, Any]:
    """The configuration as TOML-shaped data (for logs and the journal)."""
    out: dict[str, Any] = {"run": config.run}
    for name in _SECTIONS:
        section = getattr(config, name)
        out[name] = {f.name: getattr(section, f.name) for f in fields(section)}
    return out
