"""Figures of the event history and the fitted model (`cachex report`).

    summary.png        the first page: per checkpoint and node, the time from the commit
                       to each level, with losses, failures and restarts (summary_plot.py)
    timeline.png       the four stages of every checkpoint on every node, in wall-clock
                       time, with the coordinator's level times
    distributions.png  per stage, the effective bandwidth B = s * N**gamma / (t - a)
                       against its fitted log-normal, gamma and Weibull (pdf and CDF)
    durability.png     P(level holds by t after the commit) per level and path for one
                       checkpoint size and node count, with the observed latencies
    reliability.png    coverage of the predicted quantiles per level (calibration.py)

Figures are drawn on bare `Figure` objects (the Agg renderer, no pyplot state), so the
module is safe to use from any thread and leaves nothing open.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from ..errors import OperationError
from ..fsutil import atomic_open, makedirs
from .calibration import reliability
from .distributions import Fit
from .history import LEVELS, STAGES, History, LevelSample, StageSample
from .predict import PATHS, Prediction, SystemModel, level_stages
from .stages import StageModel
from .summary_plot import summary_figure, summary_from_files

MIB = float(2**20)
FIGSIZE = (10.0, 6.0)
DPI = 110
SIMILAR = 1.5           # observed checkpoints within this factor of the size are "about it"
TIMELINE_MAX = 40       # checkpoints on the timeline (the latest ones)

STAGE_COLOURS = {"write": "#8c8c8c", "capture": "#1f77b4", "replicate": "#2ca02c",
                 "flush": "#d62728"}
LEVEL_STAGE = {"captured": "capture", "replicated": "replicate", "flushed": "flush"}
LEVEL_MARKERS = {"captured": "o", "replicated": "s", "flushed": "D"}
PATH_STYLES = {"peer": "-", "direct": "--"}
PATH_MARKERS = {"peer": "o", "direct": "^"}
FAMILY_COLOURS = {"lognormal": "#222222", "gamma": "#ff7f0e", "weibull": "#9467bd"}


def write_report(history: History, model: SystemModel, out: Path, size: float | None = None,
                 nodes: int | None = None) -> list[Path]:
    """Write summary.png (the page to read first), then timeline.png, distributions.png,
    durability.png and reliability.png into `out`; their paths.

    `size` (bytes of the whole checkpoint) and `nodes` choose the checkpoint of the
    durability figure; by default the model's median size and most common node count.
    """
    makedirs(out)
    return [_save(summary_figure(summary_from_files(history.sources)), out / "summary.png"),
            _save(timeline(history), out / "timeline.png"),
            _save(distributions(history, model), out / "distributions.png"),
            _save(durability(history, model, size, nodes), out / "durability.png"),
            _save(reliability(history, model), out / "reliability.png")]


def _save(fig: Figure, path: Path) -> Path:
    with atomic_open(path) as handle:     # 0600 like every file cachex writes
        fig.savefig(handle, dpi=DPI, format="png")
    return path


def _empty(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes,
            fontsize=11, color="#666666")
    ax.set_xticks([])
    ax.set_yticks([])


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# ------------------------------------------------------------------------- timeline
def timeline(history: History) -> Figure:
    """Horizontal bars per stage, one band per checkpoint with a sub-row per node: on the
    left in wall-clock time, on the right aligned at each checkpoint's commit."""
    every = _checkpoints(history)
    keys = every[-TIMELINE_MAX:]
    fig = Figure(figsize=(FIGSIZE[0], min(max(FIGSIZE[1], 2.0 + 0.2 * len(keys)), 10.0)),
                 layout="constrained")
    if not history.stages:
        ax = fig.add_subplot()
        ax.set_title("Checkpoint stages per node")
        _empty(ax, "no stage samples in the events")
        return fig
    wall, aligned = fig.subplots(1, 2, sharey=True, width_ratios=[3, 2])
    fig.suptitle("Checkpoint stages per node" + (f" (the last {len(keys)} of {len(every)}"
                                                 " checkpoints)" if len(keys) < len(every)
                                                 else ""))
    rows = {key: i for i, key in enumerate(keys)}
    history = _only(history, rows)
    origin = _origin(history)
    commits = _commits(history)
    _stage_bars(wall, history, rows, lambda key: origin)
    _level_marks(wall, history.levels, rows, lambda key: origin)
    _stage_bars(aligned, history, rows, lambda key: commits[key])
    _level_marks(aligned, history.levels, rows, lambda key: commits[key])
    _timeline_axes(wall, aligned, keys)
    handles, labels = wall.get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: labels[i] not in STAGES)
    fig.legend([handles[i] for i in order], [labels[i] for i in order],
               loc="outside lower center", ncol=4, fontsize=8, frameon=False)
    return fig


def _only(history: History, keys: dict[tuple[str, str], int]) -> History:
    return History([s for s in history.stages if (s.run, s.ckpt) in keys and s.stage in STAGES],
                   [s for s in history.levels if (s.run, s.ckpt) in keys], history.sources)


def _commits(history: History) -> dict[tuple[str, str], float]:
    """Commit time per checkpoint: the coordinator's, else the end of the earliest write
    or, failing that, the start of the earliest capture."""
    out = {(s.run, s.ckpt): s.committed for s in history.levels}
    for s, start, end in sorted(_spans(history), key=lambda x: x[0].stage != "write"):
        out.setdefault((s.run, s.ckpt), end if s.stage == "write" else start)
    return out


def _checkpoints(history: History) -> list[tuple[str, str]]:
    """(run, ckpt) in order of their first stage start."""
    first: dict[tuple[str, str], float] = {}
    for s in history.stages:
        key = (s.run, s.ckpt)
        first[key] = min(first.get(key, math.inf), s.end - s.seconds)
    return sorted(first, key=first.__getitem__)


def _origin(history: History) -> float:
    starts = [s.end - s.seconds for s in history.stages]
    return min(starts + [s.committed for s in history.levels])


def _spans(history: History) -> list[tuple[StageSample, float, float]]:
    """(sample, start, end) per stage sample.

    A write's sample may carry the time of the capture that followed it; it ended no
    later than that capture began.
    """
    capture = {(s.run, s.ckpt, s.node): s.end - s.seconds for s in history.stage("capture")}
    spans = []
    for s in history.stages:
        end = s.end
        if s.stage == "write":
            end = min(end, capture.get((s.run, s.ckpt, s.node), end))
        spans.append((s, end - s.seconds, end))
    return spans


def _stage_bars(ax: Axes, history: History, rows: dict[tuple[str, str], int],
                origin: Callable[[tuple[str, str]], float]) -> None:
    nodes: dict[tuple[str, str], list[int]] = {}
    for s in history.stages:
        nodes.setdefault((s.run, s.ckpt), []).append(s.node)
    order = {key: sorted(set(v)) for key, v in nodes.items()}
    bars: dict[str, tuple[list[float], list[float], list[float], list[float]]] = {
        name: ([], [], [], []) for name in STAGES}
    for s, start, end in _spans(history):
        key = (s.run, s.ckpt)
        height = 0.8 / len(order[key])
        y, left, width, h = bars.setdefault(s.stage, ([], [], [], []))
        y.append(rows[key] - 0.4 + (order[key].index(s.node) + 0.5) * height)
        left.append(start - origin(key))
        width.append(end - start)
        h.append(0.85 * height)
    for name, (y, left, width, h) in bars.items():
        if y:
            ax.barh(y, width, left=left, height=h, label=name,
                    color=STAGE_COLOURS.get(name, "#bcbd22"), edgecolor="none")


def _level_marks(ax: Axes, levels: Sequence[LevelSample], rows: dict[tuple[str, str], int],
                 origin: Callable[[tuple[str, str]], float]) -> None:
    commits = {(s.run, s.ckpt): s.committed for s in levels}
    if commits:
        ax.scatter([t - origin(k) for k, t in commits.items()], [rows[k] for k in commits],
                   marker="|", s=160, color="black", linewidths=1.2, zorder=3,
                   label="commit (coordinator)")
    for level in LEVELS:
        mine = [s for s in levels if s.level == level]
        if mine:
            ax.scatter([s.committed + s.latency - origin((s.run, s.ckpt)) for s in mine],
                       [rows[(s.run, s.ckpt)] for s in mine], marker=LEVEL_MARKERS[level],
                       s=28, color=STAGE_COLOURS[LEVEL_STAGE[level]], edgecolors="black",
                       linewidths=0.8, zorder=4, label=f"level {level} (coordinator)")


def _timeline_axes(wall: Axes, aligned: Axes, keys: list[tuple[str, str]]) -> None:
    runs = {run for run, _ in keys}
    step = max(1, math.ceil(len(keys) / 40))
    ticks = list(range(0, len(keys), step))
    wall.set_yticks(ticks, [f"{keys[i][0]}/{keys[i][1]}" if len(runs) > 1 else keys[i][1]
                            for i in ticks], fontsize=8)
    wall.set_ylim(len(keys) - 0.5, -0.5)
    wall.set_ylabel("checkpoint (one sub-row per node)")
    wall.set_title("wall clock", fontsize=10)
    wall.set_xlabel("seconds since the first event (s)")
    aligned.set_title("aligned at each checkpoint's commit", fontsize=10)
    aligned.set_xlabel("seconds since the commit (s)")
    aligned.axvline(0.0, color="black", lw=0.6, alpha=0.5)
    for ax in (wall, aligned):
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)


# -------------------------------------------------------------------- distributions
def distributions(history: History, model: SystemModel) -> Figure:
    """Per stage: histogram of B with the fitted pdfs; below, the ECDF and fitted CDFs."""
    fig = Figure(figsize=FIGSIZE, layout="constrained")
    axes = fig.subplots(2, len(STAGES), gridspec_kw={"height_ratios": [3, 2]})
    fig.suptitle("How fast each stage moved a node's data: bars and dots measured,"
                 " lines the fits predictions use")
    for col, name in enumerate(STAGES):
        _stage_panels(axes[0, col], axes[1, col], history.stage(name),
                      model.stages.get(name), name)
    axes[0, 0].set_ylabel("density (per MiB/s)")
    axes[1, 0].set_ylabel("P(B <= x)")
    return fig


def bandwidths(samples: Sequence[StageSample], model: StageModel | None) -> np.ndarray:
    """B of each sample in bytes/s under the model's fixed cost and exponents (none
    without a model; the load factor left in)."""
    def one(s: StageSample) -> float:
        if model is None:
            return s.bytes / s.seconds
        fixed = model.fixed(s.nodes)
        return model.scale(s.bytes, s.nodes) / (s.seconds - fixed) if s.seconds > fixed \
            else math.nan
    b = np.array([one(s) for s in samples], dtype=float)
    return b[np.isfinite(b) & (b > 0)]


def _stage_panels(top: Axes, bottom: Axes, samples: Sequence[StageSample],
                  model: StageModel | None, name: str) -> None:
    data = bandwidths(samples, model) / MIB
    top.set_title(f"{name} (n={len(data)})", color=STAGE_COLOURS[name], fontweight="bold")
    if data.size == 0:
        _empty(top, "no samples")
        _empty(bottom, "no samples")
        return
    colour = STAGE_COLOURS[name]
    top.hist(data, bins=_bins(data), density=True, color=colour, alpha=0.35,
             edgecolor=colour, label="observed")
    _ecdf(bottom, data, colour)
    if model is None:
        bottom.text(0.03, 0.95, "too few samples to fit", va="top",
                    transform=bottom.transAxes, fontsize=7, color="#444444")
    else:
        _fitted(top, bottom, model, data)
        bottom.text(0.03, 0.95, f"a = {model.overhead:.3g} s\ngamma = {model.gamma:.2f}"
                    f"\n{model.form} form",
                    va="top", transform=bottom.transAxes, fontsize=7, color="#444444")
    top.set_ylim(0, top.get_ylim()[1] * 1.3)       # room for the legend above the data
    top.legend(fontsize=6.5, loc="upper left", frameon=False, handlelength=1.5)
    for ax in (top, bottom):
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.25)
    bottom.set_xlabel("B (MiB/s)")
    bottom.set_ylim(0, 1.02)


def _bins(data: np.ndarray) -> int:
    return int(min(30, max(5, round(2 * len(data) ** (1 / 3)))))


def _ecdf(ax: Axes, data: np.ndarray, colour: str) -> None:
    x = np.sort(data)
    y = np.arange(1, x.size + 1) / x.size
    ax.plot(x, y, drawstyle="steps-post", color=colour, lw=1.2)
    ax.plot(x, y, "o", color=colour, ms=2.5)


def _fitted(top: Axes, bottom: Axes, model: StageModel, data: np.ndarray) -> None:
    lo, hi = _fit_range(model.fits, data)
    # not at 0: a Weibull or gamma of shape < 1 has an infinite density there
    x = np.linspace(max(lo, hi / 400), hi, 400)
    for rank, f in enumerate(model.fits):
        best = rank == 0
        style = {"color": FAMILY_COLOURS.get(f.family, "#17becf"), "lw": 2.4 if best else 1.1,
                 "ls": "-" if best else "--", "zorder": 3 if best else 2}
        label = (f"{f.family}{' (best)' if best else ''}  AIC {f.aic:.0f}"
                 f"  KS {f.ks(data * MIB):.2f}")
        top.plot(x, f.frozen.pdf(x * MIB) * MIB, label=label, **style)
        bottom.plot(x, f.cdf(x * MIB), **style)
    top.set_xlim(lo, hi)
    bottom.set_xlim(lo, hi)


def _fit_range(fits: Sequence[Fit], data: np.ndarray) -> tuple[float, float]:
    """From 0 (or just below the data) to past the data and the fits' 99.5% points."""
    tails = [float(f.ppf(0.995)) / MIB for f in fits]
    hi = max([float(data.max())] + [t for t in tails if math.isfinite(t)]) * 1.05
    lo = max(0.0, float(data.min()) - 0.6 * (hi - float(data.min())))
    return lo, hi


# ----------------------------------------------------------------------- durability
def durability(history: History, model: SystemModel, size: float | None = None,
               nodes: int | None = None) -> Figure:
    """P(level holds for the whole checkpoint by t after its commit), model vs observed."""
    fig = Figure(figsize=FIGSIZE, layout="constrained")
    ax = fig.add_subplot()
    size = size if size is not None else model.size
    nodes = nodes if nodes is not None else model.nodes
    if not size or not nodes or size <= 0 or nodes < 1:
        ax.set_title("Probability of durability by time t")
        _empty(ax, "no checkpoint size / node count: give --size and --nodes")
        return fig
    ax.set_title(f"Probability of durability by t: a {human_bytes(size)} checkpoint on "
                 f"{nodes} node{'s' if nodes != 1 else ''}")
    curves, missing = _predictions(model, size, nodes, observed_paths(history))
    observed = {(level, path): _similar(history.level(level, None if _shared(level) else path),
                                        size, nodes) for level, path in curves}
    if not curves:
        _empty(ax, "no level has a model: too few stage samples")
        return fig
    t = np.linspace(0.0, _durability_range(curves, observed), 500)
    both = len({path for _, path in curves}) > 1
    for (level, path), prediction in curves.items():
        _curve(ax, t, prediction, observed[(level, path)], both)
    _durability_axes(ax, observed, missing)
    return fig


def observed_paths(history: History) -> tuple[str, ...]:
    """The paths the events show checkpoints taking; every path when there are no
    events (a saved model alone)."""
    seen = {s.path for s in history.levels} | {s.path for s in history.stages}
    return tuple(p for p in PATHS if p in seen) if seen else PATHS


def _predictions(model: SystemModel, size: float, nodes: int, paths: Sequence[str]
                 ) -> tuple[dict[tuple[str, str], Prediction], list[str]]:
    """The curves of the paths taken, levels in their order (captured < replicated <
    flushed), and "level, path" of those with a stage the model has no fit of."""
    out, missing = {}, []
    for level in LEVELS:
        for path in paths:
            if path == "direct" and level == "replicated":
                continue        # never reached on the direct path
            if _shared(level) and path != paths[0]:
                continue        # the same curve on every path: drawn once
            try:
                out[(level, path)] = model.predict(level, path, size, nodes)
            except OperationError:
                missing.append(_curve_name(level, path, len(paths) > 1))
    return out, missing


def _shared(level: str) -> bool:
    """Whether the level takes the same stages on both paths (one curve for both)."""
    return level != "replicated" and level_stages(level, "peer") == level_stages(level,
                                                                                 "direct")


def _curve_name(level: str, path: str, both: bool) -> str:
    return f"{level}, {'either path' if both and _shared(level) else path}"


def _similar(samples: Sequence[LevelSample], size: float, nodes: int) -> np.ndarray:
    """Observed latencies of checkpoints of about `size` bytes on `nodes` nodes."""
    return np.sort([s.latency for s in samples
                    if s.nodes == nodes and 1 / SIMILAR <= s.bytes / size <= SIMILAR])


def _durability_range(curves: dict[tuple[str, str], Prediction],
                      observed: dict[tuple[str, str], np.ndarray]) -> float:
    ends = [p.quantile(0.999) for p in curves.values()]
    ends += [float(v.max()) for v in observed.values() if v.size]
    finite = [e for e in ends if math.isfinite(e) and e > 0]
    return 1.05 * max(finite) if finite else 1.0


def _curve(ax: Axes, t: np.ndarray, prediction: Prediction, seen: np.ndarray,
           both: bool) -> None:
    level, path = prediction.level, prediction.path
    colour = STAGE_COLOURS[LEVEL_STAGE[level]]
    median, q99 = prediction.quantile(0.5), prediction.quantile(0.99)
    ax.plot(t, prediction.cdf(t), color=colour, ls=PATH_STYLES[path], lw=2,
            label=f"{_curve_name(level, path, both)}: median {median:.3g} s, 99% {q99:.3g} s")
    if seen.size:
        y = np.arange(1, seen.size + 1) / seen.size
        ax.plot(seen, y, drawstyle="steps-post", color=colour, lw=0.8, alpha=0.5,
                ls=PATH_STYLES[path])
        ax.plot(seen, y, PATH_MARKERS[path], color=colour, ms=4.5, alpha=0.8,
                markerfacecolor="white" if path == "direct" else colour)


def _durability_axes(ax: Axes, observed: dict[tuple[str, str], np.ndarray],
                     missing: list[str]) -> None:
    ax.set_xlabel("seconds since the commit (s)")
    ax.set_ylabel("P(level holds on every node by t)")
    ax.set_ylim(-0.01, 1.03)
    ax.set_xlim(left=0.0)
    ax.axhline(0.99, color="#999999", lw=0.8, ls=":")
    ax.grid(alpha=0.3)
    handles, _labels = ax.get_legend_handles_labels()
    model_legend = ax.legend(handles=handles, loc="lower right", fontsize=8,
                             title="model: F_node(t - c_L)^N", title_fontsize=8)
    ax.add_artist(model_legend)
    drawn = [path for path in PATHS if any(p == path for _, p in observed)]
    extra = [Line2D([], [], color="black", ls=PATH_STYLES[path], label=f"{path} path")
             for path in drawn]
    for path in drawn:
        count = sum(v.size for (_, p), v in observed.items() if p == path)
        if count:
            extra.append(Line2D([], [], ls="none", marker=PATH_MARKERS[path], color="black",
                                markerfacecolor="white" if path == "direct" else "black",
                                label=f"observed ({count} latencies)" if path == "peer"
                                else f"observed, direct path only ({count})"))
    if not any(v.size for v in observed.values()):
        extra.append(Patch(color="none", label="no observed checkpoint of about this size"))
    if missing:
        extra.append(Patch(color="none", label="too few samples to model:\n  "
                           + "\n  ".join(missing)))
    ax.legend(handles=extra, loc="center right", fontsize=8, frameon=True)
