"""The job's life as a pure function: `decide(state, event) -> (state, actions)`.

What a job does when its training step exits, when nodes are lost, when its time runs
out and when the scheduler signals it: relaunch, replace lost nodes with spares, shrink
onto fewer nodes, recover the checkpoint onto the node set, halt before the walltime,
drain. The supervisor (supervisor.py, `cachex job run`) gathers each event from the
scheduler (its adapter runs the commands), calls `decide`, and carries the actions out
in order; this module owns the choices (tests/unit/test_job_life.py). Like
node_policy.py, nothing here does I/O or reads a clock: time comes in as an event.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..errors import OperationError
from . import nodes as node_set


@dataclass(frozen=True)
class JobState:
    nodes: tuple[str, ...]              # the training nodes, sorted as cachex numbers them
    spares: tuple[str, ...] = ()
    min_nodes: int = 0                  # the fewest to go on with (0: never fewer)
    max_relaunches: int = 3
    max_agent_restarts: int = 3
    halt_margin: int = 600              # seconds before the end when the halt begins
    run: str = ""                       # the run's name, for what the job says
    full: int = 0                       # the training nodes the job started with
    load_from: bool = False             # the trainer resumes from a directory (LOAD_FROM_ARGS)
    relaunches: int = 0
    agent_restarts: int = 0
    bad: frozenset[str] = frozenset()   # nodes the training failed on: never used again
    training: bool = False              # a training step runs
    halting: bool = False
    ended: bool = False                 # drained: nothing more happens


# ------------------------------------------------------------------ events
@dataclass(frozen=True)
class Started:
    """The agents run; `resume`: the run has a checkpoint to start from."""
    resume: bool = False


@dataclass(frozen=True)
class TrainExited:
    status: int
    captured: bool = False              # the run has a checkpoint usable to resume
    up: frozenset[str] | None = None    # the hosts the scheduler has up; None: it said nothing
    failed_on: tuple[str, ...] = ()     # the hosts to blame (blame.failed_hosts)


@dataclass(frozen=True)
class AgentsExited:
    status: int


@dataclass(frozen=True)
class NodesLost:
    """The scheduler reports nodes of the job down while training runs."""
    hosts: frozenset[str]


@dataclass(frozen=True)
class TimeLeft:
    seconds: int


@dataclass(frozen=True)
class Signal:
    name: str                           # USR1: the scheduler's warning; TERM: the job ends


Event = Started | TrainExited | AgentsExited | NodesLost | TimeLeft | Signal


# ------------------------------------------------------------------ actions
@dataclass(frozen=True)
class Train:
    resume: bool
    load: bool = False                  # from the directory the recovery gathered into


@dataclass(frozen=True)
class StopTraining:
    """SIGTERM to the training step, SIGKILL after the grace."""
    why: str


@dataclass(frozen=True)
class StopAgents:
    pass


@dataclass(frozen=True)
class StartAgents:
    """`wait`: until they run (a start, a relaunch); else in the background, so that a
    restart beside running training never ends the job when its nodes are failing."""
    wait: bool = True


@dataclass(frozen=True)
class UseNodes:
    """The node set from now on: lost nodes replaced by spares, or shrunk."""
    nodes: tuple[str, ...]
    spares: tuple[str, ...]
    note: str


@dataclass(frozen=True)
class Recover:
    """`gather`: into one directory every rank reads (`cachex recover --to`), for a
    trainer that resumes from there on fewer nodes than the checkpoint's (a PyTorch
    DCP checkpoint reshards on load; recover refuses to spread one over fewer spools)."""
    gather: bool = False


@dataclass(frozen=True)
class AtRisk:
    when: str                           # relaunch | halt
    failure: str = ""                   # a relaunch's: crash | node (cachex advise --record)


@dataclass(frozen=True)
class Drain:
    """The final drain and the job's verdict: done | halt | failed | term."""
    verdict: str
    why: str = ""


@dataclass(frozen=True)
class Note:
    text: str


Action = (Train | StopTraining | StopAgents | StartAgents | UseNodes | Recover | AtRisk | Drain
          | Note)


@dataclass(frozen=True)
class Decision:
    state: JobState
    actions: tuple[Action, ...] = field(default_factory=tuple)


def decide(state: JobState, event: Event) -> Decision:
    """What the job does next."""
    if state.ended:
        return Decision(state)
    if isinstance(event, Started):
        return Decision(replace(state, training=True), (Train(event.resume),))
    if isinstance(event, TrainExited):
        return _train_exited(replace(state, training=False), event)
    if isinstance(event, AgentsExited):
        return _agents_exited(state, event)
    if isinstance(event, NodesLost):
        return _nodes_lost(state, event)
    if isinstance(event, TimeLeft):
        return _halt(state) if event.seconds <= state.halt_margin else Decision(state)
    if event.name == "USR1":
        return _halt(state)
    return Decision(replace(state, ended=True), (Drain("term", "SIGTERM: the job is ending"),))


def _halt(state: JobState) -> Decision:
    if state.halting:
        return Decision(state)
    halting = replace(state, halting=True)
    if state.training:
        return Decision(halting, (AtRisk("halt"), StopTraining("the halt before the walltime")))
    return _drain(halting, "halt")


def _drain(state: JobState, verdict: str, why: str = "") -> Decision:
    return Decision(replace(state, ended=True), (Drain(verdict, why),))


def _train_exited(state: JobState, event: TrainExited) -> Decision:
    if state.halting:
        return _drain(state, "halt")
    if event.status == 0:
        return _drain(state, "done")
    launch = state.relaunches + 1
    if state.relaunches >= state.max_relaunches:
        return _drain(state, "failed", f"training failed {launch} times"
                                       f" (MAX_RELAUNCHES={state.max_relaunches})")
    notes = [Note(f"training step failed with status {event.status} (launch {launch})")]
    bad = state.bad | (set(event.failed_on) & set(state.nodes))
    notes += [Note(f"training failed on {h}: left out of this job from now on")
              for h in sorted(bad - state.bad)]
    if event.up is None:
        up = set(state.nodes) | set(state.spares)
        notes.append(Note("the scheduler said nothing of the job's nodes: every node taken as up"))
    else:
        up = set(event.up)
    try:
        chosen = node_set.replace(list(state.nodes), list(state.spares), up - bad,
                                  state.min_nodes)
    except OperationError as exc:
        return Decision(replace(state, bad=frozenset(bad), ended=True),
                        (AtRisk("relaunch"), *notes, Drain("failed", str(exc))))
    before = state.nodes
    state = replace(state, bad=frozenset(bad), relaunches=launch, agent_restarts=0,
                    nodes=tuple(chosen.nodes), spares=tuple(chosen.spares), training=True)
    failure = "node" if bad - state.bad or set(before) - up else "crash"
    actions: list[Action] = [AtRisk("relaunch", failure), *notes]
    if state.nodes != before:
        actions.append(UseNodes(state.nodes, state.spares, "; ".join(chosen.notes)))
    actions.append(StopAgents())
    # fewer nodes than at the start: the checkpoint may be of more nodes than there are
    gather = event.captured and state.load_from and len(state.nodes) < state.full
    if event.captured:
        actions.append(Recover(gather))
    else:
        actions.append(Note(f"no checkpoint of run {state.run} captured yet: relaunching"
                            " from the start"))
    actions += [StartAgents(), Train(resume=event.captured, load=gather)]
    return Decision(state, tuple(actions))


def _agents_exited(state: JobState, event: AgentsExited) -> Decision:
    if not state.training or state.halting:
        return Decision(state)
    if state.agent_restarts >= state.max_agent_restarts:
        return Decision(state, (Note(f"the agent step exited ({event.status}); not restarted"
                                     f" (MAX_AGENT_RESTARTS={state.max_agent_restarts})"),))
    return Decision(replace(state, agent_restarts=state.agent_restarts + 1), (
        Note(f"the agent step exited ({event.status}) while training runs: restarting it"),
        StartAgents(wait=False)))


def _nodes_lost(state: JobState, event: NodesLost) -> Decision:
    lost = sorted(event.hosts & set(state.nodes))
    if not lost or not state.training:
        return Decision(state)
    return Decision(state, (StopTraining(f"nodes lost: {' '.join(lost)}"),))
