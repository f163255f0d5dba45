"""The agent's own spending, as its `counters` event reports it (usage.py)."""

from __future__ import annotations

import threading
import time

import pytest

from cachex_agent.usage import usage

pytestmark = pytest.mark.timeout(60)


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_cpu_is_counted_by_thread_role_and_in_all():
    before = usage()
    worker = threading.Thread(target=_spin, args=(0.3,), name="flush_7")
    worker.start()
    worker.join(30)
    spun, done = threading.Event(), threading.Event()
    helper = threading.Thread(target=lambda: (_spin(0.2), spun.set(), done.wait(30)),
                              name="spool-watcher:/some/spool")
    helper.start()
    assert spun.wait(30)            # the helper has spun and now waits, still alive
    after = usage()
    done.set()
    helper.join(30)
    assert after["cpu"] - before["cpu"] >= 0.45         # the ended thread's 0.3 s too
    assert 0 <= after["cpu_sys"] <= after["cpu"]
    assert after["threads"].get("spool-watcher", 0) >= 0.15
    assert "MainThread" in after["threads"] and "flush_7" not in after["threads"]
    assert set(after["switches"]) == {"voluntary", "involuntary"}
