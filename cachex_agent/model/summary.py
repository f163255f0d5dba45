"""Text and JSON views of the model for `cachex model fit|predict|plan`."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..status import human_size
from .distributions import best_fit
from .history import LEVELS, STAGES, History
from .plan import Plan
from .predict import Prediction, SystemModel

MIB = 1024.0 ** 2


def fit_text(model: SystemModel, history: History, criterion: str) -> str:
    lines = [f"{len(history.sources)} event files; {len(history.stages)} stage samples,"
             f" {len(history.levels)} level samples",
             f"{'stage':16} {'n':>4} {'form':9} {'fixed s':>8} {'gamma':>5} {'median MiB/s':>12}"
             f"  best ({criterion.upper()})  KS     families ({criterion.upper()})"]
    for name in (*STAGES, *(n for n in model.stages if n not in STAGES)):
        m = model.stages.get(name)
        if m is None:
            lines.append(f"{name:16} {model.counts.get(name, 0):>4}  (too few samples)")
            continue
        ranking = ", ".join(f"{f.family} {getattr(f, criterion):.1f}" for f in m.fits)
        lines.append(f"{name:16} {m.n:>4} {m.form:9} {m.overhead:>8.3f} {m.gamma:>5.2f}"
                     f" {float(m.bandwidth.ppf(0.5)) / MIB:>12.1f}  {m.bandwidth.family:10}"
                     f"  {m.ks:.3f}  {ranking}")
    lines.append("duration fits (seconds), best first: " + "; ".join(
        f"{name} {m.durations[0].family} median {float(m.durations[0].ppf(0.5)):.3f}"
        for name, m in model.stages.items()))
    lines.append("(<level>:<path> rows: each node's time from the commit to its part holding"
                 " the level)")
    for level in LEVELS:
        samples = history.level(level)
        if samples:
            lat = sorted(s.latency for s in samples)
            fitted = ""
            if len(lat) >= 3 and lat[0] > 0:
                best = best_fit(lat, criterion)[0]
                fitted = f"; fit {best.family}, KS {best.ks(np.asarray(lat)):.3f}"
            lines.append(f"level {level:10} {len(lat):>4} checkpoints, latency median"
                         f" {lat[len(lat) // 2]:.3f} s, max {lat[-1]:.3f} s{fitted};"
                         f" coordinator share {model.overheads.get(level, 0.0):.3f} s")
    return "\n".join(lines)


def predict_json(prediction: Prediction, quantile: float) -> dict[str, Any]:
    return {"level": prediction.level, "path": prediction.path, "size": prediction.size,
            "nodes": prediction.nodes, "median": prediction.quantile(0.5),
            "quantile": quantile, "at_quantile": prediction.quantile(quantile)}


def predict_text(prediction: Prediction, quantile: float) -> str:
    p = prediction
    steps = [(q, p.quantile(q)) for q in (0.5, quantile)]
    return (f"level {p.level} on the {p.path} path, {human_size(p.size)} on {p.nodes} nodes:"
            f" median {steps[0][1]:.3f} s, {quantile:.0%} by {steps[1][1]:.3f} s")


def plan_json(plan: Plan) -> dict[str, Any]:
    return {"size": plan.size, "nodes": plan.nodes, "period": plan.period, "stall": plan.stall,
            "rates_per_hour": plan.rates, "recommended": plan.best.name,
            "paths": [{"name": p.name, "path": p.path, "every": p.every, "lag": p.lag,
                       "lost": p.lost, "loss_per_hour": p.loss, "node_fallback": p.fallback,
                       "waste": p.waste(plan.stall, plan.period)} for p in plan.paths],
            "protection": {**(plan.protection.to_json() if plan.protection else {}),
                           "beyond_per_period": plan.beyond},
            "period_young": plan.young, "period_daly": plan.daly,
            "period_optimum": plan.optimum, "waste_at_optimum": plan.optimum_waste}


def plan_text(plan: Plan) -> str:
    rates = ", ".join(f"{c} {r:g}/h" for c, r in plan.rates.items())
    lines = [f"checkpoint {human_size(plan.size)} on {plan.nodes} nodes, every"
             f" {plan.period:.0f} s, blocking cost {plan.stall:.2f} s; failures: {rates}",
             f"{'path':24} {'safe from crash/node/job (median s)':>36} "
             f"{'E[lost] per failure (s)':>24} {'lost s/h':>9} {'waste':>7}"]
    for p in plan.paths:
        lag = "/".join(f"{p.lag[c]:.2f}" for c in ("crash", "node", "job"))
        lost = "/".join(f"{p.lost[c]:.0f}" for c in ("crash", "node", "job"))
        lines.append(f"{p.name:24} {lag:>36} {lost:>24} {p.loss:>9.3g}"
                     f" {p.waste(plan.stall, plan.period):>7.2%}")
    if plan.protection is not None:
        peer = next((p for p in plan.paths if p.path == "peer"), None)
        share = f"; {peer.fallback:.3g} of node losses fall back to flushed" if peer else ""
        lines.append(f"node losses: {plan.protection.describe()}; P(some group beyond that"
                     f" within a period) {plan.beyond:.3g}{share}")
    lines.append(f"recommended path: {plan.best.name}")
    young = f"{plan.young:.0f} s" if plan.young else "n/a (no blocking cost)"
    daly = f"{plan.daly:.0f} s" if plan.daly else "n/a"
    lines.append(f"checkpoint period: Young {young}, Daly {daly}; with the durability lag"
                 f" {plan.optimum:.0f} s (waste {plan.optimum_waste:.2%})")
    return "\n".join(lines)
