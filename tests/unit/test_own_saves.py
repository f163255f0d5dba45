"""A node's own saves under a reused name, counted (stage/saves.py, issue 44): its n-th
save is its part of version n, whatever the order of the nodes within a round; the
count goes on from the journal after a restart."""

from __future__ import annotations

import threading

from cachex_agent.journal import JournalEntry
from cachex_agent.stage.saves import OwnSaves, generation_json, save_record
from cachex_agent.status import superseded

NAME = "ckpt.pt"


def captured(ckpt: str, save: dict | None) -> JournalEntry:
    return JournalEntry(ckpt, seq=1, stages={"capture": "done"}, save=save)


def test_each_new_save_counts_once_and_the_first_is_one():
    saves = OwnSaves()
    assert saves.note(NAME, (1, 10, 100), newest=0) == 1
    assert saves.note(NAME, (1, 10, 100), newest=1) == 1      # the same save again
    assert saves.note(NAME, (1, 12, 200), newest=1) == 2
    assert saves.count(NAME) == 2 and saves.generation(NAME) == [1, 12, 200]
    assert saves.count("other.pt") == 0


def test_a_first_save_after_a_version_was_committed_is_late_for_that_version():
    """A node whose first save lands after another node's committed version 1: that
    save is its part of version 1 (captured without it, so superseded), the next one
    its part of version 2, as on the node that saved first."""
    saves = OwnSaves()
    assert saves.note(NAME, (1, 10, 100), newest=1) == 1
    assert saves.note(NAME, (1, 10, 200), newest=2) == 2
    late = OwnSaves()
    assert late.note(NAME, (1, 10, 100), newest=3) == 3


def test_a_restarted_agent_counts_on_and_takes_a_different_save_as_a_new_one():
    journal = [captured(NAME, save_record(1, (7, 10, 100))),
               captured(f"{NAME}@v2", save_record(2, (7, 10, 200)))]
    same = OwnSaves(journal)
    assert same.note(NAME, (7, 10, 200), newest=2) == 2     # what version 2 took
    moved = OwnSaves(journal)
    assert moved.note(NAME, (7, 10, 300), newest=2) == 3    # saved while no agent ran


def test_a_journal_from_before_the_counts_takes_the_save_found_as_captured():
    """No `save` recorded: the first save seen is the one the newest version took (not
    a new one); the next is the version after it. Until then the node counts no save
    of its own, so a node that never saves waits for none."""
    saves = OwnSaves([captured(NAME, None), captured(f"{NAME}@v4", None)])
    assert saves.count(NAME) == 0
    assert saves.note(NAME, (7, 10, 100), newest=4) == 0
    assert saves.note(NAME, (7, 10, 200), newest=4) == 5


def test_a_node_that_never_saved_counts_nothing_after_a_restart():
    saves = OwnSaves([captured(NAME, save_record(0, None))])
    assert saves.count(NAME) == 0
    assert saves.note(NAME, (7, 10, 100), newest=1) == 1


def test_a_save_record_not_of_the_agent_s_shape_counts_nothing():
    for record in ([3], {"count": "3"}, {"count": True}, {"count": -1}):
        assert OwnSaves([captured(NAME, record)]).count(NAME) == 0     # type: ignore[arg-type]


def test_a_failed_capture_is_no_save_taken():
    failed = JournalEntry(f"{NAME}@v2", seq=2, stages={"capture": "failed"},
                          save=save_record(2, (7, 10, 200)))
    saves = OwnSaves([captured(NAME, save_record(1, (7, 10, 100))), failed])
    assert saves.count(NAME) == 1 and saves.generation(NAME) == [7, 10, 100]


def test_a_capture_waits_for_the_count_the_watcher_reaches():
    saves = OwnSaves()
    saves.note(NAME, (1, 1, 1), newest=0)
    cancelled = threading.Event()
    assert saves.wait(NAME, 1, 0.0, cancelled)
    assert not saves.wait(NAME, 2, 0.1, cancelled)
    counter = threading.Timer(0.05, saves.note, (NAME, (1, 2, 2), 1))
    counter.start()
    assert saves.wait(NAME, 2, 30.0, cancelled)
    counter.join()
    cancelled.set()
    assert not saves.wait(NAME, 3, 30.0, cancelled)


def test_generations_compare_in_the_journal_s_form():
    assert generation_json((1, 2, 3)) == [1, 2, 3]
    assert generation_json((("COMMITTED", (1, 2, 3)),)) == [["COMMITTED", [1, 2, 3]]]
    assert generation_json(None) is None


def test_status_sums_the_superseded_saves_of_each_name_over_its_versions():
    rows = [{"id": NAME, "superseded": 2}, {"id": f"{NAME}@v2"},
            {"id": f"{NAME}@v3", "superseded": 1}, {"id": "latest@v2", "superseded": 1}]
    assert superseded({"checkpoints": rows}) == {NAME: 3, "latest": 1}
    assert superseded({"checkpoints": []}) == {}
