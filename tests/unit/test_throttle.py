"""TokenBucket on a fake clock: no wall-clock timing anywhere."""

from __future__ import annotations

import threading

import pytest

from cachex_agent.flush.throttle import MiB, TokenBucket, default_burst


class FakeClock:
    """`sleep` advances `now`; nothing really waits."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.slept += seconds
        self.now += seconds


def bucket(rate: float, burst: float | None = None) -> tuple[TokenBucket, FakeClock]:
    clock = FakeClock()
    return TokenBucket(rate, burst, clock=clock, sleep=clock.sleep), clock


def test_ten_seconds_worth_takes_ten_seconds() -> None:
    rate = 100 * MiB
    tb, clock = bucket(rate)
    chunk = 8 * MiB
    total = 0
    while total < rate * 10:
        n = min(chunk, rate * 10 - total)
        tb.consume(n)
        total += n
    # The initial burst goes free, everything else at the rate.
    assert clock.slept == pytest.approx(10 - tb.burst / rate, abs=1e-6)
    assert 10 - tb.burst / rate - 1e-6 <= clock.slept <= 10


def test_rate_holds_with_small_requests_and_real_elapsed_time() -> None:
    rate = 10 * MiB
    tb, clock = bucket(rate, burst=MiB)
    start = clock.now
    for _ in range(1000):
        tb.consume(100 * 1024)
        clock.now += 0.001          # work between chunks refills part of the bucket
    elapsed = clock.now - start
    assert 1000 * 100 * 1024 <= MiB + rate * elapsed + 1e-3


def test_unlimited_never_sleeps() -> None:
    tb, clock = bucket(0)
    for _ in range(100):
        assert tb.consume(1 << 30) == 0.0
    assert clock.slept == 0.0
    assert tb.unlimited


def test_request_beyond_burst_borrows() -> None:
    tb, clock = bucket(MiB, burst=MiB)
    slept = tb.consume(5 * MiB)
    assert slept == pytest.approx(4.0)         # 1 MiB from the full bucket, 4 borrowed
    assert tb.consume(MiB) == pytest.approx(1.0)  # the debt was paid by the sleep


def test_idle_refill_is_capped_at_burst() -> None:
    tb, clock = bucket(MiB, burst=2 * MiB)
    tb.consume(2 * MiB)
    clock.now += 3600
    assert tb.consume(2 * MiB) == 0.0
    assert tb.consume(MiB) == pytest.approx(1.0)


def test_default_burst() -> None:
    assert default_burst(0) == MiB
    assert default_burst(MiB) == MiB
    assert default_burst(1000 * MiB) == pytest.approx(100 * MiB)
    assert TokenBucket(500 * MiB).burst == pytest.approx(50 * MiB)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        TokenBucket(-1)
    with pytest.raises(ValueError):
        TokenBucket(MiB, burst=0)


def test_zero_bytes_is_free() -> None:
    tb, clock = bucket(1)
    assert tb.consume(0) == 0.0
    assert clock.slept == 0.0


def test_threads_share_one_debt() -> None:
    # A clock that never moves: each caller's wait is its place in the queue, so the
    # longest wait must be exactly the whole debt if no update was lost.
    waits: list[float] = []
    lock = threading.Lock()

    def record(seconds: float) -> None:
        with lock:
            waits.append(seconds)

    rate, burst, n, per = float(MiB), float(MiB), 8, 64 * 1024
    tb = TokenBucket(rate, burst, clock=lambda: 0.0, sleep=record)

    def worker() -> None:
        for _ in range(50):
            tb.consume(per)

    threads = [threading.Thread(target=worker) for _ in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert max(waits) == pytest.approx((n * 50 * per - burst) / rate)
