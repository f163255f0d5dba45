"""Stage retention (stage/retention.py) with a real journal and stage directories: a
copy that holds a checkpoint's only protection is never evicted before a newer one
holds as much."""

from __future__ import annotations

import pytest

from cachex_agent.events import EventLog, read_events
from cachex_agent.handles import Stage, State
from cachex_agent.journal import Journal
from cachex_agent.layout import NodePaths
from cachex_agent.stage.remover import Remover
from cachex_agent.stage.retention import retain_stage

pytestmark = pytest.mark.timeout(30)


class Node:
    def __init__(self, root) -> None:
        self.paths = NodePaths.of_run(root / "spool", root / "shm", root / "nvme",
                                      root / "pfs", "t")
        self.journal = Journal(self.paths.journal)
        self.events = EventLog(root / "events.jsonl")
        self.flushing: set[str] = set()         # checkpoints whose commit says flush

    def captured(self, seq: int, flush: bool = False, **stages: str) -> str:
        ckpt = f"step_{seq}"
        self.paths.stage_dir(ckpt).mkdir(parents=True)
        self.journal.set_stage(ckpt, Stage.CAPTURE, State.DONE, seq=seq, mode="copy")
        for stage, state in stages.items():
            self.journal.set_stage(ckpt, Stage(stage), State(state))
        if flush:
            self.flushing.add(ckpt)
        return ckpt

    def retain(self, keep: int = 1) -> list[str]:
        remover = Remover()
        try:
            return retain_stage(keep, self.journal, self.paths, set(),
                                lambda c: c in self.flushing, self.events, remover)
        finally:
            assert remover.close(10)

    def staged(self) -> list[str]:
        return sorted(p.name for p in self.paths.stage.iterdir())


def test_an_unflushed_replicated_copy_stays_until_a_newer_one_is_replicated_everywhere(
        tmp_path):
    node = Node(tmp_path)
    node.captured(1, flush=True, commit="done")             # flushed: on the PFS
    node.captured(2, replicate="done")                      # replicated, flush.every
    node.journal.update("step_2", protected=True)
    node.captured(3, replicate="done")                      # this node's part only
    assert node.retain() == []
    assert node.staged() == ["step_2", "step_3"]            # step_1 is on the PFS
    node.journal.update("step_3", protected=True)           # every node replicated it
    assert node.retain() == ["step_2"]
    assert node.staged() == ["step_3"]
    assert [e["ckpt"] for e in read_events(node.events.path) if e["event"] == "evicted"] \
        == ["step_1", "step_2"]


def test_a_newer_flushed_checkpoint_also_lets_an_unflushed_one_go(tmp_path):
    node = Node(tmp_path)
    node.captured(1, replicate="done")
    node.captured(2, replicate="done")
    assert node.retain() == [] and node.staged() == ["step_1", "step_2"]
    node.captured(3, flush=True, commit="done")
    assert sorted(node.retain(keep=1)) == ["step_1", "step_2"]
    assert node.staged() == ["step_3"]


def test_a_flushed_copy_goes_as_soon_as_it_is_beyond_keep(tmp_path):
    """On the PFS already: evicting its stage copy costs no level."""
    node = Node(tmp_path)
    node.captured(1, flush=True, commit="done")
    node.captured(2, flush=True)                            # still to be flushed
    assert node.retain() == []                              # not committed: nothing said
    assert node.staged() == ["step_2"]
    node.captured(3)
    assert node.retain(keep=1) == []                        # step_2's flush needs it
    assert node.staged() == ["step_2", "step_3"]


def entry(seq: int, mode: str = "copy", protected: bool = False, **stages: str):
    from cachex_agent.journal import JournalEntry
    return JournalEntry(f"step_{seq}", seq=seq, stages={"capture": "done", **stages},
                        mode=mode, protected=protected)


def test_evictable_is_a_pure_choice_over_typed_entries():
    from cachex_agent.stage.retention import evictable, forgettable
    entries = [entry(1, commit="done"), entry(2, protected=True), entry(3)]
    never = lambda _c: False    # noqa: E731
    # step_3 newest staged: kept; step_2 unflushed and nothing newer protected: kept
    assert [e.ckpt for e in evictable(entries, 1, set(), never)] == ["step_1"]
    assert evictable(entries, 1, {"step_1"}, never) == []       # a stage still reads it
    assert evictable(entries, 0, set(), never) == []            # keep.stage 0: keep all
    protected = [*entries[:2], entry(3, protected=True)]
    assert [e.ckpt for e in evictable(protected, 1, set(), never)] == ["step_2", "step_1"]
    assert [e.ckpt for e in evictable(protected, 1, set(), lambda c: c == "step_2")] == [
        "step_1"]                                               # its flush still needs it
    newer = [*entries, entry(4, mode="reference", commit="done")]  # finalized, newer
    assert [e.ckpt for e in evictable(newer, 1, set(), never)] == ["step_2", "step_1"]
    ended = [entry(s, mode="evicted", commit="done") for s in range(1, 8)]
    assert forgettable(ended, set(), keep_replica=2) == ["step_3", "step_2", "step_1"]
    assert forgettable(ended, {"step_1"}, keep_replica=2) == ["step_3", "step_2"]
    assert forgettable(ended, set(), keep_replica=0) == []
