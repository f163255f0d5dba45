"""The feed (peer/feed.py): a linked file's pieces go from the capture's hash to the
replication in the capture's own buffers, and the capture never waits on it for long.
Real threads and real files; the replication side is the main thread's API."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from cachex_agent.manifest import PENDING
from cachex_agent.peer.feed import READ, WAIT_FOR_IT, Feed, Piece
from cachex_agent.stage.capture import Plan, capture_copy, list_files

pytestmark = pytest.mark.timeout(60)
PIECE = 64 * 1024


def part(root: Path) -> dict[str, bytes]:
    files = {"a.distcp": os.urandom(3 * PIECE + 17), "b.distcp": os.urandom(PIECE),
             "empty": b"", ".metadata": os.urandom(100)}
    root.mkdir(parents=True)
    for name, data in files.items():
        (root / name).write_bytes(data)
    return files


class Wakes:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> None:
        self.count += 1


def test_pieces_come_in_the_captures_buffers_and_go_back_once_put():
    wake = Wakes()
    feed = Feed(PIECE, count=2, wake=wake)
    feed.begin("c1")
    first = feed.take()
    assert first is not None and first.nbytes == PIECE
    first[:10] = 7
    feed.give(0, 0, first, 10)
    assert wake.count == 1
    got = feed.serve("c1", 0, 0, 10, pending=True)
    assert isinstance(got, Piece) and got.data.nbytes == 10 and (got.data == 7).all()
    assert got.running is None          # hashed by the capture already
    assert feed.serve("c1", 0, 10, 5, pending=True) == WAIT_FOR_IT     # not hashed yet
    assert feed.serve("c1", 0, 10, 5, pending=False) == READ            # hashed: read it
    assert feed.serve("c2", 0, 0, 10, pending=True) == READ             # another part
    second = feed.take()
    assert second is not None
    feed.release(got)
    assert feed.take() is first         # the buffer Put came back


def test_a_capture_waits_for_a_buffer_at_most_wait_then_goes_on_without_the_feed():
    wake = Wakes()
    feed = Feed(PIECE, count=1, wait=0.05, wake=wake)
    feed.begin("c1")
    buffer = feed.take()
    assert buffer is not None
    feed.give(0, 0, buffer, PIECE)
    start = time.monotonic()
    assert feed.take() is None          # nobody Put the first piece
    assert 0.04 < time.monotonic() - start < 1.0
    assert feed.take() is None          # stopped for this part: no second wait
    assert feed.serve("c1", 0, PIECE, 5, pending=True) == READ
    # what was fed before it stopped is still served
    assert isinstance(feed.serve("c1", 0, 0, PIECE, pending=True), Piece)


def test_a_buffer_waited_for_is_handed_over_when_the_piece_is_put():
    feed = Feed(PIECE, count=1, wait=5.0)
    feed.begin("c1")
    buffer = feed.take()
    assert buffer is not None
    feed.give(0, 0, buffer, PIECE)
    taken: list[np.ndarray | None] = []
    thread = threading.Thread(target=lambda: taken.append(feed.take()))
    thread.start()
    time.sleep(0.05)
    piece = feed.serve("c1", 0, 0, PIECE, pending=True)
    assert isinstance(piece, Piece)
    feed.release(piece)
    thread.join(5)
    assert taken and taken[0] is buffer
    # the capture's wait is the replication's time, counted for the model; a new part
    # starts from nothing
    assert 0.04 < feed.waited < 5.0
    feed.begin("c2")
    assert feed.waited == 0.0


def test_a_capture_that_never_waits_counts_no_wait():
    feed = Feed(PIECE, count=2, wait=5.0)
    feed.begin("c1")
    for offset in (0, PIECE):
        buffer = feed.take()
        assert buffer is not None
        feed.give(0, offset, buffer, PIECE)
    assert feed.waited == 0.0


def test_drop_and_the_next_part_take_back_unsent_pieces():
    feed = Feed(PIECE, count=2, wait=0.01)
    feed.begin("c1")
    for offset in (0, PIECE):
        buffer = feed.take()
        assert buffer is not None
        feed.give(0, offset, buffer, PIECE)
    feed.drop("c1")
    assert feed.serve("c1", 0, 0, PIECE, pending=True) == READ
    feed.begin("c2")
    assert feed.take() is not None and feed.take() is not None     # both came back
    feed.stop()
    assert feed.serve("c2", 1, 0, 5, pending=True) == READ         # stopped: read it


def test_a_piece_of_another_length_is_not_served():
    feed = Feed(PIECE, count=1)
    feed.begin("c1")
    buffer = feed.take()
    assert buffer is not None
    feed.give(0, 0, buffer, 100)
    assert feed.serve("c1", 0, 0, 50, pending=True) == READ
    assert feed.take() is buffer        # given back, not lost


def test_a_fed_capture_announces_each_linked_file_before_and_after_its_hash(tmp_path):
    files = part(tmp_path / "spool" / "step_1")
    src = tmp_path / "spool" / "step_1"
    rels = list_files(src)
    feed = Feed(PIECE, count=2, wait=2.0)
    announced: list[tuple[int, str]] = []
    pieces: dict[tuple[int, int], bytes] = {}
    stop = threading.Event()

    wanted = sum(len(range(0, len(files[rel]), PIECE)) for rel in rels)

    def replicate() -> None:        # the main thread's side: Put (here: keep) and release
        while not stop.is_set() and len(pieces) < wanted:
            for index, rel in enumerate(rels):
                for offset in range(0, len(files[rel]), PIECE):
                    length = min(PIECE, len(files[rel]) - offset)
                    if (index, offset) in pieces:
                        continue
                    got = feed.serve("step_1", index, offset, length, pending=True)
                    if isinstance(got, Piece):
                        pieces[(index, offset)] = got.data.tobytes()
                        feed.release(got)
            time.sleep(0.001)
    thread = threading.Thread(target=replicate)
    thread.start()
    feed.begin("step_1")
    try:
        entries = capture_copy(src, tmp_path / "stage" / "step_1", rels,
                               plan=Plan(frozenset(rels)), sink=feed,
                               on_file=lambda i, e, _p: announced.append((i, e.checksum)))
        thread.join(10)     # the last pieces given are served after the capture returns
    finally:
        feed.stop()
        stop.set()
        thread.join(10)
    unfed = capture_copy(src, tmp_path / "copy" / "step_1", rels)
    assert entries == unfed                     # the same checksums, fed or not
    # each non-empty file twice: PENDING before its hash, its checksum after
    for index, entry in enumerate(entries):
        says = [c for i, c in announced if i == index]
        assert says == ([PENDING, entry.checksum] if entry.size else [entry.checksum])
    for index, rel in enumerate(rels):
        fed = b"".join(pieces[(index, o)] for o in range(0, len(files[rel]), PIECE))
        assert fed == files[rel]
