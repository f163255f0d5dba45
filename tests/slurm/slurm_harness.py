"""Real Slurm jobs on this machine's one-node Slurm (scripts/ci/setup-slurm.sh).

`LocalJob` submits scripts/slurm/local.sbatch with sbatch, with the example trainer on
virtual nodes under a temporary directory, and reads what it left: the job's state from
`scontrol show job`, its output file, `cachex status --json`. Every wait is bounded; a job
still running at the end of a test is cancelled.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from harness import wait_for  # noqa: F401  (the tests import it from here)

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
MPIEXEC = BIN / "mpiexec"
TRAINER = ROOT / "examples" / "trainer.py"
SCRIPTS = ROOT / "scripts"
LOCAL = SCRIPTS / "slurm" / "local.sbatch"
SETUP = ("run `bash scripts/ci/setup-slurm.sh` as root first (it installs and starts a"
         " local Slurm on this machine)")
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "PREEMPTED", "BOOT_FAIL", "DEADLINE"}
USABLE = {"idle", "mixed", "allocated", "completing"}

# The trainer of every job: 2 virtual nodes x 2 ranks, 2 MiB per shard, a checkpoint
# every 10 steps. --step-time does not change the final state, only how long it takes.
VNODES, RANKS_PER_NODE, STEPS = 2, 2, 60
TRAIN = ["--ranks-per-node", str(RANKS_PER_NODE), "--steps", str(STEPS),
         "--shard-size", "2MiB"]


def run(command: list[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def require_slurm() -> str:
    """The Slurm version, or the test fails saying how to get a Slurm here."""
    for tool in ("sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo"):
        if shutil.which(tool) is None:
            pytest.fail(f"no `{tool}` on PATH: {SETUP}", pytrace=False)
    try:
        answer = run(["sinfo", "-h", "-o", "%T"], timeout=20)
    except subprocess.TimeoutExpired:
        answer = None
    if answer is None:
        pytest.fail(f"sinfo did not answer within 20s (slurmctld down?): {SETUP}",
                    pytrace=False)
    states = {s.rstrip("*~#") for s in answer.stdout.split()}
    if answer.returncode or not states & USABLE:
        said = (answer.stdout + answer.stderr).strip() or "nothing"
        pytest.fail(f"no usable Slurm node (sinfo says: {said}): {SETUP}", pytrace=False)
    return run(["sinfo", "--version"]).stdout.strip()


def status_of(config: Path) -> dict[str, Any]:
    """`cachex status --json` of a run ({} before the agents wrote one)."""
    if not config.exists():
        return {}
    result = run([str(BIN / "cachex"), "status", "--json", "--config", str(config)])
    return json.loads(result.stdout) if result.returncode == 0 else {}


def levels_of(config: Path) -> dict[str, str]:
    return {row["id"]: row["level"] for row in status_of(config).get("checkpoints", [])}


def trainer_words(*extra: str) -> list[str]:
    return [str(BIN / "python"), str(TRAINER), *TRAIN, *extra]


def reference_state(workdir: Path) -> dict[str, Any]:
    """The trainer's final state after an uninterrupted run, straight under mpiexec."""
    for node in range(VNODES):
        (workdir / f"node{node}").mkdir(parents=True, exist_ok=True)
    out = workdir / "state.json"
    result = run([str(MPIEXEC), "-n", str(VNODES * RANKS_PER_NODE),
                  *trainer_words("--spool", f"{workdir}/node{{node}}/spool",
                                 "--every", "10", "--step-time", "0",
                                 "--state-out", str(out))], timeout=180)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return json.loads(out.read_text())


class LocalJob:
    """One submission of a Slurm template (scripts/slurm/local.sbatch unless told); its
    files under `workdir`, the virtual nodes' directories `workdir/node<N>/`."""

    def __init__(self, workdir: Path, name: str, template: Path = LOCAL) -> None:
        self.workdir, self.name, self.template = workdir, name, template
        workdir.mkdir(parents=True, exist_ok=True)
        self.id: str | None = None
        self.out = workdir / "job.out"

    @property
    def config(self) -> Path:
        return self.workdir / "cachex.toml"

    @property
    def state_out(self) -> Path:
        return self.workdir / "state.json"

    def train_cmd(self, every: int = 10, step_time: float = 0.05) -> str:
        words = trainer_words("--spool", f"{self.workdir}/node{{node}}/spool",
                              "--every", str(every), "--step-time", str(step_time),
                              "--state-out", str(self.state_out))
        return shlex.join(words)

    def submit(self, *sbatch_args: str, **variables: str) -> str:
        """sbatch the template; `variables` are the template's (TRAIN_CMD, HALT_MARGIN...)."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("CACHEX_", "SLURM_", "SBATCH_"))}
        env.update(CX_ROOT=str(ROOT), CX_BIN=str(BIN), RANKS_PER_NODE=str(RANKS_PER_NODE),
                   RUN_NAME="t")
        if self.template == LOCAL:
            env.update(WORKDIR=str(self.workdir), VNODES=str(VNODES))
        else:   # a real-cluster template on the `multi` partition: nodes share this host
            w = self.workdir
            env.update(SPOOL=f"{w}/node{{node}}/spool", STAGE=f"{w}/node{{node}}/shm",
                       CACHE=f"{w}/node{{node}}/nvme", PFS=f"{w}/pfs", FAILURE_DOMAIN="rank",
                       COMMIT_RULE="dcp", CONFIG_OUT=str(self.config), NODE_DIRS="",
                       CONFIG_EXTRA='[agent]\ntimeout = "20s"', SRUN_MPI="pmi2", MODULES="",
                       SRUN_TRAIN_FLAGS="", SRUN_AGENT_FLAGS="", AGENT_STOP_TIMEOUT="30",
                       DRAIN_TIMEOUT="120", TRAIN_STOP_GRACE="10", POLL="1")
        env.update(variables)
        self.out = self.workdir / f"job-{time.monotonic_ns()}.out"
        result = subprocess.run(
            ["sbatch", "--parsable", f"--job-name={self.name}", f"--output={self.out}",
             f"--chdir={self.workdir}", "--no-requeue", *sbatch_args, str(self.template)],
            capture_output=True, text=True, timeout=30, env=env, stdin=subprocess.DEVNULL)
        assert result.returncode == 0, f"sbatch failed: {result.stderr.strip()}"
        self.id = result.stdout.strip().split(";")[0]
        return self.id

    # ------------------------------------------------------------------ the job
    def fields(self) -> dict[str, str]:
        result = run(["scontrol", "-o", "show", "job", str(self.id)])
        assert result.returncode == 0, f"scontrol show job {self.id}: {result.stderr.strip()}"
        return dict(word.split("=", 1) for word in result.stdout.split() if "=" in word)

    def state(self) -> str:
        return self.fields()["JobState"]

    def wait(self, timeout: float, watch: Callable[[], None] | None = None
             ) -> tuple[str, str]:
        """Until the job ends: (JobState, ExitCode); cancelled and failed on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.fields()
            if fields["JobState"] in TERMINAL:
                return fields["JobState"], fields["ExitCode"]
            if time.monotonic() > deadline:
                self.cancel()
                raise AssertionError(f"job {self.id} still {fields['JobState']} after"
                                     f" {timeout:.0f}s; cancelled. Output:\n{self.tail()}")
            if watch is not None:
                watch()
            time.sleep(0.5)

    def steps(self) -> dict[str, list[str]]:
        """Running steps of the job by name (srun --job-name), e.g. {"train": ["12.3"]}."""
        result = run(["squeue", "-h", "--steps", "-j", str(self.id), "-o", "%i %j"])
        found: dict[str, list[str]] = {}
        for line in result.stdout.splitlines():
            step, _, name = line.strip().partition(" ")
            found.setdefault(name, []).append(step)
        return found

    def cancel(self) -> None:
        if self.id is not None and self.state() not in TERMINAL:
            run(["scancel", str(self.id)])

    def output(self) -> str:
        return self.out.read_text() if self.out.exists() else ""

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.output().splitlines()[-lines:])

    # ------------------------------------------------------------------ cachex
    def status(self) -> dict[str, Any]:
        return status_of(self.config)

    def levels(self) -> dict[str, str]:
        return levels_of(self.config)

    def cachex(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return run([str(BIN / "cachex"), *args, "--config", str(self.config)], timeout)
