"""How well the durability model predicts completion times: MAPE on held-out checkpoints.

Workloads on this machine: checkpoints of several sizes on 2 and 4 virtual nodes (agents
under mpiexec, failure domain `rank`, the peer path), in two scenarios:

  quiet      the PFS is a loop-device ext4 of its own, nothing else writes to it
  contended  the same PFS throttled (cgroup v1 blkio) and shared with background writers
             of heavy-tailed files (benchmarks/contention.py)

Each checkpoint is written (DCP layout: one file per rank, `.metadata` last on node 0),
then the next waits until it is flushed, so completion times are not queueing behind each
other. Per scenario the model is fitted on the first half of every workload's checkpoints
(events of those only) and predicts the median completion time of each level for the
second half; the script prints the MAPE per level, per checkpoint and per workload
(observed median vs predicted median), against the published 7.1%, and the calibration
of the predicted distributions on the same held-out checkpoints: per level, the fraction
of observed completion times below the predicted 0.5, 0.9 and 0.99 quantiles
(model/calibration.py; target q +- 0.05).

`--load N` runs N CPU-burning processes beside the whole run (a training node's cores
are never idle), started `--load-warmup` seconds (90) before the first checkpoint so the
1-minute load average has settled; it is recorded at every checkpoint and printed.

`--fit-nodes 2,4` with `--nodes 2,4,8` fits on the 2- and 4-node runs whole and predicts
the 8-node runs, which the model never saw (extrapolation in node count); `--fit-sizes`
does the same for checkpoint sizes.

    python benchmarks/predict.py [--sizes 24MiB,64MiB,160MiB] [--nodes 2,4] [--count 10]
                                 [--scenarios quiet,contended] [--load N] [--keep DIR]
                                 [--fit-nodes N,N] [--fit-sizes S,S] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import private_state  # noqa: F401 (its runs are recorded apart from the user's)
from common import BIN, MiB, burn, make_spools, stop_burning, write_config
from contention import Contention, ThrottledPFS

from cachex_agent import config as configuration
from cachex_agent.layout import pfs_stop_file
from cachex_agent.model.calibration import QUANTILES, calibration, predictor
from cachex_agent.model.history import History, config_event_files, load_history
from cachex_agent.model.predict import fit_system
from cachex_agent.model.stages import FORMS as STAGE_FORMS
from cachex_agent.status import load_status

LEVELS = ("captured", "replicated", "flushed")


LOADS: list[float] = []         # 1-minute load average at every checkpoint
LOAD_COVARIATE = True           # predict each checkpoint at its recorded load (--no-load-covariate)
FORMS = STAGE_FORMS             # --forms


def agent_config(root: Path, pfs: Path, run: str, write_path: str = "peer") -> Path:
    """`run`'s agents: spools and caches under root/<run>/, stages on /dev/shm; the
    configuration at root/<run>.toml (replay() finds a kept run's by that name)."""
    node = f"{root}/{run}/node{{node}}"
    return write_config(root / f"{run}.toml", run,
                        paths={"spool": f"{node}/spool",
                               "stage": "/dev/shm/cachex-predict/node{node}",
                               "cache": f"{node}/nvme", "pfs": pfs},
                        topology={"domain": "rank"}, commit={"rule": "dcp"},
                        model={"path": write_path}, keep={"replica": 1, "pfs": 2},
                        agent={"poll": "0.01s"})


def start_run(root: Path, pfs: ThrottledPFS, run: str, nodes: int, write_path: str = "peer"
              ) -> tuple[Path, configuration.Config, subprocess.Popen]:
    """`run`'s configuration, its spools, its agents started inside the PFS's throttle."""
    config = agent_config(root, pfs.path, run, write_path)
    cfg = make_spools(config, nodes)
    return config, cfg, start_agents(config, nodes, pfs, root / f"{run}.log")


def start_agents(config: Path, nodes: int, pfs: ThrottledPFS, log: Path) -> subprocess.Popen:
    command = [str(BIN / "mpiexec"), "-n", str(nodes), str(BIN / "cachex-agent"),
               "--config", str(config), "-q"]
    return subprocess.Popen(pfs.popen_args_prefix() + command, stdout=log.open("ab"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"predict.py: timed out waiting for {what}")
        time.sleep(0.05)


def level_of(cfg: configuration.Config, ckpt: str) -> str | None:
    try:
        rows = load_status(cfg)["checkpoints"]
    except Exception:       # status not written yet
        return None
    return next((r["level"] for r in rows if r["id"] == ckpt), None)


def write_checkpoint(cfg: configuration.Config, nodes: int, ckpt: str, size: int,
                     buffer: np.ndarray) -> None:
    """One shard per node (as DCP with one rank per node), `.metadata` last on node 0."""
    part = size // nodes
    for node in range(nodes):
        directory = cfg.node_paths(node).spool_dir(ckpt)
        directory.mkdir(parents=True)
        with open(directory / f"__{node}_0.distcp", "wb") as handle:
            for start in range(0, part, len(buffer)):
                handle.write(memoryview(buffer)[: min(len(buffer), part - start)])
    metadata = cfg.node_paths(0).spool_dir(ckpt) / ".metadata"
    metadata.with_suffix(".tmp").write_text(json.dumps({"size": size}))
    os.rename(metadata.with_suffix(".tmp"), metadata)


def prune_spool(cfg: configuration.Config, nodes: int, *keep: str) -> None:
    for node in range(nodes):
        spool = cfg.node_paths(node).spool
        for child in spool.iterdir():
            if child.name not in keep:
                shutil.rmtree(child, ignore_errors=True)


def run_workloads(root: Path, pfs: ThrottledPFS, scenario: str, nodes: int,
                  sizes: list[int], count: int, rng: np.random.Generator) -> Path:
    run = f"{scenario}-n{nodes}"
    config, cfg, agents = start_run(root, pfs, run, nodes)
    buffer = np.frombuffer(rng.bytes(8 * MiB), dtype=np.uint8)
    order = [s for s in sizes for _ in range(count)]
    rng.shuffle(order)
    try:
        wait(lambda: load_status_ok(cfg), 60, "the agents to start")
        for i, size in enumerate(order):
            ckpt = f"step_{i + 1:05d}"
            write_checkpoint(cfg, nodes, ckpt, size, buffer)
            wait(lambda c=ckpt: level_of(cfg, c) in ("flushed", "failed"), 300,
                 f"{run} {ckpt} to be flushed")
            prune_spool(cfg, nodes, ckpt)
            LOADS.append(os.getloadavg()[0])
            print(f"  {run}: {ckpt} {size // MiB} MiB {level_of(cfg, ckpt)}", flush=True,
                  end="\r")
        drain(cfg, agents)
    finally:
        end(agents)
    print()
    return config


def drain(cfg: configuration.Config, agents: subprocess.Popen) -> None:
    """`cachex stop` by its file on the PFS: the agents flush and exit."""
    stop = pfs_stop_file(cfg.node_paths(0).pfs)
    stop.parent.mkdir(parents=True, exist_ok=True)
    stop.write_text("")
    agents.wait(timeout=120)


def end(agents: subprocess.Popen) -> None:
    """What a drain did not end (an error on the way): killed with its session."""
    if agents.poll() is None:
        os.killpg(agents.pid, signal.SIGKILL)
        agents.wait()


def load_status_ok(cfg: configuration.Config) -> bool:
    try:
        load_status(cfg)
        return True
    except Exception:
        return False


def split(history: History, fit_nodes: set[int] | None = None,
          fit_sizes: set[int] | None = None) -> tuple[History, list]:
    """Per (run, size) workload, the first half of the checkpoints fits, the rest tests;
    with `fit_nodes` (`fit_sizes`), the workloads on those node counts (of those sizes)
    fit whole and the others, which the model never saw, are predicted whole."""
    workloads: dict[tuple[str, int], list] = defaultdict(list)
    for sample in history.level("flushed"):
        workloads[(sample.run, sample.bytes)].append(sample)
    fit_keys = set()
    for samples in workloads.values():
        samples.sort(key=lambda s: s.committed)
        if fit_nodes is None and fit_sizes is None:
            samples = samples[: len(samples) // 2]
        elif samples[0].nodes not in (fit_nodes or {samples[0].nodes}) or \
                not _of_size(samples[0].bytes, fit_sizes):
            continue
        fit_keys |= {(s.run, s.ckpt) for s in samples}
    fit = History([s for s in history.stages if (s.run, s.ckpt) in fit_keys],
                  [s for s in history.levels if (s.run, s.ckpt) in fit_keys], history.sources)
    tests = [s for s in history.levels if (s.run, s.ckpt) not in fit_keys]
    return fit, tests


def _of_size(nbytes: int, sizes: set[int] | None) -> bool:
    """A checkpoint of one of `sizes` (its shards; `.metadata` adds a few bytes)."""
    return sizes is None or any(abs(nbytes - size) <= size // 100 for size in sizes)


def noise_floor(observed: list[float], rng: np.random.Generator, draws: int = 2000) -> float:
    """The error a predictor of the true median would still show against the median of
    these few observations: the bootstrap mean of |median(resample) - median| / median."""
    x = np.asarray(observed, dtype=float)
    medians = np.median(rng.choice(x, size=(draws, x.size)), axis=1)
    return float(np.mean(np.abs(medians - np.median(x))) / np.median(x))


def mape(model: Any, tests: list) -> dict[str, tuple[float, float, list[list[float]]]]:
    """Per level: MAPE per checkpoint, per workload (predicted median against the
    observed one), and each workload's observations."""
    errors: dict[str, list[float]] = defaultdict(list)
    groups: dict[tuple[str, str, int], list[tuple[float, float]]] = defaultdict(list)
    cache: dict[tuple[Any, ...], float] = {}
    predict = predictor(model, with_load=LOAD_COVARIATE)
    for sample in tests:
        key = (sample.level, sample.bytes, sample.nodes, sample.load)
        if key not in cache:
            cache[key] = predict(sample).quantile(0.5)
        predicted = cache[key]
        errors[sample.level].append(abs(predicted - sample.latency) / sample.latency)
        groups[(sample.level, sample.run, sample.bytes)].append((predicted, sample.latency))
    out = {}
    for level in LEVELS:
        observed = [[o for _, o in p] for (lv, _r, _b), p in groups.items() if lv == level]
        predicted = [p[0][0] for (lv, _r, _b), p in groups.items() if lv == level]
        per_workload = [abs(p - statistics.median(o)) / statistics.median(o)
                        for p, o in zip(predicted, observed, strict=True)]
        out[level] = (100 * statistics.mean(errors[level]),
                      100 * statistics.mean(per_workload), observed)
    return out


def evaluate(history: History, fit_nodes: set[int] | None = None,
             fit_sizes: set[int] | None = None) -> dict[str, dict[str, float]]:
    fit, tests = split(history, fit_nodes, fit_sizes)
    model = fit_system(fit, forms=FORMS)
    # the same held-out checkpoints under the bandwidth form alone: what the time form buys
    plain = mape(fit_system(fit, forms=("bandwidth",)), tests) if "time" in FORMS else None
    out: dict[str, dict[str, Any]] = {}
    for level, (checkpoint, workload, observed) in mape(model, tests).items():
        rng = np.random.default_rng(7)
        floor = [noise_floor(o, rng) for o in observed]
        out[level] = {"checkpoint": checkpoint, "workload": workload,
                      "floor": 100 * statistics.mean(floor), "n": sum(map(len, observed)),
                      "forms": sorted({m.form for n, m in model.stages.items()
                                       if n.startswith(level)}),
                      "bandwidth_form_workload": plain[level][1] if plain else None}
    for row in calibration(tests, predictor(model, with_load=LOAD_COVARIATE)):
        out[row.level].setdefault("coverage", {})[row.path] = row.coverage
    return out


def print_results(results: dict[str, dict[str, dict[str, Any]]]) -> None:
    print(f"{'scenario':10} {'level':11} {'n':>4} {'MAPE/ckpt':>10} {'MAPE/workload':>14}"
          f" {'floor':>6} {'form':9} {'bw-only':>7}  coverage of the predicted"
          f" {'/'.join(f'{q:g}' for q in QUANTILES)} quantiles"
          f" ({'at each checkpoint' if LOAD_COVARIATE else 'at the median'} load)")
    for scenario, levels in results.items():
        for level, r in levels.items():
            cover = "  ".join(f"{path} " + "/".join(f"{c[q]:.2f}" for q in QUANTILES)
                              for path, c in r.get("coverage", {}).items())
            print(f"{scenario:10} {level:11} {r['n']:>4} {r['checkpoint']:>9.1f}%"
                  f" {r['workload']:>13.1f}% {r['floor']:>5.1f}% {','.join(r['forms']):9}"
                  f" {_percent(r.get('bandwidth_form_workload')):>7}  {cover}")
    print("published: 7.1% MAPE of completion-time predictions; calibrated: coverage q +- 0.05")
    print("floor: the MAPE/workload a predictor of each workload's true median would show"
          " against the few held-out observations (bootstrap); bw-only: MAPE/workload of"
          " the bandwidth form alone on the same checkpoints")


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}%"


def replay(root: Path, fit_nodes: set[int] | None = None,
           fit_sizes: set[int] | None = None) -> dict[str, dict[str, dict[str, Any]]]:
    """The figures of a kept run (its <scenario>-n<N>.toml configurations), again."""
    configs: dict[str, list[Path]] = defaultdict(list)
    for config in sorted(root.glob("*-n*.toml")):
        configs[config.stem.rsplit("-n", 1)[0]].append(config)
    return {scenario: evaluate(load_history(
        [f for c in found for f in config_event_files(configuration.load(c))]), fit_nodes,
        fit_sizes)
        for scenario, found in configs.items()}


def write_json(path: Path, args: argparse.Namespace, results: dict[str, Any],
               load: list[float], fit_nodes: set[int] | None, fit_sizes: set[int] | None
               ) -> None:
    path.write_text(json.dumps(
        {"load_processes": args.load, "loadavg": load, "cores": os.cpu_count(),
         "fit_nodes": sorted(fit_nodes) if fit_nodes else None,
         "fit_sizes": sorted(fit_sizes) if fit_sizes else None,
         "sizes": args.sizes, "nodes": args.nodes, "count": args.count,
         "forms": list(FORMS), "from_events": args.from_events,
         "results": {sc: {lv: {**r, "coverage": {p: {str(q): c for q, c in cov.items()}
                                                 for p, cov in r.get("coverage", {}).items()}}
                          for lv, r in levels.items()} for sc, levels in results.items()}},
        indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="24MiB,64MiB,160MiB")
    parser.add_argument("--nodes", default="2,4")
    parser.add_argument("--count", type=int, default=10)
    parser.add_argument("--scenarios", default="quiet,contended")
    parser.add_argument("--throttle", default="150MiB", help="contended PFS write bandwidth")
    parser.add_argument("--pfs-size", default="2GiB",
                        help="the loop device's size (keep.pfs = 2 checkpoints of the largest)")
    parser.add_argument("--load", type=int, default=0, metavar="N",
                        help="run N CPU-burning processes beside the benchmark")
    parser.add_argument("--load-warmup", type=float, default=90.0, metavar="SECONDS",
                        help="with --load: wait this long before the first checkpoint")
    parser.add_argument("--no-load-covariate", action="store_true",
                        help="predict at the fit's median load, not each checkpoint's")
    parser.add_argument("--fit-nodes", metavar="N,N",
                        help="fit on the runs at these node counts only and predict the"
                        " others whole (extrapolation in node count, e.g. --nodes 2,4,8"
                        " --fit-nodes 2,4)")
    parser.add_argument("--fit-sizes", metavar="SIZE,SIZE",
                        help="likewise for checkpoint sizes (whole checkpoint), e.g."
                        " --sizes 16MiB,48MiB,96MiB --fit-sizes 16MiB,48MiB")
    parser.add_argument("--forms", default=",".join(STAGE_FORMS),
                        help="the stage models' noise forms to choose from (model/stages.py)")
    parser.add_argument("--from-events", metavar="DIR",
                        help="no run: evaluate the events of an earlier --keep DIR")
    parser.add_argument("--keep", help="keep the work directory here")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    global LOAD_COVARIATE, FORMS
    LOAD_COVARIATE = not args.no_load_covariate
    FORMS = tuple(args.forms.split(","))
    fit_nodes = {int(n) for n in args.fit_nodes.split(",")} if args.fit_nodes else None
    fit_sizes = ({configuration.parse_size(s) for s in args.fit_sizes.split(",")}
                 if args.fit_sizes else None)
    if args.from_events:
        results = replay(Path(args.from_events), fit_nodes, fit_sizes)
        print_results(results)
        if args.json:
            write_json(Path(args.json), args, results, [], fit_nodes, fit_sizes)
        return
    sizes = [configuration.parse_size(s) for s in args.sizes.split(",")]
    node_counts = [int(n) for n in args.nodes.split(",")]
    root = Path(args.keep or tempfile.mkdtemp(prefix="cachex-predict-"))
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(5)
    results = {}
    started = time.monotonic()
    burners = burn(args.load)
    if burners and args.load_warmup > 0:
        # a training node's load is steady: let the 1-minute load average (an EMA that
        # reaches 63% of a step after 60 s) settle, so the fit half does not see a ramp
        print(f"{args.load} CPU burners started; {args.load_warmup:.0f} s for the load average"
              " to settle", flush=True)
        time.sleep(args.load_warmup)
    try:
        for scenario in args.scenarios.split(","):
            contended = scenario == "contended"
            throttle = configuration.parse_size(args.throttle) if contended else None
            with ThrottledPFS(root / f"pfs-{scenario}", size=args.pfs_size,
                              write_bps=throttle) as pfs:
                writers = Contention(pfs, writers=2) if contended else None
                if writers:
                    writers.start()
                try:
                    configs = [run_workloads(root, pfs, scenario, n, sizes, args.count, rng)
                               for n in node_counts]
                finally:
                    if writers:
                        writers.stop()
                files = [f for c in configs for f in config_event_files(configuration.load(c))]
                results[scenario] = evaluate(load_history(files), fit_nodes, fit_sizes)
    finally:
        stop_burning(burners)
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree("/dev/shm/cachex-predict", ignore_errors=True)
    load = [min(LOADS), statistics.median(LOADS), max(LOADS)] if LOADS else []
    fitted = (f"fit on the runs at nodes {args.fit_nodes or args.nodes}, sizes"
              f" {args.fit_sizes or args.sizes}; predicted the others whole"
              if fit_nodes or fit_sizes else
              "fit on the first half of each workload, predicted the rest")
    print(f"\n{fitted}"
          f" ({time.monotonic() - started:.0f} s; sizes {args.sizes}, nodes {args.nodes},"
          f" {args.count} checkpoints each; --load {args.load}, load average"
          f" {' / '.join(f'{x:.1f}' for x in load)} min/median/max on {os.cpu_count()} cores)")
    print_results(results)
    if args.json:
        write_json(Path(args.json), args, results, load, fit_nodes, fit_sizes)


if __name__ == "__main__":
    main()
