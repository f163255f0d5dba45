"""Which nodes a failed training step failed on, from its launcher's error lines, so
that the job's relaunch leaves them out (the job templates' bad-node memory).

srun names the host and tasks of each rank that ended badly: `srun: error: n003: task 5:
Exited with exit code 1`, `... task 5: Segmentation fault`, `srun: error: Node failure on
n003`. Once one rank failed, srun (`--kill-on-bad-exit`) kills the others, and names
them too: `srun: error: n001: tasks 0-4: Killed`. So a node is blamed only when its
error comes before the first `Killed` or `Terminated` line: one killed by the step's
end is the other nodes' victim. When the failure is everywhere at once (half the nodes
or more), it is the trainer's, not the nodes': nobody is blamed.
"""

from __future__ import annotations

import re

_TASK = re.compile(r"^srun: error: (?P<host>[A-Za-z0-9._-]+): tasks? [0-9,-]+: (?P<how>.+)$")
_NODE = re.compile(r"^srun: error: Node failure on (?P<host>[A-Za-z0-9._-]+)")
_VICTIM = ("Killed", "Terminated")


def failed_hosts(text: str, hosts: list[str]) -> list[str]:
    """The hosts of `hosts` to blame for the step's failure, in the order srun named
    them; empty when it cannot tell or the failure was everywhere."""
    blamed: list[str] = []
    for line in text.splitlines():
        node = _NODE.match(line)
        if node:
            blamed.append(node["host"])
            continue
        task = _TASK.match(line)
        if task is None:
            continue
        if task["how"].strip() in _VICTIM:
            break
        blamed.append(task["host"])
    ours = list(dict.fromkeys(h for h in blamed if h in hosts))
    if 2 * len(ours) >= len(hosts):
        return []
    return ours
