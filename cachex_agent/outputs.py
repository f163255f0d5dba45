"""The shape of every `--json` output: one place that says which keys each command's
object carries, so that the commands, docs/commands.md and the tests agree.

Each output is one JSON object with `"schema": SCHEMA` added; SCHEMA is raised on an
incompatible change (a key removed or its meaning changed), not when a key is added.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SCHEMA = 1


@dataclass(frozen=True)
class Shape:
    """Keys always present, keys present in some cases, and the shape of the items of
    list-valued keys (`rows`)."""

    keys: frozenset[str]
    optional: frozenset[str] = frozenset()
    rows: dict[str, Shape] = field(default_factory=dict)

    def problems(self, doc: Any, where: str = "") -> list[str]:
        if not isinstance(doc, dict):
            return [f"{where or 'output'}: not an object"]
        found = set(doc)
        out = [f"{where}{k}: missing" for k in sorted(self.keys - found)]
        out += [f"{where}{k}: not documented" for k in sorted(found - self.keys
                                                               - self.optional)]
        for key, shape in self.rows.items():
            if key not in doc:
                continue
            items = doc[key]
            if not isinstance(items, list):
                out.append(f"{where}{key}: not a list")
                continue
            for i, item in enumerate(items):
                out += shape.problems(item, f"{where}{key}[{i}].")
        return out

    def names(self) -> set[str]:
        """Every key this shape and its rows can carry."""
        return set(self.keys | self.optional).union(*(s.names() for s in self.rows.values()))


def _shape(keys: str, optional: str = "", **rows: Shape) -> Shape:
    return Shape(frozenset(keys.split()), frozenset(optional.split()), rows)


_CKPT_ROW = _shape("id seq level bytes")
_LS_ROW = _shape("id seq level bytes path rule")
_STATUS_ROW = _shape("id seq level bytes times nodes_captured nodes_replicated"
                     " nodes_flushed flush path rule errors capture progress reason",
                     "predicted superseded")

SHAPES: dict[str, Shape] = {
    "ls": _shape("schema run redundancy unknown checkpoints", checkpoints=_LS_ROW),
    "status": _shape(
        "schema format version run updated state recorded_state live heartbeat nodes"
        " redundancy notes checkpoints at_risk", "stop_ack silent advice superseded",
        checkpoints=_STATUS_ROW,
        silent=_shape("node state seconds by holds relays_for subtree waiting")),
    "verify": _shape("schema ckpt ok copies", "level", copies=_shape(
        "level node where checked ok problems note")),
    "export": _shape("schema ckpt dest files bytes seconds"),
    "recover": _shape(
        "schema ckpt seq dry_run nodes onto to placement erasure moves",
        "bytes_by_kind replicated_bytes seconds plan_seconds move_seconds fallbacks"
        " moved_aside", moves=_shape("target owner kind holder files")),
    "index": _shape("schema run current pinned action name checkpoints",
                    checkpoints=_shape("id seq state bytes flushed_at")),
    "stop": _shape("schema run requested state"),
    "runs": _shape("schema dir pruned runs", runs=_shape(
        "run written job config config_exists pfs pfs_exists gone problem")),
    "model fit": _shape("schema format version stages overheads period size nodes counts"),
    "model predict": _shape("schema level path size nodes median quantile at_quantile"),
    "model plan": _shape(
        "schema size nodes period stall rates_per_hour recommended paths period_young"
        " period_daly period_optimum waste_at_optimum protection",
        paths=_shape("name path every lag lost loss_per_hour node_fallback waste")),
    "advise": _shape("schema size nodes current_interval advised_interval young"
                     " independent_nodes rates protects tier direct_to_pfs notes"),
}


def problems(command: str, doc: Any) -> list[str]:
    """What in `doc` differs from the documented shape of `command`'s output."""
    out = SHAPES[command].problems(doc)
    if isinstance(doc, dict) and doc.get("schema") != SCHEMA:
        out.append(f"schema: {doc.get('schema')!r}, expected {SCHEMA}")
    return out
