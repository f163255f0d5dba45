"""shellcheck (Debian's package) passes on every script under scripts/."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from stubs import SCRIPTS

SCRIPTS_ALL = sorted(p for p in SCRIPTS.rglob("*")
                     if p.is_file() and (p.suffix in (".sh", ".sbatch", ".pbs")
                                         or p.read_bytes().startswith(b"#!")))


def test_every_script_is_checked():
    names = {p.name for p in SCRIPTS_ALL}
    assert {"cachex-job.sh", "frontier.sbatch", "neuron.sbatch", "local.sbatch",
            "cachex.pbs", "polaris.pbs", "aurora.pbs", "setup-slurm.sh"} <= names


def test_shellcheck_passes_on_every_script():
    if shutil.which("shellcheck") is None:
        if os.geteuid() != 0:
            pytest.skip("shellcheck is not installed: apt-get install shellcheck")
        pytest.fail("shellcheck is not installed (CI installs it: .ci/run, make test)")
    result = subprocess.run(["shellcheck", "-x", *map(str, SCRIPTS_ALL)], capture_output=True,
                            text=True, timeout=120, cwd=SCRIPTS)
    assert result.returncode == 0, result.stdout + result.stderr
