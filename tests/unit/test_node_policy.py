"""The node's per-checkpoint decisions as pure functions (node_policy.py): what a commit,
a capture, an announcement, a failure, a drain and a restart make the agent do."""

from cachex_agent import node_policy as p
from cachex_agent.journal import JournalEntry
from cachex_agent.manifest import FileEntry, LocalManifest, ManifestDigest
from cachex_agent.messages import (
    Captured,
    Commit,
    Drain,
    Failed,
    Finalized,
    ManifestReady,
    Marker,
    Protected,
)

CKPT = "step_00002"
FILES = [FileEntry(".metadata", 10, 0o600, "x" * 32), FileEntry("__0_0.distcp", 99, 0o600,
                                                                 "y" * 32)]
MANIFEST = LocalManifest(run="r", ckpt=CKPT, seq=2, node=0, host="h", rank=0, files=FILES)
DIGEST = ManifestDigest(ckpt=CKPT, seq=2, nodes=2, files=4, bytes=218, hash="h" * 32)


def entry(*, capture="done", replicate=None, flush=None, commit=None, **fields):
    stages = {k: v for k, v in (("capture", capture), ("replicate", replicate),
                                ("flush", flush), ("commit", commit)) if v}
    return JournalEntry(CKPT, seq=2, stages=stages, source=f"/stage/{CKPT}",
                        **{"mode": "copy", **fields})


def state(e=None, *, manifest=MANIFEST, held=True, path="peer", flush=False,
          announced=True, capturing=False, protects=True):
    return p.CkptState(CKPT, e, manifest, held,
                       p.Announced(2, path, flush) if announced else None, capturing,
                       protects)


def kinds(effects):
    return [type(e).__name__ for e in effects]


def commit(flush=False):
    return Commit(ckpt=CKPT, seq=2, flush=flush, global_files=[".metadata"])


# ------------------------------------------------------------------- commit
def test_a_new_commit_is_announced_then_captured():
    effects = p.decide(state(None, manifest=None, held=False, announced=False), commit())
    assert kinds(effects) == ["Announce", "Capture"]
    assert effects[0].announced == p.Announced(2, "peer", False, (".metadata",))


def test_a_commit_heard_again_while_capturing_starts_no_second_capture():
    assert kinds(p.decide(state(None, capturing=True), commit())) == ["Announce"]


def test_a_commit_of_a_part_captured_and_held_reports_it_instead_of_capturing():
    effects = p.decide(state(entry(global_files=(".metadata",))), commit())
    assert kinds(effects) == ["Announce", "Post"]
    report = effects[1].message
    assert isinstance(report, Captured) and report.ckpt == CKPT
    assert report.global_files == [".metadata"] and report.mode == "copy"


def test_a_captured_part_no_longer_held_or_failed_is_captured_again():
    assert kinds(p.decide(state(entry(), held=False), commit()))[-1] == "Capture"
    failed = entry(commit="failed")
    assert kinds(p.decide(state(failed), commit()))[-1] == "Capture"


def test_a_flush_once_asked_for_stays_asked_for():
    effects = p.decide(state(None, flush=True, capturing=True), commit(flush=False))
    assert effects[0].announced.flush


# ------------------------------------------------------------------ captured
def captured(fed_wait=0.0):
    return Captured(ckpt=CKPT, manifest=MANIFEST.to_json(), fed_wait=fed_wait)


def test_captured_on_the_peer_path_is_protected_then_retained():
    effects = p.decide(state(entry()), captured(0.25))
    assert kinds(effects) == ["Protect", "Retain"]
    assert effects[0].fed_wait == 0.25
    assert effects[0].manifest == MANIFEST and effects[0].entry.source == f"/stage/{CKPT}"


def test_captured_and_replicated_before_a_restart_is_reported_not_sent_again():
    assert kinds(p.decide(state(entry(replicate="done")), captured())) == [
        "ReplicatedAlready", "Retain"]


def test_the_pfs_path_or_no_scheme_protects_nothing():
    assert kinds(p.decide(state(entry(), path="pfs"), captured())) == ["Retain"]
    assert kinds(p.decide(state(entry(), protects=False), captured())) == ["Retain"]


def test_a_flush_asked_for_runs_unless_its_bundle_is_done():
    assert kinds(p.decide(state(entry(), flush=True), captured())) == [
        "Protect", "Flush", "Retain"]
    done = p.decide(state(entry(flush="done", bundle="b.h5"), flush=True), captured())
    assert kinds(done) == ["Protect", "FlushedAlready", "Retain"]
    assert done[1].bundle == "b.h5"


def test_the_global_files_this_node_wrote_are_shared_once():
    effects = p.decide(state(entry(global_files=(".metadata",))), captured())
    assert kinds(effects) == ["ShareGlobals", "Protect", "Retain"]
    assert [f.path for f in effects[0].files] == [".metadata"]
    shared = entry(global_files=(".metadata",), globals_shared=True)
    assert kinds(p.decide(state(shared), captured())) == ["Protect", "Retain"]


# --------------------------------------------------------- from coordinator
def test_the_global_manifest_readies_the_group_only_with_a_captured_part():
    effects = p.decide(state(entry()), ManifestReady(ckpt=CKPT, digest=DIGEST))
    assert kinds(effects) == ["Remember", "Mirror", "GroupReady"]
    assert effects[0].fields == {"global": DIGEST.to_json()}
    assert kinds(p.decide(state(None), ManifestReady(ckpt=CKPT, digest=DIGEST))) == [
        "Mirror"]


def test_finalized_is_recorded_once():
    first = p.decide(state(entry()), Finalized(ckpt=CKPT, digest=DIGEST))
    assert kinds(first) == ["Finalize", "Retain"] and first[0].record
    again = p.decide(state(entry(commit="done")), Finalized(ckpt=CKPT, digest=DIGEST))
    assert not again[0].record


def test_protected_is_remembered_for_a_known_checkpoint_only():
    assert kinds(p.decide(state(entry()), Protected(ckpt=CKPT))) == ["Remember", "Retain"]
    assert p.decide(state(None), Protected(ckpt=CKPT)) == []


def test_a_failed_checkpoint_discards_a_stage_copy_but_never_the_spool():
    copy = p.decide(state(entry()), Failed(ckpt=CKPT, reason="r"))
    assert kinds(copy) == ["Abandon"] and copy[0].discard and copy[0].seq == 2
    by_reference = p.decide(state(entry(mode="reference")), Failed(ckpt=CKPT, reason="r"))
    assert not by_reference[0].discard


def test_a_drain_flushes_what_it_names_when_it_was_announced():
    assert kinds(p.on_drain(Drain(flush=[CKPT]))) == ["StartDrain", "WantFlush"]
    want = p.WantFlush(CKPT)
    assert kinds(p.decide(state(entry()), want)) == ["Announce", "Flush"]
    assert p.decide(state(entry(), announced=False), want) == []


# ------------------------------------------------------------------ restart
def test_a_restart_reports_captured_parts_and_resumes_cut_short_replications():
    uncommitted = state(entry(global_files=(".metadata",)))
    cut = p.CkptState("step_00001", entry(commit="done", replicate="running"),
                      MANIFEST, True, None, False, True)
    gone = p.CkptState("step_00000", entry(commit="done", replicate="running"),
                       MANIFEST, False, None, False, True)
    effects, again, adopt = p.resume([gone, cut, uncommitted], set(), {CKPT})
    assert kinds(effects) == ["ResumeProtection", "Report"]
    assert effects[0].ckpt == "step_00001"
    assert isinstance(effects[1].report, Marker) and effects[1].report.ckpt == CKPT
    assert (again, adopt) == ([], [])


def test_a_restart_captures_again_and_adopts_newer_and_says_what_it_leaves():
    running = p.CkptState("step_00003", entry(capture="running"), None, False, None,
                          False, True)
    effects, again, adopt = p.resume([running], {"step_00001", "step_00003", "step_00004"},
                                     {"step_00002", "step_00003"})
    assert again == ["step_00003"] and adopt == ["step_00004"]
    assert kinds(effects) == ["LeaveUnprotected"]
    assert effects[0].ckpts == ["step_00001"] and "older than step_00004" in effects[0].note


def test_a_marker_is_sent_for_new_or_failed_checkpoints_or_when_forced():
    assert p.marker_wanted(None, preexisting=False, force=False)
    assert not p.marker_wanted(None, preexisting=True, force=False)
    assert not p.marker_wanted(entry(), preexisting=False, force=False)
    assert p.marker_wanted(entry(capture="failed"), preexisting=False, force=False)
    assert p.marker_wanted(entry(), preexisting=True, force=True)


def test_drained_is_said_once_when_idle_or_out_of_time():
    assert p.drained(busy=False, past_deadline=False, sent=False)
    assert not p.drained(busy=True, past_deadline=False, sent=False)
    assert p.drained(busy=True, past_deadline=True, sent=False)
    assert not p.drained(busy=False, past_deadline=True, sent=True)
