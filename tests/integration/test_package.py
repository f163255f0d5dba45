"""The package as a user installs it: a wheel in a fresh venv, without the `[model]`
extra (scipy, matplotlib), runs the agents and the commands that do not need the model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from harness import ROOT, Cluster, finish

from cachex_agent import __version__

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
TRAIN = ["--shard-size", "256KiB", "--chunk-size", "64KiB", "--step-time", "0.02"]


def _run(*command: str, timeout: float = 300, cwd=None) -> subprocess.CompletedProcess[str]:
    # without the checkout on PYTHONPATH: the wheel's own package and its own share/
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, cwd=cwd, env=env)


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


def _files(directory):
    return {p.relative_to(directory).as_posix(): (p.read_bytes(), p.stat().st_mode & 0o777)
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_the_trainer_and_templates_are_found_in_the_wheels_share(wheel_venv):
    found = _run(str(wheel_venv / "python"), "-c", "from cachex_agent import shipped;"
                 " print(shipped.trainer()); print(*shipped.templates().values())",
                 cwd=wheel_venv)     # not the checkout: `-c` imports from the cwd first
    assert found.returncode == 0, found.stderr
    trainer, templates = found.stdout.splitlines()
    share = wheel_venv.parent / "share" / "cachex-agent"
    assert trainer == str(share / "examples" / "trainer.py")
    assert all(t.startswith(f"{share}/scripts/") for t in templates.split()), templates


def test_templates_come_out_of_the_wheel_as_they_are_in_the_repository(wheel_venv, tmp_path):
    dest = tmp_path / "scripts"
    written = _run(str(wheel_venv / "cachex"), "templates", str(dest), cwd=tmp_path)
    assert written.returncode == 0, written.stderr
    expected = {name: data for name, data in _files(ROOT / "scripts").items()
                if not name.startswith("ci/")}
    assert _files(dest) == expected
    lines = written.stdout.strip().splitlines()
    assert sorted(lines[:-2]) == sorted(str(dest / name) for name in expected)
    site, local = lines[-2:]
    assert site.startswith("next: ") and f"CX_ROOT={tmp_path} CX_BIN={wheel_venv} " in site
    # the root that has both the lib and local.sbatch's example trainer
    assert (f"CX_ROOT={wheel_venv.parent}/share/cachex-agent CX_BIN={wheel_venv} sbatch"
            f" {dest}/slurm/local.sbatch") in local, local
    (dest / "pbs" / "cachex.pbs").write_text("# mine\n")
    again = _run(str(wheel_venv / "cachex"), "templates", str(dest))
    assert again.returncode == 2
    assert again.stderr.strip().splitlines() == [
        f"cachex: error: {dest}/slurm/frontier.sbatch: exists (give --force to overwrite"
        " it)"], again.stderr
    assert (dest / "pbs" / "cachex.pbs").read_text() == "# mine\n"
    forced = _run(str(wheel_venv / "cachex"), "templates", str(dest), "--force")
    assert forced.returncode == 0, forced.stderr
    assert _files(dest) == expected


@pytest.mark.timeout(400)
def test_the_demo_runs_from_the_wheel_without_the_model_extra(wheel_venv, tmp_path):
    workdir = tmp_path / "demo"
    demo = _run(str(wheel_venv / "cachex"), "demo", "--workdir", str(workdir), "--steps",
                "20", "--shard-size", "1MiB", timeout=360)
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    lines = demo.stdout.splitlines()
    assert any(line.startswith("demo: final state equals an uninterrupted run's")
               for line in lines), demo.stdout
    assert lines[-1] == ("demo: the durability model is skipped: its libraries are the"
                         " [model] extra (pip install 'cachex-agent[model]')"), lines[-1]
    assert "Traceback" not in demo.stderr, demo.stderr
