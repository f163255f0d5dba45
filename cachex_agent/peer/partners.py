"""Who keeps a copy of whose data. Pure functions, no MPI.

The partners of node i are taken along the ring i + stride, i + 2*stride, ... (then the
remaining nodes in ring order, when the stride does not visit them all), skipping nodes
in i's failure domain and domains already chosen, until `copies` partners are found: each
copy lives in a different domain, so losing any one domain leaves a copy.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..config import Config
from ..errors import ConfigError


def domains_of(spec: str, hosts_by_node: list[str]) -> list[str]:
    """The failure domain of every node under `topology.domain`."""
    if spec == "node":
        return list(hosts_by_node)
    if spec == "rank":
        return [str(node) for node in range(len(hosts_by_node))]
    if spec.startswith("regex:"):
        return [_by_regex(spec[len("regex:"):], host) for host in hosts_by_node]
    if spec.startswith("file:"):
        table = _read_domain_file(Path(spec[len("file:"):]))
        missing = [h for h in hosts_by_node if h not in table]
        if missing:
            raise ConfigError(f"topology.domain: host {missing[0]} is not in {spec[5:]}")
        return [table[host] for host in hosts_by_node]
    raise ConfigError(f"topology.domain: unknown {spec!r}")


def _by_regex(pattern: str, host: str) -> str:
    try:
        match = re.search(pattern, host)
    except re.error as exc:
        raise ConfigError(f"topology.domain: bad regex {pattern!r}: {exc}") from None
    if match is None:
        raise ConfigError(f"topology.domain: regex {pattern!r} does not match host {host}")
    return match.group(1) if match.groups() else match.group(0)


def _read_domain_file(path: Path) -> dict[str, str]:
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"topology.domain: {path}: {exc.strerror}") from None
    table = {}
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) != 2:
            raise ConfigError(f"topology.domain: {path}:{number}: expected 'host domain'")
        table[words[0]] = words[1]
    return table


def partners(node: int, domains: list[str], stride: int = 1, copies: int = 1) -> list[int]:
    """The nodes that hold copies of `node`'s data, in order of preference."""
    count = len(domains)
    ring = [(node + stride * k) % count for k in range(1, count)]
    ring += [(node + k) % count for k in range(1, count) if (node + k) % count not in ring]
    chosen: list[int] = []
    used = {domains[node]}
    for candidate in ring:
        if candidate != node and domains[candidate] not in used:
            chosen.append(candidate)
            used.add(domains[candidate])
        if len(chosen) == copies:
            return chosen
    distinct = len(set(domains))
    raise ConfigError(f"peer.copies: {copies} copies need {copies + 1} failure domains;"
                      f" topology.domain gives {distinct} over {count} nodes")


def partner_map(domains: list[str], stride: int, copies: int) -> list[list[int]]:
    return [partners(node, domains, stride, copies) for node in range(len(domains))]


def replication_map(config: Config, hosts_by_node: list[str]) -> list[list[int]] | None:
    """Partners of every node, or None when the run is flush-only (`model.path = direct`,
    or `auto` with a single failure domain). With `peer`, too few domains is an error."""
    if config.model.path == "direct":
        return None
    domains = domains_of(config.topology.domain, hosts_by_node)
    if config.model.path == "auto" and len(set(domains)) < 2:
        return None
    return partner_map(domains, config.peer.stride, config.peer.copies)


def incoming(node: int, pmap: list[list[int]]) -> list[int]:
    """Owners that send their data to `node`, in node order (its window's regions)."""
    return [owner for owner, chosen in enumerate(pmap) if node in chosen]


def metadata_holders(domains: list[str], copies: int) -> list[int]:
    """The nodes besides the coordinator (node 0) that keep every checkpoint's whole
    global manifest: max(2, copies) of them, spread over the job, each in a failure
    domain of its own and none in node 0's while there are domains enough; fewer on a
    job of fewer nodes. Every other agent keeps a digest (manifest.ManifestDigest)."""
    count = len(domains)
    want = min(max(2, copies), count - 1)
    spread = [round(k * count / (want + 1)) % count for k in range(1, want + 1)]
    order = list(dict.fromkeys([*spread, *range(1, count)]))
    chosen: list[int] = []
    used = {domains[0]}
    for strict in (True, False):
        for node in order:
            if len(chosen) == want:
                return chosen
            if node != 0 and node not in chosen and (not strict or domains[node] not in used):
                chosen.append(node)
                used.add(domains[node])
    return chosen
