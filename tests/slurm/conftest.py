"""Fixtures of the Slurm tests: a running Slurm (or a failure saying how to get one),
the reference final state of the example trainer, jobs cancelled after each test."""

from __future__ import annotations

import pytest
from slurm_harness import LocalJob, reference_state, require_slurm


@pytest.fixture(scope="session")
def slurm() -> str:
    return require_slurm()


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> dict:
    return reference_state(tmp_path_factory.mktemp("reference"))


@pytest.fixture
def local_job(slurm, tmp_path):
    made: list[LocalJob] = []

    def make(name: str = "cx-test", **kwargs) -> LocalJob:
        made.append(LocalJob(tmp_path / f"job{len(made)}", name, **kwargs))
        return made[-1]
    yield make
    for job in made:
        if job.id is not None:
            job.cancel()
