"""The job's life as a pure function (cachex_agent/job/life.py): what a failed training
step, lost nodes, the time left and the scheduler's signals make the job do."""

from cachex_agent.job import life as j

NODES = ("n001", "n002", "n003", "n004")


def state(**fields):
    return j.JobState(**{"nodes": NODES, "spares": ("n005",), "training": True, **fields})


def kinds(decision):
    return [type(a).__name__ for a in decision.actions if not isinstance(a, j.Note)]


def notes(decision):
    return [a.text for a in decision.actions if isinstance(a, j.Note)]


def up(*lost):
    return frozenset(set(NODES) | {"n005"}) - set(lost)


def test_the_start_launches_training_resuming_when_there_is_a_checkpoint():
    d = j.decide(state(training=False), j.Started(resume=True))
    assert d.actions == (j.Train(resume=True),) and d.state.training


def test_training_that_ends_well_drains_done():
    d = j.decide(state(), j.TrainExited(0))
    assert d.actions == (j.Drain("done"),) and d.state.ended


def test_a_failure_with_every_node_up_stops_recovers_and_relaunches_resuming():
    d = j.decide(state(), j.TrainExited(1, captured=True, up=up()))
    assert kinds(d) == ["AtRisk", "StopAgents", "Recover", "StartAgents", "Train"]
    assert d.actions[-1] == j.Train(resume=True)
    assert d.state.relaunches == 1 and d.state.nodes == NODES and d.state.training


def test_without_a_checkpoint_the_relaunch_starts_over_without_a_recovery():
    d = j.decide(state(run="r"), j.TrainExited(1, captured=False, up=up()))
    assert kinds(d) == ["AtRisk", "StopAgents", "StartAgents", "Train"]
    assert d.actions[-1] == j.Train(resume=False)
    assert "no checkpoint of run r captured yet: relaunching from the start" in notes(d)


def test_a_lost_node_is_replaced_by_a_spare():
    d = j.decide(state(), j.TrainExited(137, captured=True, up=up("n002")))
    use = next(a for a in d.actions if isinstance(a, j.UseNodes))
    assert use.nodes == ("n001", "n003", "n004", "n005") and use.spares == ()
    assert d.state.nodes == use.nodes and d.state.spares == ()
    assert kinds(d) == ["AtRisk", "UseNodes", "StopAgents", "Recover", "StartAgents", "Train"]


def test_a_node_the_training_failed_on_is_left_out_for_good():
    """It still shows up in the scheduler: it was reused until the relaunches ran out."""
    d = j.decide(state(), j.TrainExited(1, captured=True, up=up(), failed_on=("n002",)))
    assert "n002" not in d.state.nodes and d.state.bad == {"n002"}
    assert "training failed on n002: left out of this job from now on" in notes(d)
    # later: the spares are gone, n002 up again in the scheduler; it is not taken back
    again = j.decide(d.state, j.TrainExited(1, captured=True, up=up("n003")))
    assert again.state.ended and again.actions[-1].verdict == "failed"


def test_too_few_spares_shrinks_down_to_min_nodes():
    d = j.decide(state(min_nodes=3), j.TrainExited(1, captured=True, up=up("n002", "n003")))
    use = next(a for a in d.actions if isinstance(a, j.UseNodes))
    assert use.nodes == ("n001", "n004", "n005")
    assert "going on with 3 of 4 nodes (MIN_NODES=3)" in use.note
    assert kinds(d)[-3:] == ["Recover", "StartAgents", "Train"]


def test_a_shrunk_set_gathers_the_checkpoint_for_a_trainer_that_loads_from_a_directory():
    """Fewer nodes than at the start: `cachex recover --to` and the trainer's
    LOAD_FROM_ARGS (a DCP checkpoint reshards on load); a spare keeping the count, a
    trainer that cannot load from a directory, or nothing captured: the spools, as
    before."""
    lost = j.TrainExited(1, captured=True, up=up("n002", "n003"))
    d = j.decide(state(min_nodes=3, full=4, load_from=True), lost)
    assert d.actions[-3:] == (j.Recover(gather=True), j.StartAgents(),
                              j.Train(resume=True, load=True))
    # later relaunches on the shrunk set gather again (the checkpoint may be the old one)
    again = j.decide(d.state, j.TrainExited(1, captured=True, up=up()))
    assert again.actions[-3:] == d.actions[-3:]
    spared = j.decide(state(full=4, load_from=True), j.TrainExited(1, True, up("n002")))
    cannot = j.decide(state(min_nodes=3, full=4), lost)
    for plain in (spared, cannot):
        assert plain.actions[-3:] == (j.Recover(), j.StartAgents(), j.Train(resume=True))
    fresh = j.decide(state(min_nodes=3, full=4, load_from=True),
                     j.TrainExited(1, captured=False, up=up("n002", "n003")))
    assert fresh.actions[-1] == j.Train(resume=False) and "Recover" not in kinds(fresh)


def test_below_min_nodes_or_with_min_nodes_zero_the_job_fails_with_one_reason():
    for minimum, why in ((4, "3 nodes, below MIN_NODES=4"),
                         (0, "recovery needs 4 nodes (MIN_NODES=0")):
        d = j.decide(state(min_nodes=minimum),
                     j.TrainExited(1, captured=True, up=up("n002", "n003")))
        assert d.state.ended and kinds(d) == ["AtRisk", "Drain"]
        drain = d.actions[-1]
        assert drain.verdict == "failed" and why in drain.why, drain


def test_when_the_scheduler_says_nothing_every_node_counts_as_up():
    d = j.decide(state(), j.TrainExited(1, captured=True, up=None))
    assert d.state.nodes == NODES and not d.state.ended
    assert "the scheduler said nothing of the job's nodes: every node taken as up" in notes(d)


def test_the_relaunches_run_out():
    s = state(max_relaunches=2)
    for _ in range(2):
        s = j.decide(s, j.TrainExited(1, captured=True, up=up())).state
    d = j.decide(s, j.TrainExited(1, captured=True, up=up()))
    assert d.actions == (j.Drain("failed", "training failed 3 times (MAX_RELAUNCHES=2)"),)


def test_the_time_left_halts_training_then_drains_as_halted():
    s = state(halt_margin=600)
    assert j.decide(s, j.TimeLeft(601)).actions == ()
    d = j.decide(s, j.TimeLeft(600))
    assert kinds(d) == ["AtRisk", "StopTraining"] and d.state.halting
    assert j.decide(d.state, j.TimeLeft(10)).actions == ()          # once
    # the stopped trainer exits non-zero: that is the halt, not a failure to relaunch
    end = j.decide(d.state, j.TrainExited(143, captured=True, up=up()))
    assert end.actions == (j.Drain("halt"),) and end.state.ended


def test_the_schedulers_warning_halts_at_once():
    d = j.decide(state(), j.Signal("USR1"))
    assert kinds(d) == ["AtRisk", "StopTraining"]
    # between launches (nothing trains): straight to the drain
    idle = j.decide(state(training=False), j.Signal("USR1"))
    assert idle.actions == (j.Drain("halt"),)


def test_sigterm_drains_what_it_can_and_ends():
    d = j.decide(state(), j.Signal("TERM"))
    assert d.actions[0].verdict == "term" and d.state.ended
    assert j.decide(d.state, j.TrainExited(0)).actions == ()         # nothing after the end


def test_nodes_lost_while_training_stop_the_step_and_only_then_the_loop_acts():
    d = j.decide(state(), j.NodesLost(frozenset({"n003", "x999"})))
    assert d.actions == (j.StopTraining("nodes lost: n003"),)
    assert j.decide(state(), j.NodesLost(frozenset({"n005"}))).actions == ()    # a spare


def test_an_agent_step_that_dies_while_training_runs_is_restarted_a_few_times():
    s = state(max_agent_restarts=1)
    d = j.decide(s, j.AgentsExited(1))
    assert d.actions[-1] == j.StartAgents(wait=False) and d.state.agent_restarts == 1
    again = j.decide(d.state, j.AgentsExited(1))
    assert kinds(again) == [] and "not restarted (MAX_AGENT_RESTARTS=1)" in notes(again)[0]
    # a relaunch gives the agents their restarts back
    relaunched = j.decide(again.state, j.TrainExited(1, captured=True, up=up()))
    assert relaunched.state.agent_restarts == 0
