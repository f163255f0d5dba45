"""The journal forgets ended checkpoints it no longer holds beyond the newest HISTORY
(stage/retention.py: forget_ended), so state.json does not grow with the run."""

from __future__ import annotations

import json

from cachex_agent.journal import Journal
from cachex_agent.layout import local_manifest_path
from cachex_agent.manifest import FileEntry, LocalManifest
from cachex_agent.stage.retention import forget_ended


def _entry(journal: Journal, seq: int, commit: str = "done", mode: str = "evicted") -> str:
    ckpt = f"step_{seq:05d}"
    journal.set_stage(ckpt, "capture", "done", seq=seq, mode=mode)
    journal.set_stage(ckpt, "commit", commit)
    journal.save_manifest(LocalManifest(run="r", ckpt=ckpt, seq=seq, node=0, host="h",
                                        rank=0, files=[FileEntry("a", 1, 0o644, "0" * 32)]))
    return ckpt


def test_ended_checkpoints_beyond_the_newest_are_forgotten_the_held_and_running_kept(tmp_path):
    journal = Journal(tmp_path / "journal")
    ended = [_entry(journal, seq) for seq in range(1, 25)]
    staged = _entry(journal, 0, mode="copy")            # oldest, but still in the stage
    running = _entry(journal, 25, commit="running")      # not ended
    replicating = ended[0]                               # ended, a stage still reads it
    gone = forget_ended(journal, {replicating}, keep_replica=4)
    assert sorted(gone) == sorted(ended[1:-4])
    left = set(json.loads((tmp_path / "journal" / "state.json").read_text())["ckpts"])
    assert left == {*ended[-4:], staged, running, replicating}
    assert not local_manifest_path(tmp_path / "journal", ended[1]).exists()
    assert local_manifest_path(tmp_path / "journal", ended[-1]).exists()
    assert forget_ended(journal, set(), keep_replica=4) == [replicating]
    assert forget_ended(journal, set(), keep_replica=4) == []
    assert forget_ended(journal, set(), keep_replica=0) == []       # keep.replica 0: keeps all
