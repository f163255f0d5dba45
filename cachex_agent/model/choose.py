"""The online path choice (`model.path = "auto"`): peer-then-PFS or direct-to-PFS, per
checkpoint, whichever the model of the recent checkpoints says loses less work.

The coordinator feeds it every node's stage durations as they are reported and asks it
once per commit. Until every stage has samples the answer is the default path (peer);
a run of `model.explore` direct checkpoints is followed by one peer checkpoint, so the
replication estimate does not go stale while it is not used. The other path must be
better by `MARGIN` to switch, so noise does not flip the choice at every checkpoint; the
margin applies to the part of the expected loss the path changes (beyond T/2 per failure).

The Monte Carlo behind a choice takes tens of milliseconds, and every agent waits for the
commit that carries the path. So after each choice the coordinator's model lane prepares
the plans for the next checkpoint of about the same size (and, while learning, imports
scipy, which took a second at the first choice); the commit then decides on them at once
(`choose_prepared`), a few samples behind at most, and only a commit of another size
waits for its own.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

from ..config import Config
from .distributions import have_scipy, scipy_module
from .history import StageSample
from .plan import PathPlan, Rates, evaluate
from .predict import SystemModel
from .protection import Protection
from .stages import MIN_SAMPLES, fit_stage

LEARNED = ("capture", "replicate", "flush")
# a stage is fitted on at most this many of its samples, evenly spread over them: at
# 10,000 nodes the window held 80,000 a stage, and each status's forecast refitted them
# all (a fifth of the coordinator's CPU per checkpoint); a lognormal's two parameters
# and the spread between checkpoints need far fewer
FIT_SAMPLES = 2048
MARGIN = 0.10
DEFAULT_PERIOD = 600.0
SAMPLES = 2000          # Monte Carlo per decision: a few tens of milliseconds
SAME_SIZE = 0.10        # prepared plans serve a commit within this fraction of their size


@dataclass(frozen=True)
class Choice:
    path: str
    reason: str
    loss: dict[str, float] | None = None    # expected seconds lost per hour, per path


def fixed_choice(mode: str, can_replicate: bool) -> Choice | None:
    """The path when no model is consulted (a fixed `model.path`, or no partner)."""
    if mode != "auto":
        return Choice(mode, f"model.path = {mode}")
    if not can_replicate:
        return Choice("direct", "no partner in another failure domain (flush-only)")
    return None


def thinned(samples: deque[StageSample]) -> list[StageSample]:
    """At most FIT_SAMPLES of `samples`, every k-th (each checkpoint keeps its share)."""
    step = -(-len(samples) // FIT_SAMPLES)
    return list(samples)[::max(1, step)]


class PathChooser:
    def __init__(self, config: Config, nodes: int, can_replicate: bool) -> None:
        self.mode = config.model.path
        self.rates = Rates.of(config.model)
        self.explore = config.model.explore
        self.nodes = nodes
        self.can_replicate = can_replicate
        self.protection = Protection.of(config.peer, nodes)     # what `replicated` survives
        depth = config.model.window * nodes
        self.samples: dict[str, deque[StageSample]] = {s: deque(maxlen=depth) for s in LEARNED}
        self.commits: deque[float] = deque(maxlen=config.model.window + 1)
        self.current = "peer"
        self.direct_run = 0
        self._lock = threading.Lock()       # the commit's thread and the model's lane
        self._prepared: tuple[float, dict[str, PathPlan], float] | None = None
        self._fitted: tuple[int, SystemModel] | None = None     # (observations, model)
        self.observations = 0

    def observe(self, stage: str, ckpt: str, node: int, nbytes: int, seconds: float) -> None:
        if stage in self.samples and nbytes > 0 and seconds > 0:
            self.samples[stage].append(StageSample("", ckpt, node, self.nodes, stage, nbytes,
                                                   seconds, 0.0, ""))
            self.observations += 1

    def forecast(self, size: float, path: str) -> dict[str, dict[str, float]] | None:
        """Seconds from the commit of a checkpoint of `size` bytes on `path` to each of
        its levels: `median` and `p95`. None while a stage it needs has too few samples
        or the model's libraries are missing: no prediction yet."""
        stages = LEARNED if path == "peer" else ("capture", "flush")
        if size <= 0 or not have_scipy() or any(
                len(self.samples[s]) < MIN_SAMPLES for s in stages):
            return None
        model = self._model()
        levels = ("captured", "replicated", "flushed") if path == "peer" else (
            "captured", "flushed")
        predicted = {level: model.predict(level, path, size, self.nodes, SAMPLES)
                     for level in levels}
        return {level: {"median": p.quantile(0.5), "p95": p.quantile(0.95)}
                for level, p in predicted.items()}

    def _model(self) -> SystemModel:
        """The stages fitted on the samples so far; refitted only after new ones."""
        if self._fitted is None or self._fitted[0] != self.observations:
            model = SystemModel({s: fit_stage(thinned(q), families=("lognormal",))
                                 for s, q in self.samples.items()}, {})
            self._fitted = (self.observations, model)
        return self._fitted[1]

    def choose(self, size: float, now: float) -> Choice:
        """The choice for a commit of `size` bytes at `now`, its plans computed now."""
        with self._lock:
            self.commits.append(now)
        return self._chosen(self._decide(size, lambda: self._plans(size)))

    def choose_prepared(self, size: float, now: float) -> Choice | None:
        """The choice on the plans `prepare` made for about this size; None without."""
        with self._lock:
            prepared, self._prepared = self._prepared, None
            if prepared is None or abs(size - prepared[0]) > SAME_SIZE * prepared[0]:
                return None
            self.commits.append(now)
        return self._chosen(self._decide(size, lambda: prepared[1:]))

    def prepare(self, size: float) -> None:
        """The plans for the next commit of about `size` bytes (on the model's lane);
        while learning, scipy imported, so that the first model's choice does not."""
        if self.mode == "auto" and have_scipy():
            scipy_module("stats"), scipy_module("special")
        if self._without_model(size) is None:
            plans = self._plans(size)
            with self._lock:
                self._prepared = (size, *plans)

    def _chosen(self, choice: Choice) -> Choice:
        with self._lock:
            self.direct_run = self.direct_run + 1 if choice.path == "direct" else 0
            self.current = choice.path
        return choice

    def _without_model(self, size: float) -> Choice | None:
        """The choice that needs no model, if there is one now."""
        fixed = fixed_choice(self.mode, self.can_replicate)
        if fixed is not None:
            return fixed
        if not have_scipy():
            return Choice("peer", "the model's libraries are not installed"
                                  " (pip install 'cachex-agent[model]'): the default path")
        short = [s for s in LEARNED if len(self.samples[s]) < MIN_SAMPLES]
        if short or size <= 0:
            return Choice("peer", f"learning: too few samples of {', '.join(short) or 'size'}")
        if self.explore and self.direct_run >= self.explore:
            return Choice("peer", f"exploring: {self.direct_run} direct checkpoints in a row,"
                                  " refreshing the replication estimate")
        return None

    def _plans(self, size: float) -> tuple[dict[str, PathPlan], float]:
        model = self._model()
        period = self.period()
        return {p: evaluate(model, p, 1, size, self.nodes, period, self.rates, SAMPLES,
                            self.protection) for p in ("peer", "direct")}, period

    def _decide(self, size: float,
                plans_of: Callable[[], tuple[dict[str, PathPlan], float]]) -> Choice:
        due = self._without_model(size)
        if due is not None:
            return due
        plans, period = plans_of()
        other = "direct" if self.current == "peer" else "peer"
        better = plans[other].excess < (1 - MARGIN) * plans[self.current].excess
        pick = other if better else self.current
        loss = {p: plan.loss for p, plan in plans.items()}
        reason = (f"expected loss {loss['peer']:.3g} s/h peer vs {loss['direct']:.3g} s/h"
                  f" direct; safe from node loss after {plans['peer'].lag['node']:.2f} s vs"
                  f" {plans['direct'].lag['node']:.2f} s (period {period:.0f} s)")
        return Choice(pick, reason, loss)

    def period(self) -> float:
        with self._lock:
            times = list(self.commits)
        gaps = [b - a for a, b in pairwise(times) if b > a]
        return statistics.median(gaps) if gaps else DEFAULT_PERIOD
