"""Issue 29: capture by hard link. Spool and stage of each virtual node share one file
system (tmp_path) and the layout is DCP's, whose every save goes into new files: the
agents capture by link (the staged file is the trainer's inode). Then the trainer
rewrites a captured file in place, as torch.save over an existing file would, while the
stage that reads it next is held (CACHEX_TEST_HOLD) and the agents killed; restarted,
they must never serve those bytes as the checkpoint: no replica or bundle holds them,
and the events and the status name the mismatch."""

from __future__ import annotations

import os

import pytest
from harness import Cluster, files_of, kill_tree, wait_for
from test_resume import CKPT, PARTS, named, stages, write_checkpoint

from cachex_agent.flush.bundle import extract
from cachex_agent.layout import replica_dir, replica_manifest_path

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
REWRITTEN = "__1_0.distcp"      # node 1's file the trainer rewrites after its capture
MISMATCH = "captured by hard link: the trainer rewrote its file in place since"


def hold_then_rewrite(c: Cluster, stage: str, also_done: tuple[str, ...] = ()) -> None:
    """Agents holding `stage` on node 1 capture the checkpoint by link; once node 1's
    capture (and `also_done`) is done and `stage` runs held, they are SIGKILLed and the
    trainer's file is rewritten in place."""
    c.start_agents(env={"CACHEX_TEST_HOLD": f"{stage}:1"})
    write_checkpoint(c)
    wait_for(lambda: stages(c, 1).get(stage) == "running"
             and stages(c, 0).get("capture") == "done"
             and all(stages(c, 1).get(s) == "done" for s in ("capture", *also_done)), 90,
             f"{stage} running on node 1 after its capture (now {stages(c, 1)})")
    assert_linked(c, fed=stage == "replicate")
    kill_tree(c.agents)
    spooled = c.spool(1) / CKPT / REWRITTEN
    with open(spooled, "r+b") as handle:        # the same inode, other bytes
        handle.write(b"rewritten in place after the capture")
    assert (c.stage(1) / CKPT / REWRITTEN).read_bytes() == spooled.read_bytes()


def assert_linked(c: Cluster, fed: bool) -> None:
    """Every file of every node's part is the trainer's inode, linked into the stage;
    `fed`: on the peer path (one partner), hashed and Put from a mapping under a read
    lease (leases are on here), else read."""
    for node, part in PARTS.items():
        for rel in part:
            staged, spooled = (c.stage(node) / CKPT / rel).stat(), (c.spool(node) / CKPT / rel)
            assert staged.st_ino == spooled.stat().st_ino, (node, rel)
            assert staged.st_nlink == 2, (node, rel)
    # the journal says done just before the event is written
    captured = wait_for(lambda: named(c, 1, "captured"), 30, "node 1's captured event")
    assert captured[0]["linked"] == len(PARTS[1]), captured
    assert captured[0]["leased"] == (len(PARTS[1]) if fed else 0), captured


def assert_replica_refused(c: Cluster) -> None:
    """Node 0 holds no replica of node 1's part, and node 1 says why."""
    replicas = c.root / "node0" / "nvme" / "t" / "replicas"
    assert not replica_manifest_path(replicas, 1, CKPT).exists()
    assert not replica_dir(replicas, 1, CKPT).exists()
    failed = wait_for(lambda: named(c, 1, "replicate_failed"), 60, "node 1's replication fails")
    assert f"{REWRITTEN}: checksum differs from the capture's" in failed[-1]["error"]
    assert MISMATCH in failed[-1]["error"]


def named_any(c: Cluster, node: int, event: str, ckpt: str) -> list[dict]:
    return [e for e in c.events(node) if e["event"] == event and e.get("ckpt") == ckpt]


@pytest.fixture
def two_nodes(cluster):
    return cluster(nodes=2)


def test_rewritten_before_the_flush_fails_the_checkpoint_naming_the_mismatch(cluster):
    c = cluster(nodes=2, model='path = "direct"')
    hold_then_rewrite(c, "flush")
    c.start_agents()
    c.wait_level(CKPT, "failed", timeout=120)
    record = next(r for r in c.status()["checkpoints"] if r["id"] == CKPT)
    assert "flush impossible" in record["reason"] and MISMATCH in record["reason"], record
    failed = [e for e in named(c, 1, "flush_error") if e["final"]]
    assert f"{REWRITTEN}: checksum" in failed[-1]["error"] and MISMATCH in failed[-1]["error"]
    # no bundle of either node stays on the PFS as this checkpoint
    wait_for(lambda: not list((c.pfs / "ckpt" / CKPT).glob("node-*.h5")), 60,
             "the failed checkpoint's bundles purged")
    assert c.stop() == 0


def test_rewritten_before_the_replication_is_never_a_replica(two_nodes, tmp_path):
    """Node 1's bundle was written from the bytes it captured (held replication only):
    the checkpoint is flushed with them, and node 0 never holds the rewritten ones."""
    c = two_nodes
    hold_then_rewrite(c, "replicate", also_done=("flush",))
    c.start_agents()
    assert_replica_refused(c)
    c.wait_level(CKPT, "flushed", timeout=120)
    out = tmp_path / "extracted"
    extract(c.pfs / "ckpt" / CKPT / "node-00001.h5", out)
    assert files_of(out) == PARTS[1]                        # the bytes of the capture
    verified = c.cachex("verify", CKPT)                     # the stage copy is not them
    assert verified.returncode != 0 and "checksum mismatch" in verified.stdout, verified
    assert c.stop() == 0


def test_trackers_are_copied_and_a_directory_of_its_own_is_linked(cluster):
    """DeepSpeed: `latest` at the spool root is rewritten by every save (copied); the
    files of `global_step1/` are linked."""
    c = cluster(nodes=2, rule="deepspeed", commit='settle = "500ms"')
    c.start_agents()
    ckpt = "global_step1"
    for node in (0, 1):
        (c.spool(node) / ckpt).mkdir()
        (c.spool(node) / ckpt / f"zero_pp_rank_{node}_mp_rank_00_optim_states.pt").write_bytes(
            os.urandom(200_000))
    (c.spool(0) / ckpt / "mp_rank_00_model_states.pt").write_bytes(os.urandom(100_000))
    (c.spool(0) / "latest").write_text(ckpt)
    c.wait_level(ckpt, "flushed", timeout=120)
    staged = c.stage(0) / ckpt
    tracker = next(p for p in staged.rglob("latest"))
    assert tracker.stat().st_nlink == 1
    assert tracker.stat().st_ino != (c.spool(0) / "latest").stat().st_ino
    for path in (c.spool(0) / ckpt).iterdir():
        assert (staged / path.name).stat().st_ino == path.stat().st_ino, path.name
    assert c.stop() == 0


@pytest.mark.parametrize("capture, nlink", [("auto", 1), ("link", 2)])
def test_a_single_file_is_copied_unless_link_is_asked_for(cluster, capture, nlink):
    """torch.save may rewrite a file in place: `auto` copies it; `stage.capture = "link"`
    (a writer known to save under new names) links it."""
    c = cluster(nodes=2, rule="torch", commit='settle = "500ms"',
                extra=f'[stage]\ncapture = "{capture}"')
    c.start_agents()
    (c.spool(0) / "step1.pt").write_bytes(os.urandom(150_000))
    c.wait_level("step1.pt", "flushed", timeout=120)
    (staged,) = [p for p in (c.stage(0) / "step1.pt").rglob("step1.pt")]
    assert staged.stat().st_nlink == nlink
    assert (staged.stat().st_ino == (c.spool(0) / "step1.pt").stat().st_ino) is (nlink == 2)
    assert named_any(c, 0, "captured", "step1.pt")[0]["linked"] == nlink - 1
    assert c.stop() == 0
