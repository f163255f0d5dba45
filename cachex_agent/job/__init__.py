"""What the job templates (scripts/lib/cachex-job.sh) ask the package, as pure functions
behind `cachex job ...`: the node set and its spares, the nodes to blame and replace
after a failure, the configuration file of the job. Bash keeps the scheduler's
commands, signals, modules and launches."""
