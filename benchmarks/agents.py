"""Real agents for the benchmarks: `mpiexec -n N cachex-agent` in a session of its own,
its log, each node's events, a bounded wait for an event, a drain at the end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import private_state  # noqa: E402,F401 (its runs are recorded apart from the user's)

from cachex_agent.events import read_events  # noqa: E402

BIN = Path(sys.executable).parent
Match = Callable[[dict[str, Any]], bool]


class AgentJob:
    """`events_of(node)` is where node's events.jsonl is (its journal under paths.cache)."""

    def __init__(self, config: Path, nodes: int, log: Path,
                 events_of: Callable[[int], Path], env: dict[str, str] | None = None,
                 poll: float = 0.005, stop_timeout: float = 60) -> None:
        self.config, self.nodes, self.events_of = config, nodes, events_of
        self.poll, self.stop_timeout = poll, stop_timeout
        self.log = log.open("wb")
        self.proc = subprocess.Popen(
            [str(BIN / "mpiexec"), "-n", str(nodes), str(BIN / "cachex-agent"), "--config",
             str(config)], stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **(env or {})})

    def started(self, timeout: float) -> list[dict[str, Any]]:
        """Every node's `agent_start` event (their pids)."""
        return [self.wait_event(node, lambda e: e["event"] == "agent_start", timeout)
                for node in range(self.nodes)]

    def events(self, node: int = 0) -> list[dict[str, Any]]:
        try:
            return read_events(self.events_of(node))
        except FileNotFoundError:
            return []

    def wait_event(self, node: int, match: Match, timeout: float) -> dict[str, Any]:
        """The newest event of `node` that matches; SystemExit if the agents exit or
        `timeout` passes first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [e for e in self.events(node) if match(e)]
            if found:
                return found[-1]
            if self.proc.poll() is not None:
                tail = Path(self.log.name).read_text()[-2000:]
                raise SystemExit(f"agents exited with {self.proc.returncode}:\n{tail}")
            time.sleep(self.poll)
        raise SystemExit(f"timed out after {timeout:.0f}s waiting for an event of node {node}")

    def close(self) -> None:
        """Drain (`cachex stop`), then wait; SIGKILL to the session if that hangs."""
        if self.proc.poll() is None:
            subprocess.run([str(BIN / "cachex"), "stop", "--timeout",
                            f"{self.stop_timeout:g}", "--config", str(self.config)],
                           capture_output=True, timeout=2 * self.stop_timeout)
        try:
            self.proc.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.log.close()
