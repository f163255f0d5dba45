"""Shared by every test tier: the configuration of N virtual nodes under one directory."""

from __future__ import annotations

from pathlib import Path


def virtual_nodes_config(root: Path, run: str, body: str = "", model: str = 'path = "peer"'
                         ) -> str:
    """Spool, stage, cache per virtual node (`{node}`), one PFS; failure domain `rank`.

    The write path is forced to `peer` by default: on this machine the "PFS" is the local
    disk, where `auto` soon learns to go direct and the tests of replication would lose
    what they test. The path-choice test asks for `auto`."""
    return f'''run = "{run}"
[paths]
spool = "{root}/node{{node}}/spool"
stage = "{root}/node{{node}}/shm"
cache = "{root}/node{{node}}/nvme"
pfs = "{root}/pfs"
[topology]
domain = "rank"
[model]
{model}
{body}'''
