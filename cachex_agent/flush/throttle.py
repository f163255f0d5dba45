"""An enforced byte-rate limit for the flush (`flush.bandwidth`).

A token bucket: tokens are bytes, refilled at `rate` per second up to `burst`. A caller
asks for n bytes *before* moving them and is put to sleep until they are allowed, so the
bytes moved by time t never exceed `burst + rate * t`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

MiB = 1024 * 1024


def default_burst(rate: float) -> float:
    """100 ms worth of traffic, at least 1 MiB.

    Small enough that the limit holds over any interval a user would look at (a second),
    large enough that a slow rate does not turn every small write into a sleep.
    """
    return max(rate * 0.1, float(MiB))


class TokenBucket:
    """`consume(n)` blocks until n more bytes fit the rate; `rate=0` means unlimited.

    A request larger than the burst is not refused: it borrows, i.e. the bucket goes into
    debt and the caller sleeps for the deficit, so a chunk of any size still respects the
    average rate. Thread-safe: one lock guards the bucket, and sleeps happen outside it;
    a caller that arrives while others are in debt waits behind their debt too.
    `clock` and `sleep` are injectable so tests run on a fake clock.
    """

    def __init__(self, rate: float, burst: float | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if rate < 0:
            raise ValueError(f"rate must be >= 0 bytes/s, got {rate!r}")
        if burst is not None and burst <= 0:
            raise ValueError(f"burst must be > 0 bytes, got {burst!r}")
        self.rate = float(rate)
        self.burst = float(burst) if burst is not None else default_burst(self.rate)
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._tokens = self.burst      # start full: the first burst goes at once
        self._last = clock()

    @property
    def unlimited(self) -> bool:
        return self.rate <= 0

    def consume(self, n: int) -> float:
        """Block until `n` bytes are allowed; return the seconds slept."""
        if self.unlimited or n <= 0:
            return 0.0
        wait = self._reserve(n)
        if wait > 0:
            self._sleep(wait)
        return wait

    def _reserve(self, n: int) -> float:
        """Take n tokens now (possibly going negative) and say how long to wait for them."""
        with self._lock:
            now = self._clock()
            elapsed = max(0.0, now - self._last)
            self._tokens = min(self.burst, self._tokens + elapsed * self.rate)
            self._last = now
            self._tokens -= n
            return -self._tokens / self.rate if self._tokens < 0 else 0.0
