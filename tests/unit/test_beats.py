"""Liveness by a counter watched on the reader's own monotonic clock (beats.py), and the
run lock judged that way: no two hosts' clocks compared."""

from __future__ import annotations

import json

import pytest

from cachex_agent.beats import Unchanged, Watch
from cachex_agent.runlock import watch_lock

pytestmark = pytest.mark.timeout(20)


class Clock:
    """The reader's monotonic clock; `sleep` advances it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_unchanged_counts_how_long_a_value_stood_still():
    clock = Clock()
    seen = Unchanged(clock)
    assert seen.see(1) == 0.0 and seen.live(0.0, 10.0) is None      # one sight: unknown
    clock.now = 4.0
    assert seen.see(1) == 4.0 and seen.live(4.0, 10.0) is None
    clock.now = 5.0
    assert seen.see(2) == 0.0 and seen.live(0.0, 10.0) is True       # it moved
    clock.now = 15.5
    assert seen.see(2) == 10.5 and seen.live(10.5, 10.0) is False    # then stood still


def test_a_watch_ends_when_the_value_moves_or_stood_still_long_enough():
    clock = Clock()
    values = iter([5, 5, 5, 6])
    live, value, still = Watch(lambda: next(values), lambda v: v, poll=0.5, clock=clock,
                               sleep=clock.sleep).until_known(stale=10)
    assert (live, value, still, clock.now) == (True, 6, 0.0, 1.5)
    clock = Clock()
    live, value, still = Watch(lambda: 5, lambda v: v, poll=0.5, clock=clock,
                               sleep=clock.sleep).until_known(stale=10)
    assert (live, value) == (False, 5) and 10 < still < 10.01


def test_a_lock_whose_holder_clock_runs_ahead_is_live_while_its_beat_moves(tmp_path):
    """The issue's case: the contender's clock two minutes ahead of the holder's (or the
    holder's behind): the times in the lock and its mtime are never compared."""
    path = tmp_path / "coordinator.lock"
    clock = Clock()
    beat = {"n": 0}

    def refresh(seconds: float) -> None:
        clock.sleep(seconds)
        if clock.now >= 2 * (beat["n"] + 1):          # the holder refreshes every 2 s
            beat["n"] += 1
            path.write_text(json.dumps({"job": "a", "t": 0.0, "beat": beat["n"]}))
    path.write_text(json.dumps({"job": "a", "t": 0.0, "beat": 0}))
    live, holder, _ = watch_lock(path, clock=clock, sleep=refresh).until_known(60)
    assert live and holder["beat"] == 1 and clock.now < 2.5

    clock = Clock()
    path.write_text(json.dumps({"job": "a", "t": 9e9, "beat": 4}))     # "fresh" forever
    live, holder, still = watch_lock(path, clock=clock, sleep=clock.sleep).until_known(60)
    assert not live and still > 60 and holder["beat"] == 4
