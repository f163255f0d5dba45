"""`cachex job run`: the command the job library hands its batch shell over to."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import CachexError
from .shell import BatchShell
from .start import run_job
from .supervisor import die


@click.command("run")
@click.option("--lib", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              required=True, help="scripts/lib/cachex-job.sh: the launch lines")
@click.option("--vars", "saved", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              required=True, help="the batch shell's variables, as the job library saved them")
def run_command(lib: Path, saved: Path) -> None:
    """Run the job from its start to its verdict (the job's exit status): the node set,
    the configuration, staging, then relaunches, lost nodes, spares, the halt before
    the walltime, the final drain. A bad variable: one line, exit 2."""
    try:
        status = run_job(BatchShell(lib, saved))
    except CachexError as exc:
        status = die(str(exc), exc.exit_code).status
    raise SystemExit(status)
