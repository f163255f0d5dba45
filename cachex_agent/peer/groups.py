"""Erasure groups: which nodes encode together (`peer.scheme` xor or rs:K+M). Pure, no MPI.

A group's members must sit in distinct failure domains (the rule partners.py keeps for
copies): losing one domain then costs a group at most one member. Nodes are listed
domain by domain (domains in order of their first node, nodes in order) and dealt over
the groups in turn, so the nodes of one domain land in consecutive, hence distinct,
groups as long as no domain has more nodes than there are groups.

Leftovers: with `count` nodes and groups of `size`, there are `count // size` groups and
the `count % size` nodes left over are dealt like the others, so a group has `size` or
more members. An extra member raises the group's K and keeps its M (`shape`): the
protection stays M lost members per group, the parity share falls to M/K.
"""

from __future__ import annotations

from ..config import scheme_shape
from ..errors import ConfigError


def build_groups(domains: list[str], size: int) -> list[list[int]]:
    """The groups of nodes (indices into `domains`), each in distinct domains."""
    count = len(domains)
    if count < size:
        raise ConfigError(f"peer.group: groups of {size} nodes need at least {size} nodes,"
                          f" the job has {count}")
    groups = count // size
    by_domain: dict[str, list[int]] = {}
    for node, domain in enumerate(domains):
        by_domain.setdefault(domain, []).append(node)
    crowded = max(by_domain.items(), key=lambda item: len(item[1]))
    if len(crowded[1]) > groups:
        raise ConfigError(f"peer.group: groups of {size} nodes in distinct failure domains"
                          f" cannot be formed: domain {crowded[0]!r} has {len(crowded[1])}"
                          f" nodes but {count} nodes make {groups} group(s);"
                          f" topology.domain gives {len(by_domain)} domains")
    dealt: list[list[int]] = [[] for _ in range(groups)]
    order = [node for nodes in by_domain.values() for node in nodes]
    for turn, node in enumerate(order):
        dealt[turn % groups].append(node)
    return dealt


def group_sizes(nodes: int, size: int) -> list[int]:
    """The members each group has when `nodes` nodes are dealt as build_groups deals
    them (nodes // size groups, leftovers one to a group in turn)."""
    count = max(1, nodes // size)
    return [len(range(g, nodes, count)) for g in range(count)]


def shape(scheme: str, size: int, members: int) -> tuple[int, int]:
    """(K, M) of a group of `members` nodes, `peer.group` being `size`: leftovers dealt
    into a group add to K."""
    found = scheme_shape(scheme, size)
    if found is None:
        raise ConfigError(f"peer.scheme: {scheme!r} has no erasure groups")
    k, m = found
    return k + members - size, m


def group_of(node: int, groups: list[list[int]]) -> list[int]:
    """The members of `node`'s group, in member order (a member's index is its place)."""
    return next(group for group in groups if node in group)
