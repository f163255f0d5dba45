"""The on-disk layout: the one module that names cachex's files and directories.

    <spool>/<ckpt>/                          the trainer's checkpoint (the trainer owns it)
    <spool>/.<ckpt>.tmp-cachex-partial/      a recovery assembling <ckpt> (fsutil.partial_path)
    <spool>/.cachex-unrecoverable-<name>[.N] what a recovery would have replaced or hidden:
                                             a newer checkpoint, a file that differs
    <stage>/<run>/<ckpt>/                    the captured copy
    <cache>/<run>/journal/                   the agent's durable state (journal.py):
        state.json  coordinator.json  status.json  events.jsonl  stop
        manifests/<ckpt>.json                this node's local manifest
        global/<ckpt>.json                   the global manifest
        global/<ckpt>/files/<path>           global files mirrored to every node
    <cache>/<run>/replicas/node-<owner>/<ckpt>/                partners' parts
    <cache>/<run>/replicas/node-<owner>/<ckpt>.manifest.json   written last
    <pfs>/<run>/index.json  status.json  control/stop  coordinator.lock
    <pfs>/<run>/ckpt/<ckpt>/manifest.json  node-<NNNNN>.h5
    <pfs>/<run>/events/node-<NNNNN>.jsonl   each node's events, appended at every flush
    <pfs>/<run>/events/node-<NNNNN>.old.jsonl   the previous one, once that reached its cap

A name too long for one component with its suffix or prefix is replaced by a hash
(fsutil.derived_name). Functions take the root they build under (a node's NodePaths, a
PFS run directory, a journal, a replica root) and do no I/O, except the listings, which
read a directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .fsutil import derived_name, partial_path
from .versions import trainer_name

INDEX = "index.json"
STATUS = "status.json"
MANIFEST = "manifest.json"          # the global manifest, in a PFS checkpoint directory
JOURNAL_STATE = "state.json"
COORDINATOR_STATE = "coordinator.json"
RUN_LOCK = "coordinator.lock"
EVENTS = "events.jsonl"
PFS_EVENTS_DIR = "events"
PFS_EVENTS_SUFFIX = ".jsonl"
PFS_EVENTS_OLD_SUFFIX = ".old.jsonl"
STOP = "stop"
REPLICA_MANIFEST_SUFFIX = ".manifest.json"
PARITY_MANIFEST_SUFFIX = ".parity.json"
SET_ASIDE_PREFIX = ".cachex-unrecoverable-"
#: files of a checkpoint that live at the spool root (trackers such as DeepSpeed's
#: `latest`, single-file checkpoints) are kept under this name inside its captured tree
SPOOL_ROOT = ".cachex-root"


@dataclass(frozen=True)
class NodePaths:
    """Where one node's data lives. `stage`, `cache` and `pfs` are already per run."""

    spool: Path
    stage: Path
    cache: Path
    pfs: Path

    @classmethod
    def of_run(cls, spool: Path, stage: Path, cache: Path, pfs: Path, run: str) -> NodePaths:
        """From the rendered roots: everything but the trainer's spool is per run."""
        return cls(spool, run_dir(stage, run), run_dir(cache, run), run_dir(pfs, run))

    @property
    def journal(self) -> Path:
        return journal_dir(self.cache)

    @property
    def replicas(self) -> Path:
        return self.cache / "replicas"

    @property
    def parity(self) -> Path:
        """The parity chunks this node holds for its erasure group (peer.scheme)."""
        return self.cache / "parity"

    def spool_dir(self, ckpt: str) -> Path:
        """Every version of a name is saved under the trainer's name (versions.py)."""
        return ckpt_dir(self.spool, trainer_name(ckpt))

    def stage_dir(self, ckpt: str) -> Path:
        return ckpt_dir(self.stage, ckpt)


def run_dir(root: Path, run: str) -> Path:
    """A run's directory under a rendered stage, cache or PFS root."""
    return root / run


def ckpt_dir(root: Path, ckpt: str) -> Path:
    """A checkpoint's directory in a spool or a stage."""
    return root / ckpt


def root_entry(name: str) -> str:
    """The path inside a captured checkpoint of `name`, a file at the spool root."""
    return f"{SPOOL_ROOT}/{name}"


def spool_root_name(relpath: str) -> str | None:
    """The spool-root file name a captured path stands for (None: an ordinary path)."""
    head, _, name = relpath.partition("/")
    return name if head == SPOOL_ROOT and name and "/" not in name else None


def spool_file(spool: Path, ckpt: str, relpath: str) -> Path:
    """Where a captured path of `ckpt` (any version) lives in the trainer's spool: a
    spool-root file (a single-file checkpoint, a tracker) at the root, every other one in
    its directory."""
    name = spool_root_name(relpath)
    return spool / name if name is not None else ckpt_dir(spool, trainer_name(ckpt)) / relpath


def journal_dir(cache_run: Path) -> Path:
    return cache_run / "journal"


def node_dir_name(node: int) -> str:
    """`node-NNNNN`: a node's replicas, bundle, and exported part are named so."""
    return f"node-{node:05d}"


# ------------------------------------------------------------------------ spool
def recover_partial_dir(spool: Path, ckpt: str) -> Path:
    """fsutil's partial name: what an interrupted recovery left is a temporary like any
    other (fsutil.is_temporary), removed by fsutil.remove_temporaries."""
    return partial_path(ckpt_dir(spool, ckpt))


def set_aside_dir(spool: Path, ckpt: str, attempt: int = 1) -> Path:
    """Where a recovery sets `ckpt` (a spool entry) aside; `attempt` > 1 when an earlier
    recovery's is still there (`.cachex-unrecoverable-<ckpt>.2`)."""
    suffix = f".{attempt}" if attempt > 1 else ""
    return spool / derived_name(ckpt, suffix=suffix, prefix=SET_ASIDE_PREFIX)


# ---------------------------------------------------------------------- journal
def local_manifests_dir(journal: Path) -> Path:
    return journal / "manifests"


def global_manifests_dir(journal: Path) -> Path:
    return journal / "global"


def local_manifest_path(journal: Path, ckpt: str) -> Path:
    return local_manifests_dir(journal) / derived_name(ckpt, ".json")


def journal_global_manifest_path(journal: Path, ckpt: str) -> Path:
    return global_manifests_dir(journal) / derived_name(ckpt, ".json")


def journal_global_manifest_paths(journal: Path) -> list[Path]:
    return sorted(global_manifests_dir(journal).glob("*.json"))


def global_files_dir(journal: Path, ckpt: str) -> Path:
    return global_manifests_dir(journal) / ckpt / "files"


def events_path(journal: Path) -> Path:
    return journal / EVENTS


def journal_status_path(journal: Path) -> Path:
    return journal / STATUS


def journal_stop_file(journal: Path) -> Path:
    return journal / STOP


# --------------------------------------------------------------------- replicas
def replica_owner_dir(replicas: Path, owner: int) -> Path:
    return replicas / node_dir_name(owner)


def replica_dir(replicas: Path, owner: int, ckpt: str) -> Path:
    return replica_owner_dir(replicas, owner) / ckpt


def replica_manifest_path(replicas: Path, owner: int, ckpt: str) -> Path:
    """Beside the replica's directory, not in it: a trainer file called `manifest.json`
    cannot collide with it."""
    return replica_owner_dir(replicas, owner) / derived_name(ckpt, REPLICA_MANIFEST_SUFFIX)


def replica_manifest_paths(replicas: Path) -> list[Path]:
    """Every replica manifest under `replicas`, by owner directory."""
    owners = sorted(replicas.glob("node-*")) if replicas.is_dir() else []
    return [path for owner in owners for path in owner.glob(f"*{REPLICA_MANIFEST_SUFFIX}")]


# ----------------------------------------------------------------------- parity
def parity_dir(parity: Path, ckpt: str) -> Path:
    return parity / ckpt


def parity_chunk_path(parity: Path, ckpt: str, codeword: int, index: int) -> Path:
    """Parity `index` of `codeword` (peer/erasure.py's layout)."""
    return parity_dir(parity, ckpt) / f"codeword-{codeword:03d}.parity-{index:03d}"


def parity_manifest_path(parity: Path, ckpt: str) -> Path:
    """Beside the chunks' directory, as a replica's manifest is."""
    return parity / derived_name(ckpt, PARITY_MANIFEST_SUFFIX)


def parity_manifest_paths(parity: Path) -> list[Path]:
    try:
        return sorted(parity.glob(f"*{PARITY_MANIFEST_SUFFIX}"))
    except OSError:
        return []


# -------------------------------------------------------------------------- PFS
def index_path(pfs_run: Path) -> Path:
    return pfs_run / INDEX


def run_lock_path(pfs_run: Path) -> Path:
    """Held by the run's one coordinator (runlock.py)."""
    return pfs_run / RUN_LOCK


def run_generation_path(pfs_run: Path) -> Path:
    """How many coordinators the run has had: their order, whatever their clocks say."""
    return pfs_run / "coordinator.generation"


def pfs_status_path(pfs_run: Path) -> Path:
    return pfs_run / STATUS


def status_paths(paths: NodePaths) -> list[Path]:
    """The coordinator's status: in its journal, and on the PFS when it takes writes."""
    return [journal_status_path(paths.journal), pfs_status_path(paths.pfs)]


def pfs_stop_file(pfs_run: Path) -> Path:
    return pfs_run / "control" / STOP


def pfs_ckpts_dir(pfs_run: Path) -> Path:
    """The directory holding every flushed checkpoint's directory."""
    return pfs_run / "ckpt"


def pfs_ckpt_dir(pfs_run: Path, ckpt: str) -> Path:
    return pfs_ckpts_dir(pfs_run) / ckpt


def pfs_manifest_path(pfs_run: Path, ckpt: str) -> Path:
    return pfs_ckpt_dir(pfs_run, ckpt) / MANIFEST


def pfs_manifest_paths(pfs_run: Path) -> list[Path]:
    return sorted(pfs_ckpts_dir(pfs_run).glob(f"*/{MANIFEST}"))


def bundle_name(node: int) -> str:
    return f"{node_dir_name(node)}.h5"


def bundle_path(pfs_run: Path, ckpt: str, node: int) -> Path:
    return pfs_ckpt_dir(pfs_run, ckpt) / bundle_name(node)


def pfs_events_dir(pfs_run: Path) -> Path:
    """Every node's copy of its events (the coordinator's are node 0's): the model's
    history when a node's own disk is gone."""
    return pfs_run / PFS_EVENTS_DIR


def pfs_events_path(pfs_run: Path, node: int) -> Path:
    return pfs_events_dir(pfs_run) / f"{node_dir_name(node)}{PFS_EVENTS_SUFFIX}"


def pfs_events_old_path(current: Path) -> Path:
    """Where a node's PFS event log goes when it reaches its cap (one generation kept)."""
    return current.with_name(current.name.removesuffix(PFS_EVENTS_SUFFIX)
                             + PFS_EVENTS_OLD_SUFFIX)


def pfs_events_paths(pfs_run: Path) -> list[Path]:
    """Every node's PFS event logs, the older generation of each node first."""
    found = sorted(pfs_events_dir(pfs_run).glob(f"node-*{PFS_EVENTS_SUFFIX}"))
    return sorted(found, key=lambda p: (p.name.split(".")[0],
                                        not p.name.endswith(PFS_EVENTS_OLD_SUFFIX)))
