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
from pathlib import Path
from typing import Any, Protocol

from ..config import Config, Peer, scheme_shape
from ..journal import JournalEntry
from ..manifest import LocalManifest
from ..messages import FileCaptured, Replicated
from .groups import build_groups, group_sizes
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
        sizes = group_sizes(nodes, self.group)
        shown = " or ".join(map(str, sorted(set(sizes))))
        return (f"{self.scheme} over {len(sizes)} group(s) of {shown}"
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


def redundancy_of(config: Config) -> Redundancy:
    return Redundancy.of(config.peer)


def replicated(ckpt: str, partners: list[int], errors: dict[str, str] | None = None,
               duration: float = 0.0, adopted: bool = False) -> Replicated:
    """The `replicated` report, whichever scheme protected the part: `ok` unless a
    partner (or group member) has an error."""
    return Replicated(ckpt=ckpt, ok=not errors, errors=errors or {}, partners=partners,
                      duration=duration, adopted=adopted)


class Protector(Protocol):
    """What protects this node's captured parts elsewhere, as the agent drives it: the
    replicator (copy) or the encoder (xor, rs:K+M). The agent calls these on the peer
    path only, and never asks which scheme it has. Each ends a checkpoint's protection
    with one `replicated` report into the agent's inbox."""

    partners: list[int]             # the nodes holding this node's copies or parity
    streams: int                    # parts in flight per partner (0: not streamed)
    feed: Any                       # peer.feed.Feed the capture hands pieces to, or None
    dead: Any                       # the nodes it found gone (iterable of node numbers)

    def protect(self, manifest: LocalManifest, source: Path, entry: JournalEntry,
                fed_wait: float = 0.0) -> None:
        """This node's part is captured (`entry`: its journal entry)."""

    def group_ready(self, manifest: LocalManifest, source: Path,
                    entry: JournalEntry) -> None:
        """Every node captured the checkpoint (the coordinator's global manifest)."""

    def file_captured(self, msg: FileCaptured) -> Any:
        """A file of a part still being captured."""

    def resume(self, manifest: LocalManifest, source: Path, entry: JournalEntry) -> None:
        """A restart found this part's protection cut short."""

    def cancel(self, ckpt: str, reason: str = "cancelled") -> None: ...

    def handle(self, source_node: int, msg: Any) -> None:
        """A peer message (messages.PEER) from another node's agent."""

    def pump(self) -> None:
        """Move what can move now, on the main thread."""

    def waits_on_peer(self) -> bool:
        """What moves it next is a message from another agent (poll for it)."""

    def pending(self) -> set[str]:
        """Checkpoints whose protection has not ended (their staged files must stay)."""

    def busy(self) -> bool: ...

    def give_up_on_suspects(self) -> None:
        """The drain: stop waiting for partners that are only suspect (liveness.py)."""

    def close(self, free: bool = True, timeout: float = 0.0) -> None:
        """`free`: no agent is known dead (a collective release would wait for it)."""
