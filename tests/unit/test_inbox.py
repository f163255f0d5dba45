"""The main loop's inbox (agent.Inbox): a put ends the main thread's sleep."""

from __future__ import annotations

import threading

import pytest

from cachex_agent.inbox import Inbox

pytestmark = pytest.mark.timeout(30)


def test_a_put_from_another_thread_ends_the_wait():
    inbox = Inbox()
    put = threading.Timer(0.05, inbox.put, args=({"type": "captured"},))
    put.start()
    inbox.wait(600)         # would outlast the test's timeout without the wake-up
    put.join()
    assert inbox.get_nowait() == {"type": "captured"}


def test_a_put_before_the_wait_is_not_lost():
    inbox = Inbox()
    inbox.put({"type": "stop"})
    inbox.wait(600)
    assert inbox.get_nowait() == {"type": "stop"}


def test_more_puts_than_the_pipe_holds_never_block():
    inbox = Inbox()
    for n in range(100_000):        # a pipe holds 65536 wake-ups
        inbox.put(n)
    inbox.wait(600)
    assert [inbox.get_nowait() for _ in range(100_000)] == list(range(100_000))
