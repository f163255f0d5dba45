"""Lost work measured on a run's own history: failures at random times replayed against
the times each checkpoint actually became safe from each failure class.

For a checkpoint, its *origin* is the start of the trainer's write (the training state it
holds) and `safe[c]` the moment the level that survives failure class c held on every
node (model/plan.py: crash -> captured, node -> replicated on the peer path and flushed
on the direct one, job -> flushed). A failure of class c at time f loses f - origin of
the newest checkpoint safe from c by f. Failures are drawn uniformly over the run's
steady part (from the first checkpoint's safe time to the last origin), which is the
situation `model plan`'s E[L_c] describes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .history import History

# the level whose holding makes a checkpoint survive each failure class, per path
SAFE_LEVEL = {"peer": {"crash": "captured", "node": "replicated", "job": "flushed"},
              "direct": {"crash": "captured", "node": "flushed", "job": "flushed"}}


@dataclass(frozen=True)
class Observed:
    ckpt: str
    origin: float               # wall-clock start of the trainer's write
    safe: dict[str, float]      # failure class -> wall-clock time it became safe from it


def observed(history: History, ckpts: Sequence[str] | None = None) -> list[Observed]:
    """The checkpoints (of `ckpts`, else all) that reached every level, oldest first."""
    writes: dict[str, float] = defaultdict(float)
    for sample in history.stage("write"):
        writes[sample.ckpt] = max(writes[sample.ckpt], sample.seconds)
    levels: dict[str, dict[str, float]] = defaultdict(dict)
    commits: dict[str, tuple[float, str]] = {}
    for sample in history.levels:
        levels[sample.ckpt][sample.level] = sample.committed + sample.latency
        commits[sample.ckpt] = (sample.committed, sample.path)
    out = []
    for ckpt, (committed, path) in commits.items():
        wanted = SAFE_LEVEL.get(path, SAFE_LEVEL["peer"])
        if (ckpts is None or ckpt in ckpts) and all(lv in levels[ckpt]
                                                    for lv in wanted.values()):
            out.append(Observed(ckpt, committed - writes[ckpt],
                                {c: levels[ckpt][lv] for c, lv in wanted.items()}))
    return sorted(out, key=lambda o: o.origin)


def replayed_loss(checkpoints: Sequence[Observed], cls: str, count: int = 20_000,
                  seed: int = 7) -> float:
    """Mean work lost (seconds) to `count` failures of class `cls` at uniform times over
    the steady part of the run."""
    if len(checkpoints) < 2:
        raise ValueError("need at least two checkpoints to replay failures")
    low = checkpoints[0].safe[cls]
    high = checkpoints[-1].origin
    if high <= low:
        raise ValueError(f"no steady part: the first checkpoint was safe from {cls} only"
                         " after the last one started")
    failures = np.random.default_rng(seed).uniform(low, high, count)
    origins = np.array([o.origin for o in checkpoints])
    safe_at = np.array([o.safe[cls] for o in checkpoints])
    order = np.argsort(safe_at)
    # the newest origin among checkpoints safe by each failure time
    newest = np.maximum.accumulate(origins[order])
    index = np.searchsorted(safe_at[order], failures, side="right") - 1
    return float(np.mean(failures - newest[index]))


def mean_period(checkpoints: Sequence[Observed]) -> float:
    origins = [o.origin for o in checkpoints]
    return (origins[-1] - origins[0]) / (len(origins) - 1)
