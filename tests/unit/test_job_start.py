"""The job's start in Python (job/variables.py, job/shell.py, job/start.py): the
template's variables checked with one line naming the bad one, read from the batch
shell as the job library saved it, and the packed venv made again only when a package
changed."""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from cachex_agent.errors import ConfigError
from cachex_agent.job.shell import BatchShell
from cachex_agent.job.start import pack
from cachex_agent.job.variables import NAMES, parse

pytestmark = pytest.mark.timeout(60)
LIB = Path(__file__).resolve().parents[2] / "scripts" / "lib" / "cachex-job.sh"
GOOD = {"CX_SCHEDULER": "slurm", "CX_BIN": "/v/bin", "TRAIN_CMD": "python t.py"}


def test_the_defaults_fill_what_the_template_left_empty():
    v = parse({**GOOD, "SLURM_JOB_NAME": "llm", "SLURM_JOB_ID": "42", "HALT_MARGIN": ""})
    assert v["RUN_NAME"] == "llm" and v.job_id == "42" and v.number("HALT_MARGIN") == 600
    assert v.nodes is None and v.vnodes == 0 and v.job_end is None
    assert v.stage_tar == "/v.tar" and not v.on("STAGE_VENV")
    assert parse({**GOOD, "STAGE_TAR": "/o/t.tar"}).stage_tar == "/o/t.tar"
    assert parse(GOOD).job_id == "local" and parse(GOOD)["RUN_NAME"] == "cachex"


@pytest.mark.parametrize(("given", "line"), [
    ({"TRAIN_CMD": ""}, "TRAIN_CMD is not set (see the variables at the top of the template)"),
    ({"CX_SCHEDULER": "lsf"}, "CX_SCHEDULER=lsf: expected slurm or pbs"),
    ({"SPARES": "-1"}, "SPARES=-1: expected a whole number"),
    ({"POLL": "fast"}, "POLL=fast: expected seconds"),
    ({"VNODES": "0"}, "VNODES=0: expected a number > 0"),
    ({"JOB_END": "tomorrow"}, "JOB_END=tomorrow: expected epoch seconds"),
    ({"RESUME": "maybe"}, "RESUME=maybe: expected auto, yes or no"),
    ({"MASTER_ADDR_FROM": "ip"}, "MASTER_ADDR_FROM=ip: expected name or address"),
    ({"MPIEXEC_FLAVOR": "aprun"}, "MPIEXEC_FLAVOR=aprun: expected hydra, pals or openmpi"),
    ({"AGENT_ENV_UNSET": "A-B"}, "AGENT_ENV_UNSET=A-B: expected variable names"),
    ({"STAGE_VENV": "1", "STAGE_DIR": "rel/dir"},
     "STAGE_DIR=rel/dir: expected an absolute node-local directory (STAGE_VENV=1)"),
    ({"STAGE_VENV": "1", "STAGE_DIR": "/d", "CX_SCHEDULER": "pbs"},
     "STAGE_VENV=1: staging uses Slurm's sbcast, which pbs has not; set STAGE_VENV=0"),
])
def test_a_bad_variable_is_one_line_naming_it(given, line):
    with pytest.raises(ConfigError) as raised:
        parse({**GOOD, **given})
    assert str(raised.value) == line and raised.value.exit_code == 2


def test_the_batch_shells_variables_and_launch_lines_as_the_library_saved_them(tmp_path):
    """Values with quotes and newlines come back whole; the step's line is built for
    the node set given, with the values the package settled."""
    script = (f'CX_SCHEDULER=slurm; CX_RUNDIR={tmp_path}; CX_BIN=/v/bin; X=/py;'
              ' TRAIN_CMD=$\'"$X" run.py\\n --n 2\'; SRUN_MPI=; AGENT_ENV_UNSET=;'
              f' source {LIB}; cx_save_vars')
    subprocess.run(["bash", "-c", script], check=True, timeout=30,
                   env={"PATH": os.environ["PATH"]})
    shell = BatchShell(LIB, tmp_path / "vars")
    said = shell.read(NAMES)
    assert said["TRAIN_CMD"] == '"$X" run.py\n --n 2' and said["PBS_JOBID"] == ""
    shell.assigned.update(CACHEX_CONFIG="/c 1.toml", STAGE_VENV="0")
    line = shell.step("recover", 1, ("n1", "n2"), ("n3",))
    assert line == ["srun", "--job-name=cachex-recover", "--kill-on-bad-exit=1", "--nodes=2",
                    "--ntasks-per-node=1", "--nodelist=n1,n2", "--overlap", "/v/bin/cachex",
                    "recover", "--config", "/c 1.toml"]
    train = shell.step("train", 2, ("n1",), (), "resume")
    assert train[-5:] == ["/py", "run.py", "--n", "2", "--resume"], train   # $X at launch


def test_the_packed_venv_is_made_once_and_again_after_a_package_changed(tmp_path):
    venv, tar = tmp_path / "venv", tmp_path / "venv.tar"
    site = venv / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    (site / "a.py").write_text("a")
    pack(venv, tar)
    assert "./lib/python3.11/site-packages/a.py" in tarfile.open(tar).getnames()
    made = tar.stat().st_mtime_ns
    pack(venv, tar)
    assert tar.stat().st_mtime_ns == made                  # nothing changed: kept
    (site / "b.py").write_text("b")
    os.utime(site, (tar.stat().st_mtime + 5,) * 2)
    pack(venv, tar)
    assert "./lib/python3.11/site-packages/b.py" in tarfile.open(tar).getnames()
    assert not list(tmp_path.glob("venv.tar.tmp.*"))
