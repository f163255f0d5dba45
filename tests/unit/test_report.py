"""`cachex report`: the figures are written, are PNGs, and are not blank."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib import image

from cachex_agent.model.history import History, LevelSample, StageSample
from cachex_agent.model.predict import fit_system
from cachex_agent.model.report import _predictions, observed_paths, write_report

MIB = 2**20
PNG = b"\x89PNG\r\n\x1a\n"
NAMES = ["summary.png", "timeline.png", "distributions.png", "durability.png",
         "reliability.png"]
BANDWIDTH = {"write": 400, "capture": 1500, "replicate": 600, "flush": 250}    # MiB/s


def synthetic(checkpoints: int = 30, nodes: int = 2, part: int = 64 * MIB,
              skip: tuple[str, ...] = ()) -> History:
    """Checkpoints every 10 s; every fifth on the direct path (no replication)."""
    rng = np.random.default_rng(11)
    history = History()
    for k in range(checkpoints):
        ckpt, commit = f"step_{k:05d}", 1000.0 + 10.0 * k
        path = "direct" if k % 5 == 4 else "peer"
        ends = []
        for node in range(nodes):
            ends.append(_node(history, rng, ckpt, node, nodes, part, commit, path, skip))
        for level in ("captured", "replicated", "flushed"):
            done = [e[level] for e in ends if level in e]
            if len(done) == nodes:
                history.levels.append(LevelSample("run", ckpt, k, nodes, level, part * nodes,
                                                  max(done) - commit + 0.02, commit, path))
    return history


def _node(history: History, rng: np.random.Generator, ckpt: str, node: int, nodes: int,
          part: int, commit: float, path: str, skip: tuple[str, ...]) -> dict[str, float]:
    stages = ["capture", "flush"] if path == "direct" else ["capture", "replicate", "flush"]
    write = _seconds(rng, "write", part)
    if "write" not in skip:
        history.stages.append(StageSample("run", ckpt, node, nodes, "write", part, write,
                                          commit, path))
    t, reached = commit, {}
    for stage, level in zip(stages, ["captured", "replicated", "flushed"][-len(stages):],
                            strict=True):
        if stage in skip:
            break
        seconds = _seconds(rng, stage, part)
        t += seconds
        history.stages.append(StageSample("run", ckpt, node, nodes, stage, part, seconds, t,
                                          path))
        reached["captured" if stage == "capture" else level] = t
    return reached


def _seconds(rng: np.random.Generator, stage: str, part: int) -> float:
    return 0.01 + part / (BANDWIDTH[stage] * MIB * rng.lognormal(0.0, 0.25))


def _check_pngs(paths: list[Path], out: Path) -> None:
    assert [p.name for p in paths] == NAMES
    for path in paths[1:]:          # summary.png reads the event files (none here)
        assert path.parent == out and path.is_file()
        data = path.read_bytes()
        assert data.startswith(PNG)
        assert len(data) > 20_000, f"{path.name} is suspiciously small"
        pixels = image.imread(path)
        assert pixels.ndim == 3 and pixels.shape[0] > 400 and pixels.shape[1] > 800
        assert float(np.var(pixels[..., :3])) > 1e-3, f"{path.name} is blank"


def test_report_writes_four_pngs_the_figures_non_blank(tmp_path):
    history = synthetic()
    model = fit_system(history)
    out = tmp_path / "report"
    paths = write_report(history, model, out)
    _check_pngs(paths, out)


def test_report_survives_a_stage_without_samples_and_a_chosen_checkpoint(tmp_path):
    history = synthetic(skip=("replicate",))
    model = fit_system(history)
    assert "replicate" not in model.stages
    paths = write_report(history, model, tmp_path, size=512 * MIB, nodes=8)
    _check_pngs(paths, tmp_path)


def test_report_with_too_few_samples_to_fit_any_stage(tmp_path):
    history = synthetic(checkpoints=1, nodes=2)              # 2 samples per stage
    model = fit_system(history)
    assert not model.stages
    paths = write_report(history, model, tmp_path)
    assert all(p.read_bytes().startswith(PNG) for p in paths)


def test_durability_curves_only_for_paths_taken_and_levels_in_order():
    both = synthetic()
    peer = History([s for s in both.stages if s.path == "peer"],
                   [s for s in both.levels if s.path == "peer"])
    model = fit_system(both)
    assert observed_paths(peer) == ("peer",) and observed_paths(both) == ("peer", "direct")
    curves, _ = _predictions(model, 128 * MIB, 2, observed_paths(peer))
    assert list(curves) == [("captured", "peer"), ("replicated", "peer"), ("flushed", "peer")]
    curves, _ = _predictions(model, 128 * MIB, 2, observed_paths(both))
    assert list(curves) == [("captured", "peer"), ("replicated", "peer"), ("flushed", "peer"),
                            ("flushed", "direct")]


def test_a_fit_of_shape_below_one_is_drawn_without_a_warning():
    """A Weibull of shape < 1 has an infinite density at 0, where the panel's range
    may begin (seen in CI under -W error)."""
    import warnings

    from matplotlib.figure import Figure

    from cachex_agent.model.distributions import Fit
    from cachex_agent.model.report import _fitted
    from cachex_agent.model.stages import StageModel

    weibull = Fit("weibull", (0.7, 50.0 * MIB), 20, 0.0)
    model = StageModel("flush", 0.0, 0.0, (weibull,), (weibull,), 20, 0.1)
    data = np.array([0.5, 5.0, 40.0, 90.0, 300.0])                 # MiB/s, from near 0
    top, bottom = Figure().subplots(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _fitted(top, bottom, model, data)
    assert top.get_xlim()[0] == 0.0 and len(top.lines) == 1
