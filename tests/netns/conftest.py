"""Fixtures of the namespace tier: clusters of namespaced virtual nodes (root only)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))      # nsharness.py

from nsharness import NsCluster  # noqa: E402

if os.geteuid() != 0:
    pytest.skip("namespace tier: needs root (namespaces, veths, mounts); CI runs as root",
                allow_module_level=True)


@pytest.fixture
def ns_cluster(tmp_path):
    made = []

    def make(**kwargs) -> NsCluster:
        made.append(NsCluster(tmp_path, **kwargs))
        return made[-1]
    yield make
    for c in made:
        c.close()
