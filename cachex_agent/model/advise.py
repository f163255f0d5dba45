"""How often to save: the interval that minimises the expected lost time (`cachex advise`).

Per hour of run, with saves every T seconds, the time lost is

    W(T) = E[C] / T + sum_c lambda_c E[L_c](T) / 3600      (a fraction of the run)

E[C] the trainer's blocked time per save (the slowest node's write: the blocking term is
linear in C, so its mean is exact), lambda_c the combined rate of failure kind c
(rates.py) and E[L_c](T) the work one failure of kind c loses with each level's fitted
time-to-durability distribution D_c (plan.class_losses: the whole distribution enters,
not its mean, as does the share of node losses beyond the redundancy's tolerance).
W is minimised over T by a log grid, then Brent's method around the grid's best.

The same for a trainer writing straight to the PFS: blocked for the slowest node's flush
(the fitted `flush` stage), safe from every kind once the write returns (D_c = C).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..config import Config
from .history import History
from .plan import CLASSES, HOUR, Rates, class_losses, durabilities
from .predict import SystemModel
from .protection import Protection
from .rates import LEVEL, KindRate

MIN_SAMPLES = 10            # fewer samples of a stage than this: its fit is said to be rough
MIN_SAVES = 5               # whole saves needed to judge how the nodes move together
KEEP_UP = 0.9               # a level keeps up when this share of saves reach it within T
SAMPLES = 4000
LONGEST = 7 * 24 * HOUR
STAGES = ("write", "capture", "replicate", "flush")


@dataclass(frozen=True)
class Losses:
    """What an interval is judged on: the blocked time per save and D_c per kind."""
    stall: float
    lags: dict[str, np.ndarray]
    path: str                   # plan.py's: "peer" falls back to flushed beyond tolerance

    def waste(self, period: float, rates: Rates, nodes: int, protection: Protection) -> float:
        """W(T), a fraction of the run's time."""
        lost, _ = class_losses(self.lags, self.path, 1, period, rates, nodes, protection, 0)
        per_hour = rates.per_hour(nodes)
        return self.stall / period + sum(per_hour[c] * lost[c] for c in CLASSES) / HOUR

    def best(self, rates: Rates, nodes: int, protection: Protection) -> tuple[float, float]:
        """The interval minimising W, and W there."""
        from scipy.optimize import minimize_scalar
        if sum(rates.per_hour(nodes).values()) == 0:
            return LONGEST, self.stall / LONGEST        # nothing fails: save seldom
        def at(log_t: float) -> float:
            return self.waste(math.exp(log_t), rates, nodes, protection)
        grid = np.linspace(math.log(max(self.stall, 1e-3)), math.log(LONGEST), 48)
        values = [at(x) for x in grid]
        i = int(np.argmin(values))
        low, high = grid[max(i - 1, 0)], grid[min(i + 1, grid.size - 1)]
        found = minimize_scalar(at, bounds=(low, high), method="bounded",
                                options={"xatol": 1e-4})
        if found.fun > values[i]:
            return float(math.exp(grid[i])), float(values[i])
        return float(math.exp(found.x)), float(found.fun)


@dataclass(frozen=True)
class Option:
    name: str
    losses: Losses
    current: float              # the interval in use, seconds
    interval: float             # advised
    range: tuple[float, float]  # advised at the rates' 95% and 5% ends (shortest first)
    waste_now: float            # fractions of the run's time
    waste_advised: float

    def to_json(self) -> dict[str, Any]:
        lag = {c: float(np.median(self.losses.lags[c])) for c in CLASSES}
        return {"name": self.name, "stall": self.losses.stall, "lag_median": lag,
                "interval": self.interval, "interval_range": list(self.range),
                "waste_per_hour_now": self.waste_now * HOUR,
                "waste_per_hour_advised": self.waste_advised * HOUR}


@dataclass(frozen=True)
class Advice:
    size: float
    nodes: int
    current: float
    rates: dict[str, KindRate]
    tier: Option
    direct: Option | None
    young: float | None         # Young's sqrt(2C/lambda) with the tier's C, for reference
    independent: float          # as how many independent nodes the slowest write behaves
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "nodes": self.nodes, "current_interval": self.current,
                "advised_interval": self.tier.interval, "young": self.young,
                "independent_nodes": self.independent,
                "rates": {k: r.to_json() for k, r in self.rates.items()},
                "protects": dict(LEVEL), "tier": self.tier.to_json(),
                "direct_to_pfs": self.direct.to_json() if self.direct else None,
                "notes": list(self.notes)}


def slowest(stage: Any, size: float, nodes: int, independent: float,
            rng: np.random.Generator) -> np.ndarray:
    """Samples of the slowest node's time in `stage` for a checkpoint of `size` on `nodes`
    nodes that behave as `independent` independent ones."""
    u = rng.uniform(1e-9, 1 - 1e-9, size=SAMPLES) ** (1.0 / independent)
    return np.asarray(stage.ppf(u, size / nodes, nodes), dtype=float)


def independent_nodes(model: SystemModel, history: History, nodes: int) -> tuple[float, int]:
    """As how many independent nodes the slowest write behaves, and over how many saves.

    Nodes of one job slow down together (a shared PFS, a shared switch, here shared
    cores), so the slowest of N is faster than the largest of N independent draws. With
    u_i = F(slowest write of save i) under one node's fitted F, -log u_i is exponential
    with rate n for the largest of n independent nodes: n = count / sum(-log u_i), kept
    within [1, N]. Too few whole saves: N (the independent, slower, premise)."""
    write = model.stages.get("write")
    saves: dict[tuple[str, str], list[Any]] = defaultdict(list)
    for s in history.stage("write"):
        if s.nodes == nodes:
            saves[(s.run, s.ckpt)].append(s)
    whole = [max(g, key=lambda s: s.seconds) for g in saves.values() if len(g) == nodes]
    if write is None or len(whole) < MIN_SAVES:
        return float(nodes), len(whole)
    u = np.array([float(write.cdf(np.array([s.seconds]), s.bytes, nodes)[0]) for s in whole])
    n = len(u) / float(np.sum(-np.log(np.clip(u, 1e-12, 1 - 1e-12))))
    return float(min(max(n, 1.0), nodes)), len(whole)


def tier_losses(model: SystemModel, size: float, nodes: int, independent: float) -> Losses:
    path = "peer" if "replicate" in model.stages else "direct"
    write = model.stages.get("write")
    stall = (float(np.mean(slowest(write, size, nodes, independent, np.random.default_rng(3))))
             if write else 0.0)
    return Losses(stall, durabilities(model, path, size, nodes, SAMPLES), path)


def direct_losses(model: SystemModel, size: float, nodes: int, independent: float
                  ) -> Losses | None:
    """The trainer writing to the PFS itself: blocked for the flush, then safe."""
    flush = model.stages.get("flush")
    if flush is None:
        return None
    blocked = slowest(flush, size, nodes, independent, np.random.default_rng(4))
    return Losses(float(np.mean(blocked)), {c: blocked for c in CLASSES}, "direct")


def option(name: str, losses: Losses, current: float, rates: dict[str, KindRate], nodes: int,
           protection: Protection) -> Option:
    mid = Rates(*(rates[k].rate for k in ("crash", "node", "job")))
    interval, waste = losses.best(mid, nodes, protection)
    ends = [losses.best(Rates(*(getattr(rates[k], end) for k in ("crash", "node", "job"))),
                        nodes, protection)[0] for end in ("high", "low")]
    return Option(name, losses, current, interval, (ends[0], ends[1]),
                  losses.waste(current, mid, nodes, protection), waste)


def advise(model: SystemModel, history: History, config: Config, size: float, nodes: int,
           current: float, rates: dict[str, KindRate]) -> Advice:
    protection = Protection.of(config.peer, nodes)
    independent, saves = independent_nodes(model, history, nodes)
    tier = option("cachex tier", tier_losses(model, size, nodes, independent), current, rates,
                  nodes, protection)
    plain = direct_losses(model, size, nodes, independent)
    direct = (option("straight to the PFS", plain, current, rates, nodes, protection)
              if plain else None)
    total = sum(rates[k].rate * (nodes if k == "node" else 1) for k in rates) / HOUR
    young = math.sqrt(2 * tier.losses.stall / total) if total and tier.losses.stall else None
    notes = (sample_notes(model, saves) + rate_notes(rates)
             + keep_up_notes(tier, config.flush.concurrency))
    if direct is None:
        notes.append("no flush samples: the figures for writing straight to the PFS are"
                     " missing")
    return Advice(size, nodes, current, rates, tier, direct, young, independent, notes)


def sample_notes(model: SystemModel, saves: int) -> list[str]:
    whole = ([f"only {saves} saves with every node's write (want {MIN_SAVES}): the blocked"
              " time takes the nodes as independent (the slower premise)"]
             if saves < MIN_SAVES else [])
    return whole + [f"only {model.counts.get(name, 0)} samples of the {name} stage (want"
            f" {MIN_SAMPLES}): its fit, and the advice, are rough"
            for name in STAGES if name in model.stages
            and model.counts.get(name, 0) < MIN_SAMPLES]


def rate_notes(rates: dict[str, KindRate]) -> list[str]:
    notes = []
    defaults = [k for k, r in rates.items() if r.from_defaults_only]
    if defaults:
        notes.append(f"the {', '.join(defaults)} rate(s) are site defaults only, no failure"
                     " of the run recorded: set model.*_rate to the site's figures")
    wide = [k for k, r in rates.items() if r.rate and r.high > 10 * r.low]
    if wide:
        notes.append(f"the {', '.join(wide)} rate(s) are uncertain beyond 10x (90% interval):"
                     " the advised interval's range says what that does")
    return notes


def keep_up_notes(tier: Option, concurrency: int) -> list[str]:
    """Levels slower than the advised interval: E[L] assumes saves do not queue."""
    notes = []
    lags, interval = tier.losses.lags, tier.interval
    if tier.losses.path == "peer":
        reach = float(np.quantile(lags["node"], KEEP_UP))
        if reach > interval:
            notes.append(f"replicated cannot keep up: {KEEP_UP:.0%} of saves reach it"
                         f" {reach:.3g} s after they start, over the advised interval"
                         f" {interval:.3g} s (a save would start before the previous one is"
                         " replicated)")
    flushed = float(np.quantile(lags["job"], KEEP_UP)) / max(concurrency, 1)
    if flushed > interval:
        notes.append(f"flushed cannot keep up: {flushed:.3g} s per save with"
                     f" flush.concurrency {concurrency}, over the advised interval"
                     f" {interval:.3g} s (flushes would queue; flush.every > 1 or a longer"
                     " interval)")
    return notes


# ------------------------------------------------------------------------ views
def advice_text(advice: Advice) -> str:
    from ..status import human_size
    lines = [f"advice for {human_size(advice.size)} on {advice.nodes} nodes, saving every"
             f" {advice.current:.3g} s now",
             "failure rates (90% interval) and their sources:"]
    for r in advice.rates.values():
        lines.append(f"  {r.kind:5} {r.rate:.3g} {r.unit} ({r.low:.2g}-{r.high:.2g}):"
                     f" {r.source()}")
    tier = advice.tier
    lag = {c: float(np.median(tier.losses.lags[c])) for c in CLASSES}
    lines.append("protects: " + "; ".join(
        f"{c} <- {LEVEL[c] if tier.losses.path == 'peer' or c != 'node' else 'flushed'}"
        f" (median {lag[c]:.3g} s after the save starts)" for c in CLASSES))
    lines.append(f"blocked time: the slowest node's write, the {advice.nodes} nodes behaving"
                 f" as {advice.independent:.2g} independent ones")
    lines.append(f"{'':22} {'blocked/save':>12} {'waste now':>12} {'advised':>10}"
                 f" {'(rates 5-95%)':>16} {'waste then':>12}")
    for o in (tier, advice.direct):
        if o is not None:
            lines.append(f"{o.name:22} {o.losses.stall:>10.3g} s {o.waste_now * HOUR:>8.3g} s/h"
                         f" {o.interval:>8.3g} s {f'{o.range[0]:.3g}-{o.range[1]:.3g} s':>16}"
                         f" {o.waste_advised * HOUR:>8.3g} s/h")
    if advice.young:
        lines.append(f"(Young's sqrt(2C/lambda) with the tier's C: {advice.young:.3g} s)")
    lines += [f"note: {n}" for n in advice.notes]
    lines.append(log_line(advice))
    return "\n".join(lines)


def log_line(advice: Advice) -> str:
    """The one line a job's log shows at each relaunch."""
    tier, direct = advice.tier, advice.direct
    buys = (f"; straight to the PFS at its best {direct.waste_advised * HOUR:.3g} s/h"
            if direct else "")
    caveat = f" ({len(advice.notes)} note(s): cachex advise)" if advice.notes else ""
    return (f"cachex advise: save every {tier.interval:.3g} s (now {advice.current:.3g} s):"
            f" expected waste {tier.waste_now * HOUR:.3g} -> {tier.waste_advised * HOUR:.3g}"
            f" s per hour{buys}{caveat}")
