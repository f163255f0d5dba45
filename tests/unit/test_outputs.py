"""The --json shapes: the checker finds what differs, and docs/commands.md names every
key of every command (the real outputs are checked against the same shapes in
tests/integration/test_json.py and test_events_pfs.py, and here for ls and status)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cachex_agent.outputs import SCHEMA, SHAPES, problems

DOC = Path(__file__).resolve().parents[2] / "docs" / "commands.md"
ROW = re.compile(r"^\| `([a-z ]+)` \| (.*) \|$", re.MULTILINE)


def documented() -> dict[str, set[str]]:
    section = DOC.read_text().split("## `--json` output", 1)[1].split("\n## ", 1)[0]
    return {cmd: set(re.findall(r"`([a-z_]+)`", fields))
            for cmd, fields in ROW.findall(section)}


def test_every_command_has_a_row_that_names_each_of_its_keys():
    rows = documented()
    assert set(rows) == set(SHAPES)
    for command, shape in SHAPES.items():
        missing = shape.names() - {"schema"} - rows[command]
        assert not missing, f"docs/commands.md, {command}: {sorted(missing)} not documented"


def test_a_conforming_output_has_no_problems():
    doc = {"schema": SCHEMA, "ckpt": "step_1", "ok": True, "copies": [
        {"level": "stage", "node": 0, "where": "/x", "checked": True, "ok": True,
         "problems": [], "note": None}]}
    assert problems("verify", doc) == []


@pytest.mark.parametrize("change, expected", [
    (lambda d: d.pop("ok"), ["ok: missing"]),
    (lambda d: d.update(extra=1), ["extra: not documented"]),
    (lambda d: d["copies"][0].pop("note"), ["copies[0].note: missing"]),
    (lambda d: d.update(copies={}), ["copies: not a list"]),
    (lambda d: d.update(schema=2), ["schema: 2, expected 1"]),
])
def test_each_difference_is_named(change, expected):
    doc = {"schema": SCHEMA, "ckpt": "step_1", "ok": True, "copies": [
        {"level": "stage", "node": 0, "where": "/x", "checked": True, "ok": True,
         "problems": [], "note": None}]}
    change(doc)
    assert problems("verify", doc) == expected


def test_optional_keys_may_be_absent_or_present():
    base = {"schema": SCHEMA, "ckpt": "s", "seq": 1, "dry_run": True, "nodes": 2,
            "onto": 2, "to": None, "placement": [], "erasure": [], "moves": []}
    assert problems("recover", base) == []
    assert problems("recover", {**base, "seconds": 1.0, "fallbacks": []}) == []
