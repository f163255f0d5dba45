"""Shared by every test tier: the configuration of N virtual nodes under one directory."""

from __future__ import annotations

from pathlib import Path


def virtual_nodes_config(root: Path, run: str, body: str = "") -> str:
    """Spool, stage, cache per virtual node (`{node}`), one PFS; failure domain `rank`."""
    return f'''run = "{run}"
[paths]
spool = "{root}/node{{node}}/spool"
stage = "{root}/node{{node}}/shm"
cache = "{root}/node{{node}}/nvme"
pfs = "{root}/pfs"
[topology]
domain = "rank"
{body}'''
