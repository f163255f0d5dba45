"""The job around the agents: what the job templates (scripts/lib/cachex-job.sh) ask the
package at a job's start (`cachex job nodes|config|left`: the node set and its spares,
the configuration file, the time left), and the job's life after it (`cachex job run`:
supervisor.py over the pure life.decide, with the scheduler's commands in adapters.py
and their output read by scheduler.py and blame.py). Bash keeps modules, staging and
the launch lines."""
