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
