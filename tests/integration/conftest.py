"""Fixtures of the integration tests: virtual-node clusters and tmpfs mounts (root)."""

from __future__ import annotations

import subprocess

import pytest
from harness import Cluster


@pytest.fixture
def cluster(tmp_path):
    made = []

    def make(**kwargs) -> Cluster:
        made.append(Cluster(tmp_path, **kwargs))
        return made[-1]
    yield make
    for c in made:
        c.close()


@pytest.fixture
def tmpfs():
    mounted = []

    def mount(path, size: str):
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       check=True)
        mounted.append(path)
    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)
