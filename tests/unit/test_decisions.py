"""The coordinator's decisions as a pure function: state + event -> state + effects.

No files, no clock, no MPI: every test builds a state, feeds typed events with their
times and looks at the state and the effects it gets back."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from cachex_agent import decisions as d
from cachex_agent.fsutil import compact_json
from cachex_agent.manifest import FileEntry, LocalManifest
from cachex_agent.messages import Exit, wire
from cachex_agent.safepath import UnsafeInput

NODES = 4
COMMIT_TIMEOUT, AGENT_TIMEOUT = 10.0, 5.0


def state(nodes: int = NODES, every: int = 1, keep_pfs: int = 0,
          path: tuple[str, str] | None = ("peer", "model.path = peer")) -> d.CoordinatorState:
    settings = d.Settings("r", COMMIT_TIMEOUT, AGENT_TIMEOUT, every, 30.0, keep_pfs, path)
    return d.CoordinatorState(settings, [d.NodeRecord(10 + n) for n in range(nodes)])


def part(ckpt: str, node: int, seq: int = 1) -> dict:
    files = [FileEntry(f"__{node}_0.distcp", 100 + node, 0o644, f"{node:032x}")]
    return LocalManifest(run="r", ckpt=ckpt, seq=seq, node=node, host="h", rank=node,
                         files=files, captured_at=1.0).to_json()


def of(effects: list, kind: type) -> list:
    return [e for e in effects if isinstance(e, kind)]


def broadcasts(effects: list, kind: str) -> list[dict]:
    """The broadcasts of `kind` as they travel (messages.wire)."""
    return [wire(e.msg) for e in of(effects, d.Broadcast) if e.msg.TYPE == kind]


def feed(s: d.CoordinatorState, *events) -> list:
    out = []
    for event in events:
        s2, effects = d.decide(s, event)
        assert s2 is s
        out.extend(effects)
    return out


def captured_all(s, ckpt, now=2.0, nodes=range(NODES)):
    return feed(s, *(d.Captured(node=n, now=now, ckpt=ckpt, manifest=part(ckpt, n)) for n in nodes))


def flushed_all(s, ckpt, now=4.0):
    """Every node's bundle; on the peer path each node replicated first (flushed is
    recorded after replicated)."""
    reports = [] if s.ckpts[ckpt].path != "peer" else [
        replicated(n, ckpt) for n in range(NODES) if str(n) not in s.ckpts[ckpt].replicated]
    return feed(s, *reports, *(d.Flushed(node=n, now=now, ckpt=ckpt, bundle=f"node-{n:05d}.h5")
                               for n in range(NODES)))


def test_marker_commits_once_with_a_sequence_number():
    s = state()
    out = feed(s, d.Marker(node=2, now=1.0, ckpt="s1", global_files=[".metadata"]))
    (commit,) = broadcasts(out, "commit")
    assert commit == {"type": "commit", "ckpt": "s1", "seq": 1, "global_files": [".metadata"],
                      "flush": True, "path": "peer"}
    assert of(out, d.SaveState) and of(out, d.Emit)[0].event == "committed"
    record = s.ckpts["s1"]
    assert (record.level, record.times["written"], record.deadline) == ("written", 1.0, 16.0)
    # a marker that crossed the commit on its way (within a beat of it) is not answered:
    # every node's would cost a send per node per checkpoint
    assert not feed(s, d.Marker(node=1, now=1.0 + AGENT_TIMEOUT / 4, ckpt="s1"))
    # later, its node may never have had it (a relay held the frame): that node alone
    again = feed(s, d.Marker(node=3, now=1.1 + AGENT_TIMEOUT / 4, ckpt="s1"))
    assert not broadcasts(again, "commit")
    assert [(e.rank, e.msg.seq) for e in of(again, d.Send)] == [(13, 1)]  # only the asker
    assert broadcasts(feed(s, d.Marker(node=0, now=2.0, ckpt="s2")), "commit")[0]["seq"] == 2


def test_commit_when_every_node_captured():
    s = state()
    feed(s, d.Marker(node=0, now=1.0, ckpt="s1", global_files=[".metadata"]))
    out = captured_all(s, "s1", nodes=range(NODES - 1))
    assert s.ckpts["s1"].level == "written" and not broadcasts(out, "manifest")
    assert [o.stage for o in of(out, d.Observe)] == ["capture"] * (NODES - 1)
    out = captured_all(s, "s1", now=3.0, nodes=[NODES - 1])
    assert s.ckpts["s1"].level == "captured" and s.ckpts["s1"].times["captured"] == 3.0
    (digest,) = broadcasts(out, "manifest")
    (whole,) = [e.msg.manifest for e in of(out, d.Hold)]    # to the holders only
    assert digest["digest"]["nodes"] == len(whole.nodes) == NODES
    assert digest["digest"]["hash"] == whole.digest().hash
    assert of(out, d.SaveGlobal)[0].manifest.ckpt == "s1"
    assert [e.event for e in of(out, d.Emit)] == ["level_captured"]


def test_a_node_failing_capture_fails_the_checkpoint_for_good():
    s = state()
    feed(s, d.Marker(node=0, now=1.0, ckpt="s1"))
    out = feed(s, d.CaptureFailed(node=1, now=2.0, ckpt="s1", error="gone"))
    record = s.ckpts["s1"]
    assert record.level == "failed" and record.reason == "node 1: gone"
    assert broadcasts(out, "failed") == [{"type": "failed", "ckpt": "s1",
                                          "reason": "node 1: gone"}]
    assert of(out, d.WriteIndex) and of(out, d.SaveState)
    assert [r.state for r in d.index_rows(s)] == ["failed"]
    # never resurrected
    assert not feed(s, d.Captured(node=2, now=3.0, ckpt="s1", manifest=part("s1", 2)))
    assert s.ckpts["s1"].level == "failed"


def test_capture_timeout_names_the_missing_nodes():
    s = state()
    feed(s, d.Marker(node=0, now=100.0, ckpt="s1"))
    captured_all(s, "s1", now=101.0, nodes=[0, 2])
    assert not broadcasts(feed(s, d.Tick(100.0 + COMMIT_TIMEOUT + AGENT_TIMEOUT)), "failed")
    out = feed(s, d.Tick(100.1 + COMMIT_TIMEOUT + AGENT_TIMEOUT))
    assert s.ckpts["s1"].level == "failed"
    assert s.ckpts["s1"].reason == "nodes [1, 3] did not capture within 10s"
    assert broadcasts(out, "failed")


def replicated(n, ckpt="s1", dead=None):
    if dead is None:
        return d.Replicated(node=n, now=3.0, ckpt=ckpt, ok=True, partners=[(n + 1) % NODES])
    return d.Replicated(node=n, now=3.0, ckpt=ckpt, ok=False,
                        errors={str(dead): f"partner node {dead}: gone"},
                        dead=[dead])


def test_replicated_needs_every_node():
    s = state()
    feed(s, d.Marker(node=0, now=1.0, ckpt="s1"))
    captured_all(s, "s1")
    feed(s, *(replicated(n) for n in range(NODES - 1)))
    assert s.ckpts["s1"].level == "captured"
    out = feed(s, replicated(NODES - 1))
    assert s.ckpts["s1"].level == "replicated"
    assert [e.event for e in of(out, d.Emit)] == ["level_replicated"]


def test_a_dead_partner_skips_replicated_and_is_named_at_exit():
    s = state()
    feed(s, d.Marker(node=0, now=1.0, ckpt="s1"))
    captured_all(s, "s1")
    feed(s, *(replicated(n, dead=2 if n == 1 else None) for n in range(NODES)))
    record = s.ckpts["s1"]
    assert record.level == "captured" and record.replication_failed
    assert record.errors == {"1": "partner node 2: gone"}
    assert [n.dead for n in s.nodes] == [False, False, True, False]
    (request,) = of(flushed_all(s, "s1"), d.Finalize)
    feed(s, d.FinalizeDone(4.5, "s1", request.manifest))
    assert record.level == "flushed"
    assert of(feed(s, d.Stop(node=0, now=5.0), *(d.Drained(node=n, now=6.0) for n in range(NODES))),
              d.Broadcast)[-1].msg == Exit(dead=[2])


def test_a_replica_finished_after_the_flush_is_counted():
    s = state()
    feed(s, d.Marker(node=0, now=1.0, ckpt="s1"))
    captured_all(s, "s1")
    feed(s, replicated(0), replicated(1, dead=2), replicated(2))     # node 3's copy is late
    # a failed replication lets the flush finish without waiting for the others
    (request,) = of(feed(s, *(d.Flushed(node=n, now=4.0, ckpt="s1", bundle="b")
                              for n in range(NODES))),
                    d.Finalize)
    feed(s, d.FinalizeDone(4.5, "s1", request.manifest))
    record = s.ckpts["s1"]
    assert record.level == "flushed" and record.count("replicated") == 2
    out = feed(s, replicated(3))
    assert record.level == "flushed" and record.count("replicated") == 3
    assert [(o.stage, o.node) for o in of(out, d.Observe)] == [("replicate", 3)]


def test_finalization_is_a_round_trip_and_the_index_says_valid_only_with_it():
    s = state()
    feed(s, d.Marker(node=0, now=1.0, ckpt="s1"))
    captured_all(s, "s1")
    out = flushed_all(s, "s1", now=4.0)
    (request,) = of(out, d.Finalize)
    assert request.manifest.ckpt == "s1" and request.manifest.times["flushed"] == 4.0
    assert [(r.id, r.state) for r in request.index] == [("s1", "valid")]
    assert s.ckpts["s1"].level == "replicated" and not broadcasts(out, "finalized")
    assert not of(feed(s, d.Tick(4.5)), d.Finalize)      # one finalize out at a time
    out = feed(s, d.FinalizeDone(5.0, "s1", request.manifest))
    record = s.ckpts["s1"]
    assert record.level == "flushed" and record.times["flushed"] == 5.0
    assert record.captured == {} and record.counts == {"captured": 4, "replicated": 4,
                                                       "flushed": 4}
    assert broadcasts(out, "finalized")[0]["digest"]["ckpt"] == "s1"
    assert not of(out, d.SaveGlobal) and of(out, d.WriteIndex)     # kept since captured
    assert [(r.id, r.state) for r in d.index_rows(s)] == [("s1", "valid")]


def test_a_failed_finalize_is_retried_at_the_next_tick():
    s = state()
    feed(s, d.Marker(node=0, now=1.0, ckpt="s1"))
    captured_all(s, "s1")
    (request,) = of(flushed_all(s, "s1"), d.Finalize)
    out = feed(s, d.FinalizeDone(5.0, "s1", request.manifest, "Read-only file system"))
    record = s.ckpts["s1"]
    assert record.level == "replicated"
    assert record.errors["coordinator"] == "global manifest: Read-only file system"
    assert of(out, d.Log)[0].level == "warning" and not broadcasts(out, "finalized")
    (retry,) = of(feed(s, d.Tick(6.0)), d.Finalize)
    feed(s, d.FinalizeDone(7.0, "s1", retry.manifest))
    assert record.level == "flushed" and "coordinator" not in record.errors


def test_on_the_peer_path_flushed_waits_for_replicated():
    """The flush runs beside the replication; its level is recorded after it."""
    s = state()
    feed(s, d.Marker(node=0, now=1.0, ckpt="s1"))
    captured_all(s, "s1")
    out = feed(s, *(d.Flushed(node=n, now=3.0, ckpt="s1", bundle=f"node-{n:05d}.h5")
                    for n in range(NODES)))
    assert not of(out, d.Finalize) and s.ckpts["s1"].level == "captured"
    out = feed(s, *(replicated(n) for n in range(NODES)))
    assert [e.event for e in of(out, d.Emit)] == ["level_replicated"]
    (request,) = of(out, d.Finalize)
    feed(s, d.FinalizeDone(4.0, "s1", request.manifest))
    assert s.ckpts["s1"].level == "flushed"


def test_a_replication_reported_again_after_a_restart_counts_but_is_no_sample():
    """Nor is a node of a `reduced` report that carried no sample for it (duration 0)."""
    s = state()
    feed(s, d.Marker(node=0, now=1.0, ckpt="s1"))
    captured_all(s, "s1")
    out = feed(s, *(d.Replicated(node=n, now=3.0, ckpt="s1", ok=True,
                                 partners=[(n + 1) % NODES], adopted=n == 0,
                                 duration=0.0 if n == 3 else 0.5)
                    for n in range(NODES)))
    assert s.ckpts["s1"].level == "replicated"
    assert sorted(o.node for o in of(out, d.Observe)) == [1, 2]


def test_a_transient_flush_error_is_shown_a_final_one_fails():
    s = state()
    feed(s, d.Marker(node=0, now=1.0, ckpt="s1"))
    captured_all(s, "s1")
    feed(s, d.FlushError(node=1, now=3.0, ckpt="s1", error="EIO"))
    assert s.ckpts["s1"].level == "captured" and s.ckpts["s1"].errors["1"] == "EIO"
    feed(s, d.Flushed(node=1, now=4.0, ckpt="s1", bundle="b"))
    assert "1" not in s.ckpts["s1"].errors
    out = feed(s, d.FlushError(node=2, now=5.0, ckpt="s1", error="checksum differs", final=True))
    assert s.ckpts["s1"].level == "failed" and broadcasts(out, "failed")


def test_pfs_retention_purges_the_oldest_after_a_finalize():
    s = state(keep_pfs=1)
    for seq, ckpt in enumerate(("s1", "s2"), 1):
        feed(s, d.Marker(node=0, now=seq, ckpt=ckpt))
        captured_all(s, ckpt)
        (request,) = of(flushed_all(s, ckpt), d.Finalize)
        out = feed(s, d.FinalizeDone(seq + 0.5, ckpt, request.manifest))
    assert of(out, d.Purge) == [d.Purge(["s1"])]
    assert [(r.id, r.state) for r in d.index_rows(s)] == [("s1", "purged"), ("s2", "valid")]


def test_drain_flushes_the_newest_and_exits_when_all_drained():
    s = state(every=3)
    feed(s, d.Marker(node=0, now=1.0, ckpt="s1"), d.Marker(node=0, now=2.0, ckpt="s2"))
    assert s.ckpts["s2"].flush is False
    out = feed(s, d.Stop(node=1, now=10.0))
    assert broadcasts(out, "drain") == [{"type": "drain", "flush": ["s2"]}]
    assert s.phase == "draining" and s.ckpts["s2"].flush
    assert not feed(s, d.Marker(node=0, now=11.0, ckpt="s3")) and "s3" not in s.ckpts
    assert not broadcasts(feed(s, d.Stop(node=2, now=11.0)), "drain")       # once
    out = feed(s, *(d.Drained(node=n, now=12.0) for n in (0, 1, 1, 2)))
    assert not broadcasts(out, "exit")              # a node reporting twice counts once
    out = feed(s, d.Drained(node=3, now=13.0))
    assert broadcasts(out, "exit") == [{"type": "exit", "dead": []}]
    assert s.phase == "stopped" and of(out, d.WriteStatus)


def test_the_drain_waits_for_a_finalize_still_out():
    s = state()
    feed(s, d.Marker(node=0, now=1.0, ckpt="s1"))
    captured_all(s, "s1")
    feed(s, d.Stop(node=0, now=3.0))
    (request,) = of(flushed_all(s, "s1"), d.Finalize)
    # each agent reports drained right after its last flushed, before the PFS answered
    out = feed(s, *(d.Drained(node=n, now=4.5) for n in range(NODES)))
    assert not broadcasts(out, "exit") and s.phase == "draining"
    out = feed(s, d.FinalizeDone(5.0, "s1", request.manifest))
    assert [e.msg.TYPE for e in of(out, d.Broadcast)] == ["finalized", "exit"]
    assert s.ckpts["s1"].level == "flushed" and s.phase == "stopped"


def test_a_drain_that_times_out_names_the_silent_agents():
    s = state()
    feed(s, d.Stop(node=0, now=10.0), d.Drained(node=0, now=11.0), d.Drained(node=2, now=11.0))
    assert not broadcasts(feed(s, d.Tick(10.0 + 30.0 + AGENT_TIMEOUT)), "exit")
    out = feed(s, d.Tick(10.1 + 30.0 + AGENT_TIMEOUT))
    assert broadcasts(out, "exit")
    assert of(out, d.Emit)[0].fields == {"reason": "drain timed out; agents [1, 3] did"
                                                   " not report"}


def test_the_model_is_asked_and_the_commit_waits_for_its_answer():
    s = state(path=None)
    feed(s, d.Marker(node=0, now=1.0, ckpt="s1"))
    captured_all(s, "s1")
    out = feed(s, d.Marker(node=1, now=20.0, ckpt="s2"))
    assert of(out, d.Choose) == [d.Choose("s2", 4 * 100 + 6, 20.0)]   # s1's size
    assert not broadcasts(out, "commit") and s.ckpts["s2"].path is None
    assert not of(out, d.SaveState)         # saved once, with its path
    assert not feed(s, d.Marker(node=2, now=20.5, ckpt="s2"))     # nothing to repeat yet
    out = feed(s, d.PathChosen(21.0, "s2", "direct", "expected loss ..."))
    (commit,) = broadcasts(out, "commit")
    assert commit["path"] == "direct" and commit["flush"] is True and of(out, d.SaveState)
    assert of(out, d.Emit)[0].fields["marker_node"] == 1
    assert not broadcasts(feed(s, d.PathChosen(22.0, "s2", "peer", "late")), "commit")


def test_status_is_written_when_something_changed_and_as_a_heartbeat():
    s = state()
    assert of(feed(s, d.Tick(100.0)), d.WriteStatus)
    assert not of(feed(s, d.Tick(100.2)), d.WriteStatus)    # nothing changed
    # unknown ckpt: still a message
    feed(s, d.Progress(node=1, now=100.3, ckpt="x", stage="flush", done=1, total=2))
    assert not of(feed(s, d.Tick(100.4)), d.WriteStatus)    # changed, but within 0.5 s
    assert of(feed(s, d.Tick(100.6)), d.WriteStatus)
    assert not of(feed(s, d.Tick(102.0)), d.WriteStatus)
    assert of(feed(s, d.Tick(102.7)), d.WriteStatus)        # heartbeat


def test_a_step_of_the_wall_clock_changes_no_decision_only_the_times_recorded():
    """`now` is monotonic; the wall clock (a tick's `wall`) only stamps what is recorded.
    Ten minutes back mid-run: the status period, the deadlines and the latencies hold."""
    s = state()
    feed(s, d.Tick(100.0, 5000.0))
    feed(s, d.Marker(node=0, now=100.5, ckpt="s1"))
    assert s.ckpts["s1"].times["written"] == 5000.5
    assert of(feed(s, d.Tick(101.0, 4400.0)), d.WriteStatus)     # stepped back 600 s
    assert of(feed(s, d.Tick(103.1, 4402.1)), d.WriteStatus)     # the heartbeat goes on
    out = captured_all(s, "s1", now=103.5)
    (level,) = [e for e in of(out, d.Emit) if e.event == "level_captured"]
    assert level.fields["latency"] == 3.0       # monotonic, not 4402.5 - 5000.5
    assert s.ckpts["s1"].times["captured"] == 4402.5
    assert s.ckpts["s1"].level == "captured"    # no deadline fired on the step


def test_a_stop_token_is_echoed_for_the_status():
    s = state()
    feed(s, d.Stop(node=1, now=1.0, token="abc"))
    assert (s.phase, s.stop_ack) == ("draining", "abc")
    feed(s, d.Stop(node=0, now=2.0))                     # a signal: no token, the last one stays
    assert s.stop_ack == "abc"


def test_finished_records_keep_totals_and_history_stays_bounded():
    s = state()
    for i in range(d.HISTORY + 5):
        feed(s, d.Marker(node=0, now=i, ckpt=f"s{i}"),
             d.CaptureFailed(node=0, now=i, ckpt=f"s{i}", error="no"))
    assert len(s.ckpts) == d.HISTORY
    assert min(r.seq for r in s.ckpts.values()) == 6


def test_decisions_are_deterministic():
    def run() -> list:
        s = state()
        out = feed(s, d.Marker(node=0, now=1.0, ckpt="s1", global_files=[".m"]))
        out += captured_all(s, "s1")
        out += feed(s, *(replicated(n) for n in range(NODES)))
        out += flushed_all(s, "s1")
        out += feed(s, d.FinalizeDone(5.0, "s1", of(out, d.Finalize)[0].manifest))
        return [(type(e).__name__, getattr(e, "msg", None), getattr(e, "fields", None))
                for e in out], d.state_json(s)
    assert run() == run()


def test_coordinator_json_as_written_is_the_state_with_each_manifest_encoded_once():
    """`state_text` reuses each node's encoded manifest; a node that captured again is
    encoded again, and a finished record drops them."""
    s = state()
    feed(s, d.Marker(node=0, now=1.0, ckpt="s1", global_files=[".m"]),
         d.Marker(node=0, now=1.0, ckpt="s2", global_files=[".m"]))
    captured_all(s, "s1", nodes=[0, 1])
    assert json.loads(d.state_text(s)) == d.state_json(s)
    assert set(s.ckpts["s1"].captured_text) == {"0", "1"}
    again = part("s1", 1)
    again["files"][0]["size"] = 999
    # as the agent sent it
    feed(s, d.Captured(node=1, now=2.5, ckpt="s1", manifest=again, text=compact_json(again)))
    assert s.ckpts["s1"].captured_text["1"] == f'"1":{compact_json(again)}'
    written = json.loads(d.state_text(s))
    assert written == d.state_json(s)
    assert written["ckpts"]["s1"]["captured"]["1"]["files"][0]["size"] == 999
    captured_all(s, "s1", nodes=range(2, NODES))
    flushed_all(s, "s1")
    feed(s, d.FinalizeDone(5.0, "s1", s.ckpts["s1"].built))
    assert s.ckpts["s1"].captured_text == {}
    assert json.loads(d.state_text(s)) == d.state_json(s)


def test_records_round_trip_through_coordinator_json():
    s = state()
    feed(s, d.Marker(node=0, now=1.0, ckpt="s1", global_files=[".m"]))
    captured_all(s, "s1", nodes=[0, 1])
    data = d.state_json(s)["ckpts"]["s1"]
    again = d.CheckpointRecord.from_json(data, "coordinator.json", "s1")
    # monotonic times mean nothing to another process: not kept (a restart sets them)
    assert "deadline" not in data and (again.deadline, again.written_at) == (0.0, None)
    assert replace(again, deadline=16.0, written_at=1.0) == s.ckpts["s1"]
    old = {"id": "s0", "seq": 1, "level": "flushed", "bytes": 5}   # an older journal
    assert d.CheckpointRecord.from_json(old, "x", "s0").path == "peer"
    with pytest.raises(UnsafeInput, match="unsafe checkpoint id"):
        d.CheckpointRecord.from_json({"id": "../up", "seq": 1, "level": "written"}, "x", "k")


def test_a_node_found_dead_reroutes_the_tree_once():
    """The reports its children sent it are lost: a frame with the new route makes them
    send again (uplink.py), once per newly dead node."""
    s = state()
    feed(s, d.Marker(node=0, now=1.0, ckpt="s1"))
    captured_all(s, "s1")
    first = feed(s, replicated(1, dead=2))
    again = feed(s, replicated(3, dead=2))
    assert len(broadcasts(first, "reroute")) == 1 and broadcasts(again, "reroute") == []


def test_a_node_that_captured_again_after_a_restart_hears_the_manifest_again():
    """It may have been killed before the broadcast reached it: its journal then lacks
    the digest, and an erasure group waits for its encoding for ever."""
    s = state()
    feed(s, d.Marker(node=0, now=1.0, ckpt="s1"))
    first = captured_all(s, "s1")
    (ready,) = broadcasts(first, "manifest")
    digest = s.ckpts["s1"].digest
    again = feed(s, d.Captured(node=2, now=3.0, ckpt="s1", manifest=part("s1", 2)))
    assert not of(again, d.Broadcast)
    (send,) = of(again, d.Send)
    assert (send.rank, wire(send.msg)) == (12, ready)
    assert s.ckpts["s1"].digest is digest           # same part: nothing rebuilt
    # unknown
    assert not of(feed(s, d.Captured(node=2, now=3.5, ckpt="s2", manifest=part("s2", 2))),
                  d.Send)


def test_a_superseded_save_is_counted_on_its_version_and_shown_in_status():
    """Nodes' saves that never became part of a version (versions.py, issue 44) are
    counted on the version they were made for, kept in coordinator.json, in its status
    row, and said once as an event; a version gone from the history counts nothing."""
    s = state()
    feed(s, d.Marker(node=0, now=1.0, ckpt="ckpt.pt@v2"))
    out = feed(s, d.Superseded(node=1, now=2.0, ckpt="ckpt.pt@v2", newer="ckpt.pt@v3"),
               d.Superseded(node=2, now=2.0, ckpt="ckpt.pt@v2", saves=2))
    assert s.ckpts["ckpt.pt@v2"].superseded == 3
    assert [e.fields for e in of(out, d.Emit)] == [
        {"ckpt": "ckpt.pt@v2", "name": "ckpt.pt", "by": "ckpt.pt@v3", "saves": 1,
         "node_reporting": 1},
        {"ckpt": "ckpt.pt@v2", "name": "ckpt.pt", "by": None, "saves": 2,
         "node_reporting": 2}]
    assert [row.get("superseded") for row in d.status_rows(s)] == [3]
    assert json.loads(d.state_text(s))["ckpts"]["ckpt.pt@v2"]["superseded"] == 3
    assert of(feed(s, d.Superseded(node=1, now=3.0, ckpt="gone.pt@v9")), d.Emit)
    assert "gone.pt@v9" not in s.ckpts
