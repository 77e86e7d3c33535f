"""Whether an async-scheduling step overlaps the next batch or runs the synchronous way.

Async scheduling pays where the engine's own work for batch N (``update_from_output``,
the step's outputs, the next ``schedule``, the frontend's output processing) runs while
the worker computes batch N+1. Where there is little to overlap it does not: a forward
shorter than that work (a few requests on a CPU), or a worker in the engine's process
whose forward is C code on every core while the engine thread runs Python. There the
worker waits for the interpreter lock after its call and for a core, and the step is
slower than the synchronous one. The outputs are the same either way: with no batch in
flight the scheduler's placeholders are back at zero and it plans as the synchronous
loop does. So the engine times both ways for each batch size and runs the faster.

Each batch size class (running requests, by powers of two) keeps the latest step
periods of each way. A class starts overlapped; every :data:`PERIOD` steps it runs
:data:`PROBE_STEPS` the other way, so either way's figure stays current as the load
moves (probes come up to 16 times less often while the other way keeps losing by more
than a quarter: little is lost to probing where the choice is clear). A step's period is the wall time from the previous batch's results to this
one's, both run the same way, in the same class, with nothing else between them (the
first step after a switch, or after the engine idled, is not counted).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from statistics import median

PERIOD = 48  # steps of one size class between two probes of the other way
MAX_PERIOD = 16 * PERIOD  # where the other way keeps losing by a wide margin
WIDE = 1.25  # the other way's median period this much longer: probe it half as often
PROBE_STEPS = 6  # steps of the other way per probe (the first is not counted)
KEPT = 15  # periods kept per way and class: the median of these decides
MIN_SAMPLES = 3  # periods a way needs before it can be chosen over overlapping
MARGIN = 1.05  # the other way must measure this much faster to be switched to
IDLE_GAP_S = 0.25  # a longer gap between two batches' results is the engine idling


class _SizeClass:
    __slots__ = ("period", "periods", "probe_left", "until_probe", "way")

    def __init__(self) -> None:
        self.way = True  # overlap, until the synchronous way measures faster
        self.period = PERIOD
        self.until_probe = PERIOD - PROBE_STEPS  # steps the chosen way, then a probe
        self.probe_left = 0  # steps of the probe still to run
        self.periods: dict[bool, deque[float]] = {
            True: deque(maxlen=KEPT),
            False: deque(maxlen=KEPT),
        }

    def next_way(self) -> bool:
        if self.probe_left:  # a probe runs the other way throughout, whatever it measures
            self.probe_left -= 1
            return not self.way
        if self.until_probe:
            self.until_probe -= 1
            self.way = self._faster()
            return self.way
        # A probe is due: spaced out while the other way keeps losing by a wide margin.
        other, chosen = self.periods[not self.way], self.periods[self.way]
        wide = bool(other and chosen) and median(other) > WIDE * median(chosen)
        self.period = min(2 * self.period, MAX_PERIOD) if wide else PERIOD
        self.until_probe = self.period - PROBE_STEPS
        self.probe_left = PROBE_STEPS - 1
        return not self.way

    def _faster(self) -> bool:
        """True (overlap) unless the synchronous way has measured faster; the way in
        use is kept unless the other is faster by :data:`MARGIN` (no flapping between
        two ways that measure alike)."""
        overlapped, synchronous = self.periods[True], self.periods[False]
        if len(synchronous) < MIN_SAMPLES or len(overlapped) < MIN_SAMPLES:
            return True
        if self.way:
            return not MARGIN * median(synchronous) < median(overlapped)
        return MARGIN * median(overlapped) < median(synchronous)


class OverlapChoice:
    """Chooses, step by step, whether the engine overlaps the next batch with its work
    for the current one; ``adaptive=False`` always overlaps."""

    def __init__(self, adaptive: bool, clock: Callable[[], float] = time.perf_counter) -> None:
        self.adaptive = adaptive
        self._clock = clock
        self._classes: dict[int, _SizeClass] = {}
        self._size = 1  # requests in the last batch with results
        self._last: tuple[float, bool, int] | None = None  # results' time, way, class
        self._run = 0  # batches with results in a row the same way, in the same class
        #: Steps run each way (overlapped, synchronous): what the tests and logs read.
        self.counts = {True: 0, False: 0}

    def overlap(self) -> bool:
        """Whether the next step overlaps: decided for the size of the last batch."""
        if not self.adaptive:
            return True
        size_class = self._classes.setdefault(self._size.bit_length(), _SizeClass())
        return size_class.next_way()

    def completed(self, num_requests: int, overlapped: bool) -> None:
        """A batch of ``num_requests`` requests returned its results from a step run
        the ``overlapped`` way (or the synchronous way)."""
        self.counts[overlapped] += 1
        if not self.adaptive:
            return
        now = self._clock()
        key = num_requests.bit_length()
        last = self._last
        if last is not None and last[1] == overlapped and last[2] == key:
            self._run += 1
            period = now - last[0]
            if period > IDLE_GAP_S:
                self._run = 0
            elif self._run >= 2:  # the first period after a switch holds the switch
                self._classes.setdefault(key, _SizeClass()).periods[overlapped].append(period)
        else:
            self._run = 0
        self._last = (now, overlapped, key)
        self._size = num_requests
