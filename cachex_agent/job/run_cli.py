"""`cachex job run`: the command the job library hands its batch shell over to."""

from __future__ import annotations

from pathlib import Path

import click

from . import life, supervisor


@click.command("run")
@click.option("--scheduler", type=click.Choice(["slurm", "pbs"]), required=True)
@click.option("--job-id", required=True)
@click.option("--lib", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              required=True, help="scripts/lib/cachex-job.sh: the launch lines")
@click.option("--rundir", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="the job's own files; `vars` there: the batch shell's variables")
@click.option("--cachex", "cachex_bin", required=True, help="the venv's cachex")
@click.option("--config", required=True, help="the job's cachex.toml")
@click.option("--run-name", required=True)
@click.option("--nodes", required=True, help="the training nodes, blank-separated")
@click.option("--spares", default="")
@click.option("--vnodes", type=int, default=0)
@click.option("--min-nodes", type=int, default=0)
@click.option("--ranks-per-node", type=int, default=1)
@click.option("--time-left", type=int, default=None, help="seconds, as the scheduler said")
@click.option("--resume", type=click.Choice(["auto", "yes", "no"]), default="auto")
@click.option("--max-relaunches", type=int, default=3)
@click.option("--max-agent-restarts", type=int, default=3)
@click.option("--halt-margin", type=int, default=600)
@click.option("--halt-exit", type=int, default=0)
@click.option("--train-stop-grace", type=int, default=60)
@click.option("--agent-start-timeout", type=int, default=300)
@click.option("--agent-stop-timeout", type=int, default=120)
@click.option("--drain-timeout", type=int, default=900)
@click.option("--recover-timeout", type=int, default=1800)
@click.option("--poll", type=float, default=2.0)
def run_command(nodes: str, spares: str, min_nodes: int, max_relaunches: int,
                max_agent_restarts: int, halt_margin: int, cachex_bin: str, run_name: str,
                **settings: object) -> None:
    """Supervise the job from its agents' start to its verdict (the job's exit status):
    relaunches, lost nodes, spares, the halt before the walltime, the final drain."""
    state = life.JobState(tuple(nodes.split()), tuple(spares.split()), min_nodes,
                          max_relaunches, max_agent_restarts, halt_margin, run_name)
    settings.update(cachex=cachex_bin, run_name=run_name)
    status = supervisor.run(supervisor.Settings(**settings), state)  # type: ignore[arg-type]
    raise SystemExit(status)
