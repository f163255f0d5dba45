"""The package as a user installs it: a wheel in a fresh venv, without the `[model]`
extra (scipy, matplotlib), runs the agents and the commands that do not need the model."""

from __future__ import annotations

import subprocess
import sys

import pytest
from harness import ROOT, Cluster, finish

from cachex_agent import __version__

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
TRAIN = ["--shard-size", "256KiB", "--chunk-size", "64KiB", "--step-time", "0.02"]


def _run(*command: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory):
    """The wheel built from this checkout, installed with only the `[mpi]` extra."""
    where = tmp_path_factory.mktemp("wheel")
    built = _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(where),
                 str(ROOT))
    assert built.returncode == 0, built.stderr
    assert "Deprecat" not in built.stderr, built.stderr
    (wheel,) = where.glob("cachex_agent-*.whl")
    venv = where / "venv"
    assert _run(sys.executable, "-m", "venv", str(venv)).returncode == 0
    installed = _run(str(venv / "bin/python"), "-m", "pip", "install", "-q",
                     f"{wheel}[mpi]", timeout=540)
    assert installed.returncode == 0, installed.stderr
    return venv / "bin"


def test_wheel_without_the_model_extra_installs_and_says_its_version(wheel_venv):
    for module in ("scipy", "matplotlib"):
        missing = _run(str(wheel_venv / "python"), "-c", f"import {module}")
        assert missing.returncode != 0, f"{module} came with the wheel"
    for command in ("cachex", "cachex-agent"):
        result = _run(str(wheel_venv / command), "--version")
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == f"{command}, version {__version__}"
    license_file = _run(str(wheel_venv / "python"), "-c",
                        "import importlib.metadata as m; print(m.metadata('cachex-agent')"
                        "['License-Expression'])")
    assert license_file.stdout.strip() == "Apache-2.0"


def test_agents_without_scipy_protect_checkpoints_and_the_model_says_what_it_needs(
        wheel_venv, tmp_path):
    c = Cluster(tmp_path, nodes=2, model='path = "auto"', bin=wheel_venv)
    try:
        c.start_agents()
        finish(c.trainer("--steps", "12", "--every", "4", *TRAIN, ranks=4))
        for step in ("step_00004", "step_00008", "step_00012"):
            c.wait_level(step, "flushed")
        assert c.cachex("verify", "step_00012").returncode == 0
        reasons = {e.get("reason", "") for e in c.events(0) if e["event"] == "committed"}
        assert any("cachex-agent[model]" in r for r in reasons), reasons
        assert c.stop() == 0
        fit = c.cachex("model", "fit")
        assert fit.returncode == 1
        assert fit.stderr.strip().splitlines() == [
            "cachex: error: the durability model needs scipy: pip install"
            " 'cachex-agent[model]'"], fit.stderr
    finally:
        c.close()
