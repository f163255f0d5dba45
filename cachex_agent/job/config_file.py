"""The configuration file a job writes from its template's variables: TOML written by a
writer, not by hand-escaping in bash, and read back with the agents' own parser before
any agent starts, so a bad value (or a bad CONFIG_EXTRA) ends the job at once naming
its key."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .. import config as configuration
from ..fsutil import makedirs, write_bytes


@dataclass(frozen=True)
class JobConfig:
    run: str
    spool: str
    stage: str
    cache: str
    pfs: str
    domain: str = "node"
    exclude: list[str] = field(default_factory=list)
    min_nodes: int = 0
    rule: str = "auto"
    extra: str = ""             # more TOML, as the template's CONFIG_EXTRA says it
    job: str = "local"

    def text(self) -> str:
        q = json.dumps          # a JSON string is a TOML basic string
        return "\n".join([
            f"# written by cachex job run for job {self.job}",
            f"run = {q(self.run)}",
            "[paths]", *(f"{k} = {q(getattr(self, k))}" for k in ("spool", "stage", "cache",
                                                                   "pfs")),
            "[topology]", f"domain = {q(self.domain)}",
            f"exclude = [{', '.join(q(h) for h in self.exclude)}]",
            f"min_nodes = {self.min_nodes}",
            "[commit]", f"rule = {q(self.rule)}",
            self.extra, ""])


def write_job_config(path: Path, job: JobConfig) -> configuration.Config:
    """Write `job` to `path` whole, then read it back as the agents will (ConfigError,
    naming the key, when it does not parse); the configuration read."""
    makedirs(path.parent)
    write_bytes(path, job.text().encode())
    return configuration.load(path, environ={})
