"""How much a redundancy scheme protects against several nodes lost at once. Pure.

A node loss is survived at `replicated` only while no group has lost more members than
its scheme rebuilds. The model takes node losses as independent, at `model.node_rate`
(lambda per node-hour), and a window of one checkpoint period T: the newest replicated
checkpoint protects the run until the next one is replicated, T later, so the losses
that add up against it are those within T. A node is lost within the window with

    p = 1 - exp(-lambda * T / 3600)

and a group of n members that rebuilds t of them is beyond its tolerance with

    P_g = sum_{j=t+1}^{n} C(n, j) p^j (1 - p)^(n - j)        (binomial over the group)

    copy (peer.copies c)   one "group" per part: the node and its c partners,
                           n = c + 1, t = c: P_g = p^(c+1)
    xor (peer.group n)     t = 1
    rs:K+M                 n = K + M (or more: leftover nodes add to K), t = M

Some group of the job is beyond its tolerance within a period with
P = 1 - prod_g (1 - P_g). The groups of `xor` and `rs` are disjoint, so this is exact
under the premise; the parts of `copy` share holders (node i holds i-1's copy), so
their events are not independent and P is exact to first order in p (N p^(c+1)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import Peer
from ..peer.redundancy import Redundancy

HOUR = 3600.0


@dataclass(frozen=True)
class Protection:
    """The groups of a run as (members, losses rebuilt), one entry per group."""

    scheme: str
    groups: tuple[tuple[int, int], ...]
    summary: str = ""           # the groups in words (Redundancy.describe)

    @classmethod
    def of(cls, peer: Peer, nodes: int) -> Protection:
        """The groups `peer` gives `nodes` nodes: as cachex_agent/peer/groups.py deals
        them (leftover nodes raise some groups' K, never their M)."""
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {nodes}")
        redundancy = Redundancy.of(peer)
        return cls(redundancy.scheme, redundancy.protection(nodes),
                   redundancy.describe(nodes))

    def describe(self) -> str:
        return self.summary

    def to_json(self) -> dict[str, object]:
        return {"scheme": self.scheme, "groups": [list(g) for g in self.groups]}

    def group_beyond(self, p: float) -> list[float]:
        """P_g per group: more than its tolerated members lost, each with chance p."""
        return [beyond(n, t, p) for n, t in self.groups]

    def beyond_in_window(self, node_rate: float, window: float) -> float:
        """P: some group beyond its tolerance within `window` seconds."""
        p = loss_probability(node_rate, window)
        survive = 1.0
        for chance in self.group_beyond(p):
            survive *= 1.0 - chance
        return 1.0 - survive

    def fallback(self, node_rate: float, window: float, nodes: int) -> float:
        """The fraction of node losses whose restart cannot come from the peers.

        Beyond-tolerance windows happen at P / (T/3600) per hour; node losses at
        lambda N. One restart per such window falls back to `flushed` (or an older
        checkpoint), the others are rebuilt from the group."""
        if node_rate <= 0 or window <= 0:
            return 0.0
        rate = self.beyond_in_window(node_rate, window) / (window / HOUR)
        return min(1.0, rate / (node_rate * nodes))


def loss_probability(node_rate: float, window: float) -> float:
    """p: one node lost within `window` seconds at `node_rate` losses per node-hour."""
    return -math.expm1(-node_rate * window / HOUR)


def beyond(members: int, tolerates: int, p: float) -> float:
    """P[Binomial(members, p) > tolerates]."""
    kept = sum(math.comb(members, j) * p ** j * (1.0 - p) ** (members - j)
               for j in range(min(tolerates, members) + 1))
    return max(0.0, 1.0 - kept)
