"""The redundancy descriptor: what `peer.scheme`, `peer.copies` and `peer.group` make of
a run, read once from the configuration. Code outside peer/ asks it what protects a
checkpoint, what a node holds for others and which losses are survived; it never
names a scheme.

    copy      each node's part whole on `peer.copies` partners (replicas); survives
              any `peer.copies` lost nodes
    xor       one parity share per group of `peer.group` nodes; survives 1 per group
    rs:K+M    M parity shares per group of K+M nodes; survives M per group
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Config, Peer, scheme_shape
from .groups import build_groups, group_sizes, shape
from .partners import domains_of


@dataclass(frozen=True)
class Redundancy:
    scheme: str                         # for people: status lines and events
    copies: int                         # partners holding a whole copy (replicas)
    group: int                          # nodes per erasure group (0: none)
    survives: int                       # lost nodes survived (per group for erasure)

    @classmethod
    def of(cls, peer: Peer) -> Redundancy:
        found = scheme_shape(peer.scheme, peer.group)
        if found is None:
            return cls(peer.scheme, peer.copies, 0, peer.copies)
        return cls(peer.scheme, 0, peer.group, found[1])

    @property
    def replicas(self) -> bool:
        """Partners hold whole copies of each part (`replica` copies in recovery)."""
        return self.group == 0

    @property
    def parity(self) -> bool:
        """Group members hold parity shares (`parity` copies in recovery)."""
        return self.group > 0

    def groups(self, config: Config, hosts_by_node: list[str]) -> list[list[int]] | None:
        """The erasure groups of the job (members in distinct failure domains); None
        when the parts are protected by replicas."""
        if self.replicas:
            return None
        return build_groups(domains_of(config.topology.domain, hosts_by_node), self.group)

    def protection(self, nodes: int) -> tuple[tuple[int, int], ...]:
        """(members, losses survived) per group of `nodes` nodes; for replicas one
        "group" per part: the node and its partners."""
        if self.replicas:
            return ((self.copies + 1, self.copies),) * nodes
        return tuple((size, self.survives) for size in group_sizes(nodes, self.group))

    def describe(self, nodes: int) -> str:
        """The protection of `nodes` nodes in words, for the model's report."""
        if self.replicas:
            return (f"{self.scheme}: a part is lost with its node and its {self.copies}"
                    f" partner{'s' if self.copies > 1 else ''}")
        sizes = sorted(set(group_sizes(nodes, self.group)))
        count = len(group_sizes(nodes, self.group))
        return (f"{self.scheme} over {count} group(s) of {' or '.join(map(str, sizes))}"
                f" nodes, each rebuilding {self.survives} lost"
                f" member{'s' if self.survives > 1 else ''}")

    def status(self, nodes: int) -> dict[str, object]:
        """What `replicated` means in this run, for status.json: the scheme, and for
        erasure the group size, the sizes the groups of `nodes` nodes really have
        (leftovers make some larger: rs:4+2 on 8 nodes is one group of 8, K 6) and the
        lost members a group survives."""
        if self.replicas:
            return {"scheme": self.scheme, "copies": self.copies, "survives": self.survives}
        return {"scheme": self.scheme, "group": self.group, "survives": self.survives,
                "sizes": group_sizes(nodes, self.group)}

    def shape(self, members: int) -> tuple[int, int]:
        """(K, M) of a group of `members` nodes: leftovers dealt into it add to K."""
        return shape(self.scheme, self.group, members)


def redundancy_of(config: Config) -> Redundancy:
    return Redundancy.of(config.peer)
