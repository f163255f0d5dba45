"""Shared by every test tier: the configuration of N virtual nodes; the `cachex` script's
entry point run in this process."""

from __future__ import annotations

import sys
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


def virtual_nodes_config(root: Path, run: str, body: str = "", model: str = 'path = "peer"',
                         spool: str = "spool") -> str:
    """Spool, stage, cache per virtual node (`{node}`), one PFS; failure domain `rank`."""
    return cluster_config(run, f"{root}/node{{node}}/{spool}", f"{root}/node{{node}}/shm",
                          f"{root}/node{{node}}/nvme", f"{root}/pfs", "rank", body, model)


def run_main(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """What the `cachex` script does: cli.main() with sys.argv; (exit code, out, err)."""
    from cachex_agent import cli
    monkeypatch.setattr(sys, "argv", ["cachex", *args])
    capsys.readouterr()
    try:
        cli.main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err
