"""`cachex job run`: the job's life after its start (start.py), in one process. The job
library (scripts/lib/cachex-job.sh) loads the modules and hands its batch shell over
(`exec`: the scheduler's signals reach this process). The supervisor gathers events
(a step's exit, lost nodes, the time left on its own monotonic clock, USR1 and TERM),
asks life.decide what to do, and does it: each launch line comes from the job library
(`cx_step`, the site's launcher and flags), each scheduler query from an adapter."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from ..errors import OperationError
from . import life
from .adapters import Pbs, Slurm, kill_group
from .shell import BatchShell

HALT_SLACK = 30             # seconds kept between a step's timeout and the job's end


@dataclass
class Settings:
    scheduler: str
    job_id: str
    shell: BatchShell               # the template's launch lines
    rundir: Path                    # the job's own files
    cachex: str                     # the venv's cachex
    config: str
    run_name: str
    ranks_per_node: int
    time_left: int | None           # seconds, as the scheduler said at the start
    vnodes: int = 0                 # virtual nodes on one host (local.sbatch): no adapter
    resume: str = "auto"
    train_stop_grace: int = 60
    agent_start_timeout: int = 300
    agent_stop_timeout: int = 120
    drain_timeout: int = 900
    recover_timeout: int = 1800
    halt_exit: int = 0
    poll: float = 2.0
    node_dirs: bool = False         # NODE_DIRS to make on the nodes before the agents
    master_addr_from: str = "name"


@dataclass
class Steps:
    agents: subprocess.Popen | None = None
    train: subprocess.Popen | None = None
    tee: threading.Thread | None = None
    checked: bool = False
    life0: str = "-"
    signals: list[str] = field(default_factory=list)


class Finished(Exception):
    def __init__(self, status: int) -> None:
        self.status = status


def log(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} cachex-job: {text}", flush=True)


def die(text: str, status: int = 1) -> Finished:
    print(f"{time.strftime('%H:%M:%S')} cachex-job: error: {text}", file=sys.stderr, flush=True)
    return Finished(status)


class Supervisor:
    def __init__(self, settings: Settings, state: life.JobState) -> None:
        self.s, self.state, self.steps = settings, state, Steps()
        self.adapter = (Slurm(settings.job_id) if settings.scheduler == "slurm"
                        else Pbs(settings.job_id))
        self.end = None if settings.time_left is None else time.monotonic() + settings.time_left

    # ------------------------------------------------------------ the run
    def run(self) -> int:
        for name in ("USR1", "TERM"):
            signal.signal(getattr(signal, f"SIG{name}"), self._on_signal)
        try:
            self._start()
            while True:
                for event in self._events():
                    self._act(event)
                time.sleep(self.s.poll)
        except Finished as done:
            return done.status
        finally:
            for proc in (self.steps.train, self.steps.agents):
                if proc is not None and proc.poll() is None:
                    kill_group(proc)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.steps.signals.append(signal.Signals(signum).name[3:])

    def _start(self) -> None:
        words = self._state_words()
        resume = self.s.resume == "yes" or (self.s.resume == "auto" and int(words[5]) > 0)
        if resume:
            log(f"run {self.s.run_name} has a checkpoint on the PFS: recovering it before"
                " training")
            if not self._recover():
                raise die("cachex recover failed at the start; RESUME=no starts over")
        self._start_agents()
        self._act(life.Started(resume))

    def _events(self) -> list[life.Event]:
        events: list[life.Event] = [life.Signal(s) for s in self.steps.signals]
        self.steps.signals.clear()
        left = self._left()
        if left is not None:
            events.append(life.TimeLeft(int(left)))
        train, agents = self.steps.train, self.steps.agents
        if train is not None and train.poll() is not None:
            events.append(self._train_exited(train.returncode))
        elif agents is not None and agents.poll() is not None:
            self.steps.agents = None
            events.append(life.AgentsExited(agents.returncode))
        return events

    def _left(self) -> float | None:
        return None if self.end is None else self.end - time.monotonic()

    def _act(self, event: life.Event) -> None:
        if isinstance(event, life.Signal) and event.name == "USR1":
            log("USR1: the scheduler warns that the job ends soon: halting now")
            margin = self.state.halt_margin
            if self.end is None or self.end > time.monotonic() + margin:
                self.end = time.monotonic() + margin
        decision = life.decide(self.state, event)
        self.state = decision.state
        for action in decision.actions:
            getattr(self, f"_do_{type(action).__name__.lower()}")(action)

    def _train_exited(self, status: int) -> life.TrainExited:
        self.steps.train = None
        if self.steps.tee is not None:
            self.steps.tee.join(timeout=30)     # its last lines name the nodes to blame
        if self.s.vnodes:
            return life.TrainExited(status, self._captured(), frozenset(self._all_hosts()))
        nodes = list(self.state.nodes)
        errors = (self.s.rundir / "train.err").read_text(errors="replace")
        failed_on = tuple(self.adapter.failed_on(errors, nodes))
        up = self.adapter.up(self._all_hosts())
        for note in up.notes:
            log(note)
        return life.TrainExited(status, self._captured(), frozenset(up.hosts), failed_on)

    def _all_hosts(self) -> list[str]:
        return [*self.state.nodes, *self.state.spares]

    # ------------------------------------------------------------ actions
    def _do_note(self, action: life.Note) -> None:
        log(action.text)

    def _do_atrisk(self, action: life.AtRisk) -> None:
        try:
            said = subprocess.run([self.s.cachex, "status", "--at-risk", "--config",
                                   self.s.config], capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            log(f"{action.when}: work at risk not known: no answer within 60s")
            return
        text = (said.stdout + said.stderr).rstrip("\n")
        if said.returncode != 0:
            log(f"{action.when}: work at risk not known: {(text.splitlines() or ['?'])[-1]}")
            return
        first, _, rest = text.partition("\n")
        log(f"{action.when}: {first}")
        for line in rest.splitlines():
            print(f"    {line}", flush=True)
        if action.failure:
            self._advise(action.failure)

    def _advise(self, failure: str) -> None:
        """The failure that ended the step goes into the run's history (the rates of
        `cachex advise`), and the advice for the next launch into the job's log."""
        argv = [self.s.cachex, "advise", "--config", self.s.config, "--record", failure]
        try:
            said = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            log("advice: no answer within 60s")
            return
        lines = (said.stdout + said.stderr).strip().splitlines()
        log(f"advice: {lines[-1] if lines else f'none (status {said.returncode})'}")

    def _do_usenodes(self, action: life.UseNodes) -> None:
        if action.note:
            log(action.note)

    def _do_train(self, action: life.Train) -> None:
        if action.load:     # LOAD_FROM_ARGS names it, expanded at launch
            self.s.shell.assigned["CX_LOAD_FROM"] = str(self._gathered())
        how = "load" if action.load else "resume" if action.resume else ""
        argv = self._launch("train", self.s.ranks_per_node, how)
        log(f"training: {' '.join(argv)}")
        err = (self.s.rundir / "train.err").open("w")
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True, env=self._train_env())
        self.steps.tee = threading.Thread(target=_tee, args=(proc.stderr, err), daemon=True)
        self.steps.tee.start()
        self.steps.train = proc

    def _train_env(self) -> dict[str, str]:
        return {**os.environ,
                "MASTER_ADDR": master_addr(self.state.nodes[0], self.s.master_addr_from)}

    def _do_stoptraining(self, action: life.StopTraining) -> None:
        proc = self.steps.train
        if proc is None or proc.poll() is not None:
            return
        left = self._left()
        ends = f"the job ends in {int(left)}s; " if left is not None else ""
        log(f"halt: {ends}SIGTERM to the training step" if self.state.halting
            else f"{action.why}: SIGTERM to the training step")
        self.adapter.signal("train", proc, "TERM")
        if not _wait(proc, self.s.train_stop_grace):
            log(f"training still running after {self.s.train_stop_grace}s: SIGKILL")
            self.adapter.signal("train", proc, "KILL")
            if not _wait(proc, 30):
                kill_group(proc)

    def _do_stopagents(self, _action: life.StopAgents | None = None,
                       timeout: int | None = None) -> int:
        proc, self.steps.agents = self.steps.agents, None
        if proc is None:
            return 0
        wait = self._fit(self.s.agent_stop_timeout if timeout is None else timeout)
        if proc.poll() is None:
            log(f"stopping the agents: cachex stop --timeout {wait}")
            try:
                said = subprocess.run([self.s.cachex, "stop", "--config", self.s.config,
                                       "--timeout", str(wait)], capture_output=True,
                                      text=True, timeout=wait + 30)
            except subprocess.TimeoutExpired:
                log(f"cachex stop did not return within {wait + 30}s")
            else:
                if said.returncode != 0:
                    log(f"cachex stop: {(said.stdout + said.stderr).strip().splitlines()[-1]}")
        if not _wait(proc, 30):
            log("the agent step is still running: killing it")
            self.adapter.signal("cachex-agents", proc, "KILL")
            if not _wait(proc, 30):
                kill_group(proc)
        self._quiet([self.s.cachex, "job", "withdraw-stop", "--config", self.s.config])
        status = proc.returncode if proc.returncode is not None else 137
        log(f"agent step ended with status {status}")
        return status

    def _do_startagents(self, action: life.StartAgents) -> None:
        if action.wait:
            self._start_agents()
            return
        # beside running training: a stop request no agent read (they died) would stop
        # the new ones at once; their directories exist; no wait (its nodes may be
        # failing: the training step's exit then decides)
        self._quiet([self.s.cachex, "job", "withdraw-stop", "--config", self.s.config])
        argv = self._launch("agents", 1)
        log(f"agents: {' '.join(argv)}")
        self.steps.agents = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                             start_new_session=True)

    def _start_agents(self) -> None:
        if self._run_step("prepare", 1) != 0:
            raise die("could not create the node directories (NODE_DIRS) on the nodes")
        if not self.steps.checked:
            if self._run_step("check", 1) != 0:
                raise die("the agents' pre-flight check failed (its message is above)", 2)
            self.steps.checked = True
        argv = self._launch("agents", 1)
        log(f"agents: {' '.join(argv)}")
        self.steps.life0 = self._state_words()[1]
        self.steps.agents = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                             start_new_session=True)
        self._wait_ready()

    def _wait_ready(self) -> None:
        """Live agents of this start: a coordinator's life other than the one before it
        (no clock of two hosts compared)."""
        deadline = time.monotonic() + self.s.agent_start_timeout
        while True:
            words = self._state_words()
            if words[0] == "running" and words[1] not in ("-", self.steps.life0):
                log(f"agents running on {self._node_count()} nodes")
                return
            proc = self.steps.agents
            if proc is not None and proc.poll() is not None:
                self.steps.agents = None
                raise die(f"the agent step exited with status {proc.returncode} before it"
                          " was running (see its messages above)")
            if time.monotonic() > deadline:
                raise die(f"the agents did not report running within"
                          f" {self.s.agent_start_timeout}s (AGENT_START_TIMEOUT)")
            time.sleep(1)

    def _node_count(self) -> int:
        return self.s.vnodes or len(self.state.nodes)

    def _do_recover(self, action: life.Recover) -> None:
        if not self._recover(self._gathered() if action.gather else None):
            self._finish("failed", "cachex recover failed after the training failure (its"
                                   " message is above)")

    def _gathered(self) -> Path:
        """This relaunch's directory of the checkpoint gathered for every rank (in the
        job's own directory, which is on the shared file system the job was submitted
        from; rebuilt from the run's copies, so left for the user to remove)."""
        return self.s.rundir / f"load-{self.state.relaunches}"

    def _recover(self, to: Path | None = None) -> bool:
        argv = self._launch("recover", 1) + ([] if to is None else ["--to", str(to)])
        log(f"recover: {' '.join(argv)}")
        wait = self._fit(self.s.recover_timeout, halt=True)
        status = _run(argv, wait)
        if status != 0:
            log(f"cachex recover ended with status {status}")
        return status == 0

    def _do_drain(self, action: life.Drain) -> None:
        if action.verdict == "term":
            self._term()
        self._finish(action.verdict, action.why)

    def _term(self) -> None:
        log("SIGTERM: the job is ending; the agents drain first")
        proc = self.steps.agents
        if proc is not None and proc.poll() is None:
            self.adapter.signal("cachex-agents", proc, "TERM")
            if not _wait(proc, self._fit(self.s.agent_stop_timeout)):
                log(f"the agents still run after {self.s.agent_stop_timeout}s: killing them")
        raise Finished(143)

    def _finish(self, verdict: str, why: str = "") -> None:
        log(f"final drain: the newest checkpoint goes to the PFS"
            f" (DRAIN_TIMEOUT={self.s.drain_timeout}s)")
        status = self._do_stopagents(timeout=self.s.drain_timeout)
        _, _, newest, level, *_ = self._state_words()
        for line in self._quiet([self.s.cachex, "ls", "--config", self.s.config],
                                120).splitlines():
            print(f"    {line}", flush=True)
        if verdict == "failed":
            raise die(f"{why}; newest checkpoint {newest} at level {level}")
        if newest != "-" and level != "flushed":
            raise die(f"the newest checkpoint {newest} is at level {level}, not flushed to"
                      " the PFS")
        if status != 0:
            raise die(f"the agent step ended with status {status} during the final drain")
        if verdict == "done":
            log(f"training finished; newest checkpoint {newest} is on the PFS")
            raise Finished(0)
        log(f"halted before the walltime; newest checkpoint {newest} is on the PFS; resubmit"
            " to continue (RESUME=auto)")
        raise Finished(self.s.halt_exit)

    # ------------------------------------------------------------ helpers
    def _fit(self, want: int, halt: bool = False) -> int:
        """That timeout, cut to what is left of the job (minus HALT_SLACK); with `halt`,
        to what is left before the halt, so that a recovery never eats the drain's
        window."""
        left = self._left()
        if left is None:
            return want
        room = left - self.state.halt_margin if halt else left - HALT_SLACK
        return max(1, min(want, int(room)))

    def _captured(self) -> bool:
        return int(self._state_words()[4]) > 0

    def _state_words(self) -> list[str]:
        words = self._quiet([self.s.cachex, "job", "state", "--config", self.s.config]).split()
        return words if len(words) == 6 else ["-", "-", "-", "-", "0", "0"]

    @staticmethod
    def _quiet(argv: list[str], timeout: float = 60) -> str:
        """A command's output (stdout and stderr); "" when it could not run in time."""
        try:
            said = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return said.stdout + (said.stderr if said.returncode else "")

    def _launch(self, kind: str, ppn: int, arg: str = "") -> list[str]:
        """The step's command line on the node set of the moment (the job library's)."""
        try:
            return self.s.shell.step(kind, ppn, self.state.nodes, self.state.spares, arg)
        except OperationError as exc:
            raise die(str(exc)) from exc

    def _run_step(self, kind: str, ppn: int) -> int:
        if kind == "prepare" and not self.s.node_dirs:
            return 0
        argv = self._launch(kind, ppn)
        log(f"{kind}: {' '.join(argv)}")
        return _run(argv, None)


def master_addr(first: str, how: str) -> str:
    """The training step's MASTER_ADDR: the first training node (rank 0) by name, or
    by its address where the site asks for one (Frontier: `hostname -i`, resolved here
    for that node, which need not be the batch node)."""
    if how != "address":
        return first
    try:
        return str(socket.getaddrinfo(first, None)[0][4][0])
    except OSError:
        return first


def _tee(source: IO[bytes], sink: IO[str]) -> None:
    """The trainer's errors to the job's and into a file, which names the nodes to blame
    when it fails."""
    for line in iter(source.readline, b""):
        sys.stderr.buffer.write(line)
        sys.stderr.flush()
        sink.write(line.decode(errors="replace"))
        sink.flush()
    sink.close()


def _wait(proc: subprocess.Popen, seconds: float) -> bool:
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return False
    return True


def _run(argv: list[str], timeout: float | None) -> int:
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True)
    if _wait(proc, timeout if timeout is not None else 1e9):
        return proc.returncode
    kill_group(proc)
    proc.wait()
    return 124


def run(settings: Settings, state: life.JobState) -> int:
    """The job from its agents' start to its verdict: the exit status of the job."""
    return Supervisor(settings, state).run()
