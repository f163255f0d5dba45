"""Shared by every test tier: the configuration of N virtual nodes."""

from __future__ import annotations

from pathlib import Path


def cluster_config(run: str, spool: str, stage: str, cache: str, pfs: str, domain: str,
                   body: str = "", model: str = 'path = "peer"') -> str:
    """One configuration file of a run: its paths, failure domain, model and `body`.

    The write path is forced to `peer` by default: on this machine the "PFS" is the local
    disk, where `auto` soon learns to go direct and the tests of replication would lose
    what they test. The path-choice test asks for `auto`."""
    return f'''run = "{run}"
[paths]
spool = "{spool}"
stage = "{stage}"
cache = "{cache}"
pfs = "{pfs}"
[topology]
domain = "{domain}"
[model]
{model}
{body}'''


def virtual_nodes_config(root: Path, run: str, body: str = "", model: str = 'path = "peer"'
                         ) -> str:
    """Spool, stage, cache per virtual node (`{node}`), one PFS; failure domain `rank`."""
    return cluster_config(run, f"{root}/node{{node}}/spool", f"{root}/node{{node}}/shm",
                          f"{root}/node{{node}}/nvme", f"{root}/pfs", "rank", body, model)
