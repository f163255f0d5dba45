"""The typed messages: what travels, and what a hostile rank cannot make an agent do."""

from __future__ import annotations

import dataclasses
import pickle
import re

import pytest

from cachex_agent import decisions
from cachex_agent.fsutil import compact_json
from cachex_agent.manifest import FileEntry, GlobalManifest, LocalManifest
from cachex_agent.messages import (
    PEER,
    REPORTS,
    TO_AGENT,
    TO_COORDINATOR,
    Ack,
    Begin,
    Captured,
    CaptureFailed,
    Commit,
    Credit,
    Drain,
    Drained,
    End,
    Evicted,
    Exit,
    Failed,
    File,
    Finalized,
    Flushed,
    FlushError,
    Frames,
    GlobalFile,
    HoldManifest,
    ManifestReady,
    Marker,
    Progress,
    Replicated,
    Silence,
    Slot,
    Stop,
    Superseded,
    Tag,
    Unprotected,
    decode,
    wire,
)
from cachex_agent.safepath import UnsafeInput

SOURCE = "message from rank 3"
FILE = {"type": "file", "ckpt": "step-1", "file": 0, "path": "a.pt", "size": 10, "mode": 420,
        "checksum": "0" * 32}


def local(ckpt: str = "step-1", node: int = 1, path: str = "a/b.pt") -> LocalManifest:
    files = [FileEntry(path, 10, 0o644, "0" * 32)]
    return LocalManifest(run="r", ckpt=ckpt, seq=1, node=node, host="h", rank=node,
                         files=files, captured_at=1.0)


def global_manifest(ckpt: str = "step-1") -> GlobalManifest:
    return GlobalManifest.build([local(ckpt, 0)], [], {"captured": 1.0}, {0: "node-00000.h5"},
                                committed_at=2.0)


EVERY = [
    (Tag.COORDINATOR, Commit("step-1", 1, True, "peer", [".metadata"])),
    (Tag.COORDINATOR, Commit("step-2", 2, False, "direct")),
    (Tag.RELAY, ManifestReady("step-1", global_manifest().digest())),
    (Tag.RELAY, HoldManifest("step-1", global_manifest())),
    (Tag.RELAY, Finalized("step-1", global_manifest().digest())),
    (Tag.COORDINATOR, Failed("step-1", "node 2: gone")),
    (Tag.COORDINATOR, Drain(["step-1", "step-2"])),
    (Tag.COORDINATOR, Exit([0, 3])),
    (Tag.PEER, Begin(local())),
    (Tag.PEER, Begin(local(), streamed=True)),
    (Tag.PEER, File("step-1", 2, "a/b.pt", 10, 0o644, "0" * 32)),
    (Tag.PEER, Slot("step-1", 3, 0, 4 << 20, 1 << 20)),
    (Tag.PEER, End("step-1")),
    (Tag.PEER, End("step-1", local())),
    (Tag.PEER, Credit(3)),
    (Tag.PEER, Ack("step-1", False, "disk full")),
    (Tag.PEER, Ack("step-1", False, "a.pt: checksum differs from the owner's", 3)),
    (Tag.PEER, GlobalFile("step-1", ".metadata", 10, "0" * 32)),
]


@pytest.mark.parametrize("tag,message", EVERY, ids=lambda v: getattr(v, "TYPE", str(v)))
def test_every_message_arrives_as_it_was_sent(tag, message):
    raw = wire(message)
    assert raw["type"] == message.TYPE
    # manifests as JSON: a local one as its dict, the holders' global one as its text
    kind = bytes if message.TYPE == "hold" else (dict, type(None))
    assert isinstance(raw.get("manifest"), kind)
    assert decode(raw, SOURCE, tag) == message


@pytest.mark.parametrize("manifest", [{"format": "cachex-global-manifest"}, b"{not json",
                                      b"[1]"])
def test_a_held_manifest_is_json_text_of_an_object(manifest):
    with pytest.raises(UnsafeInput, match=r"\(hold\): manifest "):
        decode({"type": "hold", "ckpt": "step-1", "manifest": manifest}, SOURCE,
               Tag.RELAY)


def test_every_type_has_one_tag_and_the_coordinator_knows_every_report():
    assert not TO_AGENT.keys() & PEER.keys()
    assert not TO_COORDINATOR & (TO_AGENT.keys() | PEER.keys())
    # the reports are the coordinator's events as they come (decisions.decide)
    assert set(REPORTS) == TO_COORDINATOR
    for kind in REPORTS.values():
        assert getattr(decisions, kind.__name__) is kind


REPORTED = [
    Marker(node=1, ckpt="step-1", global_files=[".metadata"], rule="dcp"),
    Captured(node=2, ckpt="step-1", manifest=local(node=2).to_json(), mode="link",
             reason="new files", duration=0.5, global_files=[".metadata"], fed_wait=0.1),
    CaptureFailed(node=2, ckpt="step-1", error="gone"),
    Replicated(node=3, ckpt="step-1", ok=False, partners=[0], errors={"0": "gone"},
               dead=[0], duration=1.5, adopted=True),
    Flushed(node=0, ckpt="step-1", bundle="node-00000.h5", adopted=False, duration=2.0),
    FlushError(node=0, ckpt="step-1", error="EIO", final=False, retry_in=4.0),
    Progress(node=0, ckpt="step-1", stage="flush", done=10, total=100),
    Evicted(node=1, ckpt="step-1"),
    Unprotected(node=1, ckpts=["step-0"], note="older"),
    Superseded(node=1, ckpt="ckpt.pt@v2", newer="ckpt.pt@v3", saves=1),
    Stop(node=0, token="abc"),
    Drained(node=2, unflushed=["step-1"]),
    Silence(node=1, peer=3, seconds=12.5, ended=False, holds="reports"),
    Frames(node=2, first=4, last=6),
]


@pytest.mark.parametrize("report", REPORTED, ids=lambda r: r.TYPE)
def test_every_report_arrives_typed_as_it_was_sent(report):
    """Each report of REPORTS once, every field set: what decode gives the coordinator
    equals what the agent built (a captured manifest comes with its text as sent)."""
    assert {type(r) for r in REPORTED} == set(REPORTS.values())
    got = decode(pickle.loads(pickle.dumps(wire(report))), SOURCE, Tag.COORDINATOR)
    if isinstance(report, Captured):
        assert got.text == compact_json(report.manifest)
        got = dataclasses.replace(got, text=None)
    assert got == report


def test_a_captured_manifest_travels_as_json_text_kept_as_sent():
    """The coordinator parses and checks the text, and keeps it for coordinator.json."""
    manifest = local(node=2).to_json()
    sent = wire(Captured(node=2, ckpt="step-1", manifest=manifest))
    assert isinstance(sent["manifest"], bytes) and "text" not in sent and "now" not in sent
    got = decode(sent, SOURCE, Tag.COORDINATOR)
    assert got.manifest == manifest and got.text == compact_json(manifest)


@pytest.mark.parametrize("raw,says", [
    ({"type": "drained", "node": 3, "unflushed": [], "later": 1}, "fields"),   # unknown
    ({"type": "drained", "node": 3, "now": 5.0}, "fields"),     # the coordinator's own
    ({"type": "evicted", "ckpt": "s"}, "fields"),               # no node
    ({"type": "replicated", "node": 1, "ckpt": "s"}, "fields"),     # no ok
    ({"type": "replicated", "node": 1, "ckpt": "s", "ok": "yes"}, "ok must be true"),
    ({"type": "replicated", "node": 1, "ckpt": "s", "ok": True, "partners": [-2]}, "-2"),
    ({"type": "replicated", "node": 1, "ckpt": "s", "ok": False,
      "errors": {"0": ["x"]}}, "errors must map text"),
    ({"type": "flushed", "node": 1, "ckpt": "s", "bundle": "../x.h5"}, "../x.h5"),
    ({"type": "flushed", "node": 1, "ckpt": "s", "bundle": "b", "duration": -1},
     "duration must be seconds"),
    ({"type": "progress", "node": 1, "ckpt": "s", "stage": "flush", "done": 1.5,
      "total": 2}, "done must be a count"),
    ({"type": "drained", "node": 1, "unflushed": ["../s"]}, "../s"),
    ({"type": "stop", "node": 1, "token": 7}, "token must be text"),
    ({"type": "superseded", "node": 1, "ckpt": "s", "newer": "../s"}, "../s"),
    ({"type": "superseded", "node": 1, "ckpt": "s", "saves": -1}, "saves must be a count"),
])
def test_a_report_with_a_field_unknown_missing_or_of_another_kind_is_refused(raw, says):
    with pytest.raises(UnsafeInput, match=re.escape(says)):
        decode(raw, SOURCE, Tag.COORDINATOR)
    batch = {"type": "batch", "node": 0, "reports": [raw]}
    with pytest.raises(UnsafeInput, match=re.escape(says)):
        decode(batch, SOURCE, Tag.COORDINATOR)


@pytest.mark.parametrize("manifest,says", [
    ({"format": "cachex-local-manifest"}, "must be JSON text"),      # a pickled dict
    (b"{not json", "not JSON"),
    (compact_json(local(node=2).to_json()).encode("utf-16"), "not JSON"),
    (b"[" * 5000, "not JSON"),                                  # nested past the parser
    (compact_json(local(node=2).to_json()).replace('"captured_at":1.0',
                                                   '"captured_at":NaN').encode(), "not JSON"),
    (compact_json({**local(node=2).to_json(), "captured_at": [[[1]]]}).encode(), "captured_at"),
    (compact_json({**local(node=2).to_json(), "seq": "1"}).encode(), "seq"),
    (compact_json({**local(node=2).to_json(), "run": {"a": 1}}).encode(), "run"),
    (compact_json({**local(node=2).to_json(), "format": "other"}).encode(), "format"),
    (b"[1, 2]", "not a JSON object"),
    (compact_json({**local(node=2).to_json(), "node": -1}).encode(), "node"),
    (compact_json({**local(node=2).to_json(), "rank": True}).encode(), "rank"),
    (compact_json({**local(node=2).to_json(), "host": "a/b"}).encode(), "host"),
    (compact_json({**local(node=2).to_json(), "ckpt": ".hidden"}).encode(), ".hidden"),
    (compact_json({**local(node=2).to_json(), "owner": "x"}).encode(), "keys"),
    (compact_json({k: v for k, v in local(node=2).to_json().items() if k != "host"}
                  ).encode(), "keys"),
    (compact_json({**local(node=2).to_json(),
                   "files": [{"path": "../x", "size": 1, "mode": 0, "checksum": ""}]}
                  ).encode(), "../x"),
])
def test_a_captured_manifest_that_is_not_safe_json_text_is_refused(manifest, says):
    raw = {"type": "captured", "node": 2, "ckpt": "step-1", "manifest": manifest}
    with pytest.raises(UnsafeInput, match=re.escape(says)):
        decode(raw, SOURCE, Tag.COORDINATOR)


def test_a_captured_report_without_a_manifest_is_refused():
    with pytest.raises(UnsafeInput, match="manifest"):
        decode({"type": "captured", "node": 2, "ckpt": "step-1"}, SOURCE, Tag.COORDINATOR)


HOSTILE = [
    (Tag.COORDINATOR, "not a dict", "not a cachex message"),
    (Tag.COORDINATOR, {"type": 7}, "not a cachex message"),
    (Tag.COORDINATOR, {"type": "launch", "ckpt": "s"}, "unknown message type 'launch'"),
    (Tag.PEER, {"type": "commit", "ckpt": "s", "seq": 1, "flush": True}, "unknown message"),
    (Tag.COORDINATOR, {"type": "failed", "ckpt": "s"}, "expected"),
    (Tag.PEER, {"type": "end", "ckpt": "s", "then": "rm -rf"}, "expected"),
    (Tag.COORDINATOR, {"type": "commit", "ckpt": "../../etc", "seq": 1, "flush": True},
     "../../etc"),
    (Tag.COORDINATOR, {"type": "commit", "ckpt": "s", "seq": -1, "flush": True}, "seq"),
    (Tag.COORDINATOR, {"type": "commit", "ckpt": "s", "seq": 1, "flush": "yes"}, "flush"),
    (Tag.COORDINATOR, {"type": "commit", "ckpt": "s", "seq": 1, "flush": True,
                       "path": "/pfs"}, "path must be peer or direct"),
    (Tag.COORDINATOR, {"type": "commit", "ckpt": "s", "seq": 1, "flush": True,
                       "global_files": ["/etc/passwd"]}, "/etc/passwd"),
    (Tag.COORDINATOR, {"type": "drain", "flush": ["ok", ".."]}, "'..'"),
    (Tag.COORDINATOR, {"type": "drain", "flush": "s1"}, "flush must be a list"),
    (Tag.COORDINATOR, {"type": "exit", "dead": [-1]}, "node"),
    (Tag.PEER, {"type": "slot", "ckpt": "s", "slot": True, "file": 0, "offset": 0,
                "length": 1}, "slot must be a count"),
    (Tag.PEER, {"type": "credit", "slot": 1.5}, "slot must be a count"),
    (Tag.PEER, {"type": "ack", "ckpt": "s", "ok": False, "mismatch": -1},
     "mismatch must be a count"),
    (Tag.PEER, {"type": "ack", "ckpt": "s", "ok": False, "mismatch": "a.pt"},
     "mismatch must be a count"),
    (Tag.PEER, {"type": "global_file", "ckpt": "s", "path": "../x", "size": 1,
                "checksum": "0"}, "../x"),
    (Tag.PEER, {"type": "begin", "manifest": {**local().to_json(),
                                               "files": [{"path": "/abs", "size": 1,
                                                          "mode": 420, "checksum": "0"}]}},
     "/abs"),
    (Tag.PEER, {"type": "begin", "manifest": local().to_json(), "streamed": "yes"},
     "streamed must be true or false"),
    (Tag.PEER, {**FILE, "path": "../x"}, "../x"),
    (Tag.PEER, {**FILE, "path": "/etc/passwd"}, "/etc/passwd"),
    (Tag.PEER, {**FILE, "file": -1}, "file must be a count"),
    (Tag.PEER, {**FILE, "size": "10"}, "size must be a count"),
    (Tag.PEER, {**FILE, "mode": 1.5}, "mode must be a count"),
    (Tag.PEER, {**FILE, "checksum": None}, "checksum must be text"),
    (Tag.PEER, {**FILE, "ckpt": "../s"}, "../s"),
    (Tag.PEER, {k: v for k, v in FILE.items() if k != "checksum"}, "file message with"),
    (Tag.PEER, {"type": "end", "ckpt": "step-2", "manifest": local().to_json()}, "step-1"),
    (Tag.PEER, {"type": "end", "ckpt": "step-1", "manifest": {**local().to_json(),
                                                               "node": -1}}, "node"),
    (Tag.PEER, {"type": "end", "ckpt": "step-1", "manifest": "all of it"}, "expected an object"),
    (Tag.COORDINATOR, {"type": "captured", "ckpt": "s"}, "node"),
    (Tag.COORDINATOR, {"type": "unprotected", "node": 1, "ckpts": ["a/../../b"],
                       "note": "n"}, "a/../../b"),
    (Tag.GLOBAL_DATA, {"type": "end", "ckpt": "s"}, "unknown message type"),
    (Tag.RELAY, {"type": "manifest", "ckpt": "step-1",
                 "digest": {**global_manifest().digest().to_json(), "ckpt": "step-2"}},
     "step-1"),
    (Tag.RELAY, {"type": "finalized", "ckpt": "step-1",
                 "digest": {**global_manifest().digest().to_json(), "nodes": -1}}, "nodes"),
]


@pytest.mark.parametrize("tag,raw,says", HOSTILE)
def test_hostile_messages_are_refused_with_a_line_naming_the_sender(tag, raw, says):
    with pytest.raises(UnsafeInput) as refused:
        decode(raw, SOURCE, tag)
    line = str(refused.value)
    assert SOURCE in line and says in line and "\n" not in line
