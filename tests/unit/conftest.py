"""Fixtures the command-line tests share: a virtual-node configuration in tmp_path, and
an environment with nothing of the caller's in it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cachex_agent import config as configuration

RUN = "run1"


@pytest.fixture
def cli_environment(tmp_path, monkeypatch):
    """No stray CACHEX_* / SLURM settings or terminal size, no cachex.toml picked up
    from the cwd."""
    for var in list(os.environ):
        if var.startswith("CACHEX_") or var in ("SLURM_JOB_NAME", "COLUMNS", "LINES"):
            monkeypatch.delenv(var)
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "cachex.conf.toml"
    path.write_text(f"""\
run = "{RUN}"
[paths]
spool = "{tmp_path}/spool/{{node}}"
stage = "{tmp_path}/stage/{{node}}"
cache = "{tmp_path}/cache/{{node}}"
pfs = "{tmp_path}/pfs"
[topology]
domain = "rank"
""")
    return path


@pytest.fixture
def cfg(config_file: Path) -> configuration.Config:
    return configuration.load(config_file, environ={})

