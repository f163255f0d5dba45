"""A lane (lanes.py) with a real worker thread held up the way a hung PFS holds it."""

from __future__ import annotations

import threading

from cachex_agent.lanes import MAX_PENDING, Lane

WAIT = 30.0         # a bound, never expected to be reached


def blocked_lane() -> tuple[Lane, threading.Event, threading.Event]:
    lane = Lane("test")
    started, release = threading.Event(), threading.Event()

    def hang() -> None:
        started.set()
        assert release.wait(WAIT)
    assert lane.offer("hang", hang)
    assert started.wait(WAIT)
    return lane, started, release


def test_snapshots_offered_while_it_hangs_coalesce_latest_wins():
    lane, _, release = blocked_lane()
    done: list[str] = []
    for i in range(100):
        assert lane.offer("status", lambda i=i: done.append(f"status {i}"))   # never blocks
    assert lane.offer(("finalize", "s1"), lambda: done.append("finalize s1"))
    assert lane.offer("index", lambda: done.append("index"))
    assert lane.offer("status", lambda: done.append("status last"))
    assert lane.pending() == 4              # the hung one and three keys, not 103 items
    release.set()
    assert lane.close(WAIT)
    # one status write, the newest, after what was offered before it
    assert done == ["finalize s1", "index", "status last"]


def test_a_full_lane_refuses_new_keys_and_close_gives_up_on_a_hung_one():
    lane, _, release = blocked_lane()
    for i in range(MAX_PENDING):
        assert lane.offer(i, lambda: None)
    assert not lane.offer("one more", lambda: None)
    assert lane.offer(0, lambda: None)          # a pending key is still replaced
    assert not lane.close(0.05)                 # hung: close returns, work left behind
    assert not lane.offer("after close", lambda: None)
    release.set()


def test_an_unthreaded_lane_works_at_once():
    done: list[int] = []
    lane = Lane("inline", threaded=False)
    assert lane.offer("k", lambda: done.append(1)) and done == [1]
    assert lane.close(0)
