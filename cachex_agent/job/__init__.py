"""The job around the agents. The job templates (scripts/lib/cachex-job.sh) load the
modules and hand the batch shell over to `cachex job run` (run_cli.py): start.py reads
the template's variables through shell.py, checks them (variables.py), chooses the node
set (nodes.py), writes the configuration (config_file.py), reads the time left and
stages the environment; then supervisor.py runs the job's life over the pure
life.decide, with the scheduler's commands in adapters.py and their output read by
scheduler.py and blame.py. Bash keeps modules and the launch lines."""
