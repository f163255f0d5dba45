"""The template's variables, read from the batch shell and checked here before anything
runs on the nodes: a bad one ends the job with one line naming it (exit 2). The
defaults of docs/jobs.md's variables table live here, not in the job library; what
only the library's launch lines read (launcher flags, MODULES, TRAIN_ENV) it reads
itself."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import PurePath

from ..errors import ConfigError

DEFAULTS = {
    "FAILURE_DOMAIN": "node", "COMMIT_RULE": "auto", "RANKS_PER_NODE": "1", "SPARES": "0",
    "MIN_NODES": "0", "RESUME": "auto", "HALT_MARGIN": "600", "HALT_EXIT": "0",
    "MAX_RELAUNCHES": "3", "MAX_AGENT_RESTARTS": "3", "TRAIN_STOP_GRACE": "60",
    "POLL": "2", "AGENT_START_TIMEOUT": "300", "AGENT_STOP_TIMEOUT": "120",
    "DRAIN_TIMEOUT": "900", "RECOVER_TIMEOUT": "1800", "STAGE_VENV": "0",
    "MODULE_PURGE": "0", "CRAY_LD_FIRST": "0", "MASTER_ADDR_FROM": "name",
    "MPIEXEC_FLAVOR": "hydra", "CX_PLAN": "0",
}
WHOLE = ("SPARES", "RANKS_PER_NODE", "HALT_MARGIN", "HALT_EXIT", "MAX_RELAUNCHES",
         "MAX_AGENT_RESTARTS", "AGENT_START_TIMEOUT", "AGENT_STOP_TIMEOUT", "DRAIN_TIMEOUT",
         "RECOVER_TIMEOUT", "TRAIN_STOP_GRACE", "MIN_NODES")
CHOICES = {"RESUME": ("auto", "yes", "no"), "STAGE_VENV": ("0", "1"),
           "MODULE_PURGE": ("0", "1"), "CRAY_LD_FIRST": ("0", "1"),
           "MASTER_ADDR_FROM": ("name", "address"),
           "MPIEXEC_FLAVOR": ("hydra", "pals", "openmpi"), "CX_SCHEDULER": ("slurm", "pbs")}
REQUIRED = ("CX_SCHEDULER", "CX_BIN", "TRAIN_CMD", "RUN_NAME")
OTHERS = ("NODES", "VNODES", "EXCLUDE_NODES", "JOB_END", "STAGE_DIR", "STAGE_TAR",
          "AGENT_ENV_UNSET", "NODE_DIRS", "LOAD_FROM_ARGS", "CACHEX_CONFIG", "CONFIG_OUT",
          "SPOOL", "STAGE", "CACHE", "PFS", "CONFIG_EXTRA", "CX_RUNDIR", "SLURM_JOB_ID",
          "SLURM_JOB_NAME", "SLURM_JOB_NODELIST", "PBS_JOBID", "PBS_JOBNAME", "PBS_NODEFILE")
NAMES = sorted({*DEFAULTS, *WHOLE, *CHOICES, *REQUIRED, *OTHERS})


@dataclass(frozen=True)
class JobVars:
    raw: Mapping[str, str]          # every name of NAMES, defaults applied

    def __getitem__(self, name: str) -> str:
        return self.raw[name]

    def number(self, name: str) -> int:
        return int(self.raw[name])

    def on(self, name: str) -> bool:
        return self.raw[name] == "1"

    @property
    def scheduler(self) -> str:
        return self.raw["CX_SCHEDULER"]

    @property
    def job_id(self) -> str:
        return self.raw["SLURM_JOB_ID"] or self.raw["PBS_JOBID"] or "local"

    @property
    def vnodes(self) -> int:
        return int(self.raw["VNODES"] or 0)

    @property
    def nodes(self) -> int | None:
        return int(self.raw["NODES"]) if self.raw["NODES"] else None

    @property
    def job_end(self) -> int | None:
        return int(self.raw["JOB_END"]) if self.raw["JOB_END"] else None

    @property
    def stage_tar(self) -> str:
        """The packed venv: STAGE_TAR, or beside the venv (CX_BIN/..)."""
        return self.raw["STAGE_TAR"] or f"{PurePath(self.raw['CX_BIN']).parent}.tar"


def parse(said: Mapping[str, str]) -> JobVars:
    """The values the batch shell gave, with the defaults where it gave none; ConfigError
    naming the first bad one."""
    raw = {name: said.get(name, "") for name in NAMES}
    raw["RUN_NAME"] = raw["RUN_NAME"] or raw["SLURM_JOB_NAME"] or raw["PBS_JOBNAME"] or "cachex"
    for name, default in DEFAULTS.items():
        raw[name] = raw[name] or default
    problem = next(_problems(raw), None)
    if problem is not None:
        raise ConfigError(problem)
    return JobVars(raw)


def _problems(raw: Mapping[str, str]) -> Iterator[str]:   # the first is the job's one line
    for name in REQUIRED:
        if not raw[name]:
            yield f"{name} is not set (see the variables at the top of the template)"
    for name in WHOLE:
        if not re.fullmatch(r"[0-9]+", raw[name]):
            yield f"{name}={raw[name]}: expected a whole number"
    for name, pattern, what in (("POLL", r"[0-9]*\.?[0-9]+", "seconds"),
                                ("VNODES", r"|[1-9][0-9]*", "a number > 0"),
                                ("NODES", r"|[1-9][0-9]*", "a number > 0"),
                                ("JOB_END", r"|[0-9]+", "epoch seconds"),
                                ("AGENT_ENV_UNSET", r"[A-Za-z_][A-Za-z0-9_ ]*|", "variable names")):
        if not re.fullmatch(pattern, raw[name]):
            yield f"{name}={raw[name]}: expected {what}"
    for name, allowed in CHOICES.items():
        if raw[name] not in allowed:
            yield f"{name}={raw[name]}: expected {_either(allowed)}"
    if raw["STAGE_VENV"] == "1":
        yield from _staging_problems(raw)


def _staging_problems(raw: Mapping[str, str]) -> Iterator[str]:
    if raw["CX_SCHEDULER"] != "slurm":
        yield (f"STAGE_VENV=1: staging uses Slurm's sbcast, which {raw['CX_SCHEDULER']} has"
               " not; set STAGE_VENV=0")
    if not re.fullmatch(r"/.*[^/]", raw["STAGE_DIR"]):
        yield (f"STAGE_DIR={raw['STAGE_DIR']}: expected an absolute node-local directory"
               " (STAGE_VENV=1)")


def _either(allowed: tuple[str, ...]) -> str:
    return ", ".join(allowed[:-1]) + " or " + allowed[-1]
