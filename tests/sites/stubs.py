"""A fake site for the job templates: Slurm/PBS variables, a `module` command and
srun/sbcast/mpirun/mpiexec/scontrol stubs on PATH that record their command lines (and
whether MPICH_GPU_SUPPORT_ENABLED reached them) in one log. No real scheduler."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
TEMPLATES = {"frontier": SCRIPTS / "slurm" / "frontier.sbatch",
             "neuron": SCRIPTS / "slurm" / "neuron.sbatch",
             "local": SCRIPTS / "slurm" / "local.sbatch",
             "pbs": SCRIPTS / "pbs" / "cachex.pbs",
             "polaris": SCRIPTS / "pbs" / "polaris.pbs",
             "aurora": SCRIPTS / "pbs" / "aurora.pbs"}

RECORD = r'''#!/bin/bash
{ printf '%s' "${0##*/}"; printf ' %q' "$@"
  printf ' | MPICH_GPU_SUPPORT_ENABLED=%s\n' "${MPICH_GPU_SUPPORT_ENABLED-unset}"
} >>"$CX_FAKE_LOG"
'''
# srun and mpiexec also run their command here when CX_FAKE_EXEC=1 (one task)
LAUNCH = RECORD + r'''[[ ${CX_FAKE_EXEC:-0} == 1 ]] || exit 0
while [[ $# -gt 0 && $1 == -* ]]; do
    case $1 in -n|-ppn|-f|--hostfile|--ppn|--map-by) shift 2 ;; *) shift ;; esac
done
exec "$@"
'''
SCONTROL = r'''#!/usr/bin/env python3
import re, sys
if sys.argv[1:3] != ["show", "hostnames"]:
    sys.exit(0)
if sys.argv[3].count("[") != sys.argv[3].count("]"):
    sys.exit(f"scontrol: error: Invalid node name specified: {sys.argv[3]}")
for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", sys.argv[3]):
    m = re.fullmatch(r"(.*)\[(\d+)-(\d+)\]", part)
    if not m:
        print(part)
        continue
    width = len(m.group(2))
    for i in range(int(m.group(2)), int(m.group(3)) + 1):
        print(f"{m.group(1)}{i:0{width}d}")
'''
STUBS = {"srun": LAUNCH, "mpiexec": LAUNCH, "mpirun": LAUNCH, "sbcast": RECORD,
         "module": RECORD, "squeue": "#!/bin/sh\nexit 0\n", "sinfo": "#!/bin/sh\nexit 0\n",
         "scontrol": SCONTROL}


class FakeSite:
    def __init__(self, tmp: Path, scheduler: str, hosts: int = 10) -> None:
        self.tmp, self.bin, self.log = tmp, tmp / "fakebin", tmp / "calls.log"
        self.bin.mkdir()
        for name, text in STUBS.items():
            (self.bin / name).write_text(text)
            (self.bin / name).chmod(0o755)
        # a plan with no venv at CX_BIN asks the package through PATH's cachex
        (self.bin / "cachex").symlink_to(Path(sys.executable).parent / "cachex")
        self.hosts = [f"n{i:03d}" for i in range(1, hosts + 1)]
        nodefile = tmp / "nodefile"
        nodefile.write_text("".join(f"{h}\n" * 4 for h in self.hosts))
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("SLURM_", "PBS_", "CACHEX_", "MPICH_"))}
        self.env.update(PATH=f"{self.bin}:{os.environ['PATH']}", CX_FAKE_LOG=str(self.log),
                        USER="u", HOME="/home/u", CX_ROOT=str(ROOT), CX_PLAN="1",
                        CX_BIN="/home/u/cachex-agent/.venv/bin", CX_RUNDIR=str(tmp / "run"))
        if scheduler == "slurm":
            self.env.update(SLURM_JOB_ID="42", SLURM_JOB_NAME="llm-cachex",
                            SLURM_JOB_NODELIST=f"n[001-{hosts:03d}]",
                            SLURM_JOB_ACCOUNT="ABC123", SLURM_SUBMIT_DIR="/scratch/u")
        else:
            self.env.update(PBS_JOBID="42.pbs", PBS_NODEFILE=str(nodefile),
                            PBS_O_WORKDIR=str(tmp), MPIEXEC="mpiexec")

    def run(self, template: str, **variables: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", str(TEMPLATES[template])], capture_output=True,
                              text=True, timeout=60, env={**self.env, **variables},
                              stdin=subprocess.DEVNULL, cwd=self.tmp)

    def plan(self, template: str, **variables: str) -> list[tuple[str, list[str]]]:
        """The job's steps in the order it would run them: (kind, words)."""
        result = self.run(template, **variables)
        assert result.returncode == 0, result.stderr
        return [(kind, shlex.split(words)) for kind, _, words in
                (line[5:].partition(": ") for line in result.stdout.splitlines()
                 if line.startswith("plan "))]

    def calls(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def execute(self, words: list[str], **env: str) -> list[str]:
        """Run a planned step through the stubs; the calls it made."""
        before = len(self.calls())
        subprocess.run(words, check=True, timeout=60, env={**self.env, **env},
                       stdin=subprocess.DEVNULL, cwd=self.tmp)
        return self.calls()[before:]


def directives(template: str, prefix: str = "#SBATCH") -> dict[str, str]:
    found = {}
    for line in TEMPLATES[template].read_text().splitlines():
        if line.startswith(prefix + " "):
            option, _, value = line[len(prefix) + 1:].strip().partition("=")
            found[option] = value
    return found


def default(template: str, variable: str) -> str:
    match = re.search(rf"^{variable}=\$\{{{variable}:?-\"?([^}}\"]*)\"?\}}$",
                      TEMPLATES[template].read_text(), re.M)
    assert match, f"{template}: no `{variable}=${{{variable}:-...}}` line"
    return match.group(1)


def hours(walltime: str) -> float:
    h, m, s = (int(x) for x in walltime.split(":"))
    return h + m / 60 + s / 3600


def flag(words: list[str], name: str) -> str | None:
    for w in words:
        if w.startswith(name + "="):
            return w.split("=", 1)[1]
    return None
