"""The job's node set: which hosts train, which wait as spares, and what becomes of
them when nodes are lost or blamed.

Hosts are numbered as cachex numbers nodes (C-sorted names). A job starts on the first
NODES usable hosts (the allocation less EXCLUDE_NODES), down to MIN_NODES when there
are fewer; after a failure each lost node is replaced by a spare, and with too few
spares the set shrinks to what is left when MIN_NODES allows it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import ConfigError, OperationError

_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_RANGE = re.compile(r"^(?P<lo>\d+)(?:-(?P<hi>\d+))?$")


@dataclass(frozen=True)
class NodeSet:
    nodes: list[str]
    spares: list[str]
    notes: list[str] = field(default_factory=list)


def expand_hosts(text: str, what: str = "EXCLUDE_NODES") -> list[str]:
    """Host names, and Slurm host lists (`n[001-003,7]`), separated by commas or blanks."""
    if text.count("[") != text.count("]"):
        raise ConfigError(f"{what}: cannot expand {text.strip()!r}")
    hosts: list[str] = []
    for item in re.findall(r"[^,\s\[]+(?:\[[^\]]*\][^,\s\[]*)?|\S", text):
        if item == ",":
            continue
        hosts += _expand_one(item, what)
    return hosts


def _expand_one(item: str, what: str) -> list[str]:
    match = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\]([^\[\]]*)", item)
    if match is None:
        if not _HOST.match(item):
            raise ConfigError(f"{what}: {item!r} is not a host name or host list")
        return [item]
    prefix, body, suffix = match.groups()
    out = []
    for part in body.split(","):
        bounds = _RANGE.match(part.strip())
        if bounds is None or not _HOST.match(prefix + "0" + suffix):
            raise ConfigError(f"{what}: cannot expand {item!r}")
        lo, hi = bounds["lo"], bounds["hi"] or bounds["lo"]
        if int(hi) < int(lo) or int(hi) - int(lo) > 100_000:
            raise ConfigError(f"{what}: cannot expand {item!r}")
        out += [f"{prefix}{i:0{len(lo)}d}{suffix}" for i in range(int(lo), int(hi) + 1)]
    return out


def choose(hosts: list[str], nodes: int | None, spares: int, exclude: list[str],
           min_nodes: int) -> NodeSet:
    """The start: the first `nodes` usable hosts (all but `spares` when None), the rest
    spares. ConfigError (exit 2) when the allocation cannot give the job what it asks."""
    usable = sorted(set(hosts))
    if not usable:
        raise OperationError("no hosts in the allocation")
    left_out = [h for h in usable if h in set(exclude)]
    usable = [h for h in usable if h not in set(exclude)]
    notes = [f"left out (EXCLUDE_NODES): {' '.join(left_out)}"] if left_out else []
    want = len(usable) - spares if nodes is None else nodes
    if want < 1:
        raise ConfigError(f"NODES={want}: the allocation has {len(usable)} usable hosts,"
                          f" SPARES={spares}")
    if want > len(usable):
        if not (min_nodes > 0 and len(usable) >= min_nodes):
            raise ConfigError(f"NODES={want} but the allocation has only {len(usable)}"
                              f" usable hosts (MIN_NODES={min_nodes})")
        notes.append(f"NODES={want} but only {len(usable)} usable hosts: going on with"
                     f" {len(usable)} (MIN_NODES={min_nodes})")
        want = len(usable)
    if want < min_nodes:
        raise ConfigError(f"NODES={want} is below MIN_NODES={min_nodes}")
    taken, rest = usable[:want], usable[want:]
    notes.append(f"node set: {len(taken)} nodes ({','.join(taken)});"
                 f" spares: {' '.join(rest) or 'none'}")
    return NodeSet(taken, rest, notes)


def replace(nodes: list[str], spares: list[str], up: set[str], min_nodes: int) -> NodeSet:
    """After a failure: each node not `up` replaced by an up spare, in order; with too
    few, the set shrinks to the nodes left when `min_nodes` allows it, else
    OperationError saying why (the job ends)."""
    keep = [h for h in nodes if h in up]
    lost = [h for h in nodes if h not in up]
    ready = [h for h in spares if h in up]
    if not lost:
        return NodeSet(list(nodes), ready, ["every node of the set is up"])
    if len(lost) <= len(ready):
        now = sorted(keep + ready[:len(lost)])
        return NodeSet(now, ready[len(lost):], [f"lost {' '.join(lost)}; replaced by spares;"
                                                f" node set now {','.join(now)}"])
    left = len(keep) + len(ready)
    why = (f"lost {len(lost)} nodes ({' '.join(lost)}), only {len(ready)} spares left")
    if min_nodes <= 0:
        raise OperationError(f"{why}: recovery needs {len(nodes)} nodes (MIN_NODES=0; set"
                             " MIN_NODES to go on with fewer)")
    if left < min_nodes:
        raise OperationError(f"{why}: {left} nodes, below MIN_NODES={min_nodes}")
    return NodeSet(sorted(keep + ready), [], [
        f"{why}: going on with {left} of {len(nodes)} nodes (MIN_NODES={min_nodes});"
        " cachex recover places the checkpoint onto them"])
