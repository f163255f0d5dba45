"""Commit rules: when is a checkpoint in the spool complete?

A checkpoint is a top-level directory of the spool; its id is the directory name.
Data files are never written atomically, so a rule trusts only a marker that the
framework writes last (and usually on one node only: the agents forward what they see
to the coordinator, which announces the commit to everyone). Rules also say which files
only the coordinator writes ("global files", mirrored to every node after a commit) and
which files are temporary and must never be captured.

Rules keep memory between calls (DeepSpeed's `latest`, quiescence timers) and are not
thread-safe: one caller (the SpoolWatcher) serializes them.
"""

from __future__ import annotations

import abc
import fnmatch
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ..errors import ConfigError
from ..names import is_checkpoint_name, is_temp_dir_name, natural_key, natural_sorted
from .quiescence import FileState, open_for_write, snapshot

__all__ = [
    "AutoRule",
    "CommitRule",
    "DcpRule",
    "DeepSpeedRule",
    "HfRule",
    "MarkerRule",
    "MegatronRule",
    "OrbaxRule",
    "QuiescenceRule",
    "TorchFileRule",
    "checkpoint_names",
    "is_checkpoint_name",
    "is_temp_file",
    "make_rule",
    "natural_key",
    "natural_sorted",
    "tracker_text",
]

RULES = "auto, dcp, deepspeed, hf, megatron, orbax, torch, marker:<glob> or quiescence"

# Temporary names written by the frameworks and by us: DCP's `.metadata.tmp`, our own
# `.name.tmp-cachex-<pid>-<token>` (fsutil.temp_name), editors, partial downloads, NFS
# silly-renames, Orbax tmp dirs.
_TEMP_FILE = re.compile(
    r"(\.(tmp|temp|part|partial|swp)$|~$|\.tmp[-.]|^\.nfs|\.orbax-checkpoint-tmp)",
    re.IGNORECASE)


def is_temp_file(relpath: str) -> bool:
    """True for a path inside a checkpoint that must never be captured."""
    parts = relpath.split("/")
    if any(is_temp_dir_name(part) for part in parts[:-1]):
        return True
    return bool(_TEMP_FILE.search(parts[-1]))


def checkpoint_names(spool: str | os.PathLike[str]) -> list[str]:
    """Candidate checkpoint directories of the spool (unsorted; none if it is missing)."""
    try:
        with os.scandir(spool) as entries:
            return [e.name for e in entries
                    if is_checkpoint_name(e.name) and _is_real_dir(e)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def _is_real_dir(entry: os.DirEntry[str]) -> bool:
    # Symlinked checkpoint dirs are skipped: capture must not wander outside the spool.
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


class CommitRule(abc.ABC):
    """How one framework marks a checkpoint as complete."""

    #: the `commit.rule` value that builds this rule
    name: str = ""
    #: True when commits can happen without any file system event (settle timers)
    needs_polling: bool = False
    #: seconds a checkpoint must stay unchanged (quiescence-based rules only)
    settle: float = 0.0
    #: files at the spool root (outside every checkpoint dir) that belong to a commit,
    #: e.g. DeepSpeed's `latest`; restore must rewrite them to name the restored id
    root_files: tuple[str, ...] = ()
    #: True when the framework writes the marker only after every rank finished writing
    #: (it gathers or barriers first): then the commit vouches for every node's files.
    #: Otherwise each node checks its own part (commit.settle) before capturing it.
    marker_implies_complete: bool = False
    #: True when the framework writes every save into new files (a directory of its own
    #: per step) and never rewrites a committed file in place: the capture may then
    #: hard-link the files inside the checkpoint directory instead of copying them
    #: (`stage.capture = auto`). Trackers at the spool root are rewritten by every save
    #: and are always copied. Each rule's docstring says what it read.
    new_files: bool = False

    def committed(self, spool: Path) -> list[str]:
        """Ids whose commit marker is present in this node's spool, oldest first."""
        spool = Path(spool)
        return natural_sorted(self._select(spool, checkpoint_names(spool)))

    @abc.abstractmethod
    def _select(self, spool: Path, names: list[str]) -> Iterable[str]:
        """Which of the candidate directory `names` are committed."""

    def global_files(self, ckpt_dir: Path) -> list[str]:
        """Files of `ckpt_dir` (relative, '/'-separated) that only the coordinator writes."""
        return []

    def ignore(self, relpath: str) -> bool:
        """True for files inside a checkpoint dir that must never be captured."""
        return is_temp_file(relpath)

    def vouches_for(self, ckpt_dir: Path) -> bool:
        """Does a commit of `ckpt_dir` (seen on any node) mean this node's files under it
        are complete? Keeps no state: the capture thread calls it."""
        return self.marker_implies_complete

    def forget(self, ckpt_id: str) -> None:
        """Drop what the rule remembers of `ckpt_id` (its directory is being re-created)."""
        return None     # stateless rules remember nothing

    def kind(self, ckpt_id: str) -> str:
        """The rule that decided `ckpt_id` (`auto` says which framework it recognised)."""
        return self.name

    def root_entries(self, spool: Path, ckpt_id: str) -> list[str]:
        """Files at the spool root captured with `ckpt_id`: a tracker that names it, or
        the checkpoint itself when it is a single file. Keeps no state."""
        return [name for name in self.root_files
                if tracker_names(spool / name, name) == ckpt_id]

    def is_file_checkpoint(self, spool: Path, ckpt_id: str) -> bool:
        """True when `ckpt_id` is a single file at the spool root, not a directory."""
        return False

    def own_marker(self, ckpt_dir: Path) -> str | None:
        """A file this node must see in its own part before capturing it (a marker every
        saving node writes, with no barrier before it), None when the commit suffices."""
        return None

    def writes_new_files(self, spool: Path, ckpt_id: str) -> bool:
        """May the files inside `ckpt_id`'s directory be captured by hard link (`new_files`)?
        Keeps no state: the capture thread calls it."""
        return self.new_files

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


class DcpRule(CommitRule):
    """PyTorch Distributed Checkpoint: `<id>/.metadata`, renamed into place last by the
    coordinator rank. `extra_global` adds coordinator-only files, e.g. `__0_0.distcp`
    when saving with `DefaultSavePlanner(dedup_save_to_lowest_rank=True)`."""

    name = "dcp"
    marker = ".metadata"
    marker_implies_complete = True      # the coordinator rank writes it after a gather
    new_files = True    # FileSystemWriter: new `__R_0.distcp` files per checkpoint_id

    def __init__(self, extra_global: Sequence[str] = ()) -> None:
        self.extra_global = tuple(extra_global)

    def _select(self, spool: Path, names: list[str]) -> Iterable[str]:
        return [n for n in names if (spool / n / self.marker).is_file()]

    def global_files(self, ckpt_dir: Path) -> list[str]:
        return [f for f in (self.marker, *self.extra_global) if (Path(ckpt_dir) / f).is_file()]


class TrackerRule(CommitRule):
    """A tracker file at the spool root names the last complete save; rank 0 rewrites it
    after every rank finished (DeepSpeed's `latest`, Megatron's
    `latest_checkpointed_iteration.txt`).

    A checkpoint is committed once the tracker named it while its directory existed, and
    stays committed (older saves remain valid after a newer one) until its directory
    disappears. The tracker is rewritten in place (not atomic): a torn read names nothing
    or an older save, and the next change of its inode/mtime/size makes us read it again.
    A checkpoint that was consumed (or forgotten) is not committed again until the
    tracker is rewritten, so a re-created directory of the same name waits for the new
    save. An agent restarted mid-run learns only the save the tracker names now; older
    ones come from its journal. The tracker is captured with the checkpoint it names
    (`root_entries`) and `recover` rewrites it to name the recovered one.
    """

    tracker = ""
    marker_implies_complete = True      # rank 0 writes the tracker after a barrier
    new_files = True    # a directory per save; the tracker (rewritten) is always copied

    def __init__(self) -> None:
        self._committed: set[str] = set()
        self._latest_sig: tuple[int, int, int] | None = None
        self._pending: str | None = None    # save named by the tracker, not yet consumed

    @property
    def root_files(self) -> tuple[str, ...]:    # type: ignore[override]
        return (self.tracker,)

    def _select(self, spool: Path, names: list[str]) -> Iterable[str]:
        self._refresh_latest(spool / self.tracker)
        present = set(names)
        if self._pending in present:
            self._committed.add(self._pending)
            self._pending = None
        self._committed &= present
        return list(self._committed)

    def _refresh_latest(self, latest: Path) -> None:
        try:
            st = latest.stat()
            sig = (st.st_ino, st.st_mtime_ns, st.st_size)
            if sig == self._latest_sig:
                return
        except (FileNotFoundError, NotADirectoryError):
            self._latest_sig, self._pending = None, None
            return
        self._latest_sig = sig
        self._pending = tracker_names(latest, self.tracker)

    def forget(self, ckpt_id: str) -> None:
        self._committed.discard(ckpt_id)
        if self._pending == ckpt_id:
            self._pending = None


class DeepSpeedRule(TrackerRule):
    """DeepSpeed: `<spool>/latest` holds the tag (`global_stepN` by default) of the last
    complete save. Read in deepspeed 0.19.8, runtime/engine.py,
    `DeepSpeedEngine.save_checkpoint(save_dir)`: every rank creates `<save_dir>/<tag>/`
    (`_create_checkpoint_file`); data-parallel rank 0 (`save_non_zero_checkpoint`)
    writes `<tag>/mp_rank_NN_model_states.pt` (`_save_checkpoint`, `_get_ckpt_name`);
    every rank writes its own `<tag>/zero_pp_rank_<dp>_mp_rank_NN_optim_states.pt`
    (`bf16_` before it with bf16; `_save_zero_checkpoint`, `_get_rank_zero_ckpt_name`);
    then global rank 0 writes `latest` (`save_latest=True`) and only then comes the
    `dist.barrier()`. Nothing orders the other ranks' writes before `latest` (the
    default `TorchCheckpointEngine.commit` does nothing): `latest` vouches for rank 0's
    files alone, so every node checks its own part (`commit.settle`) before capturing.

    Global files: `mp_rank_*_model_states.pt` is written by data-parallel rank 0 only
    (unless `checkpoint.use_node_local_storage` is on, then by each node's local rank 0)
    yet every rank's `load_checkpoint` reads it (`_load_checkpoint`); `latest` itself,
    read by every rank, is the tracker (mirrored as a spool-root file). ZeRO stage 3's
    `zero_pp_rank_<dp>_mp_rank_NN_model_states.pt` are each rank's own. Each rank reads
    only its own optimizer states (`_get_all_zero_checkpoint_state_dicts`), unless
    `zero_optimization.elastic_checkpoint` is on, which the rule does not mirror.

    `zero_to_fp32.py` and `zero_to_torch.py` (`_copy_recovery_script`) go to
    `<save_dir>` itself, the spool root, not into the tag, and are overwritten by every
    save: they are copies of DeepSpeed's own offline converters, which no load reads,
    and are not captured.
    """

    name = "deepspeed"
    tracker = "latest"
    marker_implies_complete = False     # the barrier comes after `latest`, see above
    _GLOBAL = ("mp_rank_*_model_states.pt",)

    def global_files(self, ckpt_dir: Path) -> list[str]:
        return _present(ckpt_dir, self._GLOBAL)


class MegatronRule(TrackerRule):
    """Megatron-LM / Megatron-Core: `iter_NNNNNNN/` (or `release/`) directories.

    megatron/training/checkpointing.py: `save_checkpoint` writes the iteration's
    directory (`get_checkpoint_name`: `iter_{:07d}`), waits on a barrier and only then
    has rank 0 write `latest_checkpointed_iteration.txt` (`get_checkpoint_tracker_
    filename`) at the save root, holding the iteration number or `release`.

    megatron/core/dist_checkpointing/serialization.py: `save` (the `torch_dist` format,
    also called directly by Megatron-Core users) has rank 0 write `common.pt` first
    (`save_common`), then the DCP checkpoint (`.metadata` by the coordinator, after every
    rank's `__R_0.distcp`), then rank 0 writes `metadata.json` (`save_config`) last: a
    directory holding `metadata.json` is committed even with no tracker.

    Global files (written by rank 0, read by every rank's load): `common.pt`,
    `metadata.json`, `.metadata`, the tracker; in the legacy format,
    `mp_rank_*/model_optim_rng.pt` of data-parallel rank 0 (kept as global only where a
    single node holds it, see GlobalManifest.build).

    Data-parallel replicas' `__R_*.distcp` are not mirrored: a plain save has the main
    replica's rank write them and every replica read them, which node-local spools do
    not serve; with the fully parallel save and load (strategies/fully_parallel.py,
    `FullyParallelSaveStrategyWrapper` / `FullyParallelLoadStrategyWrapper`) both sides
    compute the same split (exchange_utils.py,
    `determine_main_replica_uniform_distribution`) and each rank reads only the files it
    wrote, so each node's own part suffices (docs/levels.md, known limits).
    """

    name = "megatron"
    tracker = "latest_checkpointed_iteration.txt"
    marker = "metadata.json"
    _GLOBAL = ("common.pt", "metadata.json", ".metadata", "mp_rank_*/model_optim_rng.pt",
               "mp_rank_*_*/model_optim_rng.pt")

    def _select(self, spool: Path, names: list[str]) -> Iterable[str]:
        by_tracker = set(super()._select(spool, names))
        return by_tracker | {n for n in names if (spool / n / self.marker).is_file()}

    def global_files(self, ckpt_dir: Path) -> list[str]:
        return _present(ckpt_dir, self._GLOBAL)


class HfRule(CommitRule):
    """Hugging Face `transformers.Trainer`: `checkpoint-N/` directories.

    Read in transformers 5.24.0, trainer.py `Trainer._save_checkpoint`, in this order:
    `save_model` -> `_save` (the saving processes, `args.should_save`: global rank 0, or
    each node's local rank 0 with `save_on_each_node=True`): `save_pretrained` writes
    `config.json`, `generation_config.json` and `model.safetensors` only where
    distributed/mixin.py `should_save_on_this_rank` holds (torch.distributed rank 0,
    whatever `save_on_each_node` says), then `training_args.bin` on every saving
    process; `_save_optimizer_and_scheduler` (`optimizer.pt`, `scheduler.pt`, saving
    processes); `_save_scaler`; `_save_rng_state` (every process:
    `rng_state_<process_index>.pth`, creating the directory); then
    `TrainerState.save_to_json("trainer_state.json")` on the saving processes, with no
    barrier before it; then `rotate_checkpoints` (each saving process deletes its own
    node's oldest `checkpoint-N/` past `save_total_limit`).

    So `trainer_state.json` is each saving node's own marker: the first one seen commits
    the checkpoint (in the drill, node 1's, which writes less, comes before node 0 has
    written the weights), and each node that saves waits for its own before capturing
    (`own_marker`); a node that only holds its RNG state captures after its own settle
    check. Every file but the RNG states is read by every rank on resume
    (`_load_from_checkpoint`, `_load_optimizer_and_scheduler`): the candidates are
    taken from each node's own captured part and those a single node holds (the
    weights and configs) are mirrored to the others.
    """

    name = "hf"
    marker = "trainer_state.json"
    new_files = True    # `checkpoint-N/` per save, its files written once
    _RNG = re.compile(r"rng_state(_\d+)?\.pth")

    def _select(self, spool: Path, names: list[str]) -> Iterable[str]:
        return [n for n in names if (spool / n / self.marker).is_file()]

    def own_marker(self, ckpt_dir: Path) -> str | None:
        saves = any(not self._RNG.fullmatch(rel.split("/")[-1])
                    for rel in _files(Path(ckpt_dir)))
        return self.marker if saves else None

    def global_files(self, ckpt_dir: Path) -> list[str]:
        return [rel for rel in _files(Path(ckpt_dir))
                if not self._RNG.fullmatch(rel.split("/")[-1]) and not self.ignore(rel)]


class OrbaxRule(CommitRule):
    """Orbax (JAX) `CheckpointManager`: one directory per step.

    Read in orbax-checkpoint 0.12.8, orbax/checkpoint/_src/path/atomicity.py. On POSIX
    (`AtomicRenameTemporaryPath`) the step is written into
    `<step>.orbax-checkpoint-tmp/`, whose creation writes `_CHECKPOINT_METADATA`;
    `finalize` (after every host's writes and a barrier) rewrites `_CHECKPOINT_METADATA`
    with `commit_timestamp_nsecs`, writes `commit_success.txt` and renames the directory
    to `<step>/`. Where a rename is not atomic (`CommitFileTemporaryPath`, object stores)
    the directory is created under its final name with `_CHECKPOINT_METADATA` at once,
    and `finalize` writes the same two things last. So a step directory under its final
    name is committed once it holds `commit_success.txt`, or a `_CHECKPOINT_METADATA`
    with a `commit_timestamp_nsecs` (Orbax versions that rename without the commit
    file); temporary names are never captured.

    Which host writes what (`MultiprocessingOptions.primary_host`): with the default
    (host 0) the primary host alone creates, finalizes and renames the directory and
    writes the metadata, for a file system every host shares: on node-local spools the
    other hosts' spools get no step (seen with orbax 0.12.8 and replicated arrays: host
    1's spool stayed empty). Node-local storage takes
    `primary_host=None` (Orbax's own local checkpoints do so,
    orbax/checkpoint/experimental/emergency/checkpoint_manager.py,
    `_local_checkpoint_handler`): every host writes, finalizes and renames its own full
    step, metadata and merged OCDBT data (`*/d/<hash>`, a name of its own) included.
    Nothing is written by one host for the others, so nothing is mirrored.
    """

    name = "orbax"
    marker_implies_complete = True      # finalize runs after a barrier of every host
    new_files = True    # the step directory is final once renamed or committed
    commit_file = "commit_success.txt"
    step_metadata = "_CHECKPOINT_METADATA"

    def _select(self, spool: Path, names: list[str]) -> Iterable[str]:
        return [n for n in names if self._finalized(spool / n)]

    def _finalized(self, step_dir: Path) -> bool:
        if (step_dir / self.commit_file).is_file():
            return True
        try:
            meta = json.loads((step_dir / self.step_metadata).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False    # missing, or rewritten right now: its next change comes back
        return isinstance(meta, dict) and meta.get("commit_timestamp_nsecs") is not None


class TorchFileRule(CommitRule):
    """Single files at the top of the spool: `torch.save(obj, "<spool>/step10.pt")`,
    Lightning's `ModelCheckpoint` (`epoch=E-step=S.ckpt`, `last.ckpt`), safetensors.

    Read in lightning 2.6.6: pytorch/callbacks/model_checkpoint.py,
    `ModelCheckpoint._save_checkpoint` calls `trainer.save_checkpoint`, which saves on
    global rank 0 only (pytorch/strategies/strategy.py, `Strategy.save_checkpoint`:
    `if self.is_global_zero`), through `TorchCheckpointIO.save_checkpoint` into
    fabric/utilities/cloud_io.py `_atomic_save`: the bytes are serialized into memory,
    then written inside an fsspec transaction, i.e. into a `tempfile.mkstemp()` file of
    the system temp directory that `LocalFileOpener.commit` moves to the final name
    (`shutil.move`: a rename when /tmp is on the spool's file system, else a copy into
    the final name) and then chmods to 0666 & ~umask. `ModelCheckpoint.setup`
    broadcasts rank 0's `dirpath` to every rank, and `_remove_checkpoint` deletes the
    previous file on rank 0 (`save_top_k`). `_save_last_checkpoint` with
    `save_last=True` saves `last.ckpt` again in full, under the same name each time;
    with `save_last="link"`, `_link_checkpoint` has rank 0 replace it by a relative
    symbolic link to the newest file. `torch.save` writes its zip in place.

    No marker exists, so a file is committed once no process holds it open for writing
    and it stayed unchanged for `settle` seconds; the file is the whole checkpoint and
    is mirrored to every node (every rank loads it). Symbolic links
    (`save_last="link"`) are not checkpoints of their own.
    """

    name = "torch"
    needs_polling = True
    new_files = False   # torch.save truncates an existing file and writes it in place
    SUFFIXES = (".ckpt", ".pt", ".pth", ".safetensors")

    def __init__(self, settle: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.settle = float(settle)
        self._quiet = QuiescenceRule(settle, clock)

    def committed(self, spool: Path) -> list[str]:
        spool = Path(spool)
        return natural_sorted(self._select(spool, checkpoint_files(spool)))

    def _select(self, spool: Path, names: list[str]) -> Iterable[str]:
        return self._quiet.settled_files(spool, names)

    def is_file_checkpoint(self, spool: Path, ckpt_id: str) -> bool:
        return is_checkpoint_file(ckpt_id)

    def root_entries(self, spool: Path, ckpt_id: str) -> list[str]:
        path = Path(spool) / ckpt_id
        return [ckpt_id] if path.is_file() and not path.is_symlink() else []

    def forget(self, ckpt_id: str) -> None:
        self._quiet.forget(ckpt_id)


def is_checkpoint_file(name: str) -> bool:
    """A spool-root file name that TorchFileRule treats as a checkpoint."""
    return (name.lower().endswith(TorchFileRule.SUFFIXES) and not name.startswith(".")
            and not _TEMP_FILE.search(name))


def checkpoint_files(spool: str | os.PathLike[str]) -> list[str]:
    """Single-file checkpoints at the spool root (regular files, not links)."""
    try:
        with os.scandir(spool) as entries:
            return [e.name for e in entries if is_checkpoint_file(e.name)
                    and e.is_file(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def tracker_names(tracker: Path, name: str) -> str | None:
    """The checkpoint directory a tracker file names (None: missing, torn or foreign)."""
    try:
        text = tracker.read_text(encoding="utf-8", errors="replace").strip()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    if name == MegatronRule.tracker:
        if text == "release":
            return text
        text = f"iter_{int(text):07d}" if text.isdigit() else ""
    # a tag is a single directory name; anything else is torn or foreign
    ok = text and "/" not in text and "\n" not in text and is_checkpoint_name(text)
    return text if ok else None


def tracker_text(name: str, ckpt_id: str) -> str | None:
    """What tracker `name` holds when it names `ckpt_id` (None: not a known tracker, or
    a checkpoint it cannot name): `recover` writes it beside the recovered checkpoint."""
    if name == DeepSpeedRule.tracker:
        return ckpt_id
    if name == MegatronRule.tracker:
        found = re.fullmatch(r"iter_(\d+)", ckpt_id)
        return str(int(found.group(1))) if found else ("release" if ckpt_id == "release"
                                                       else None)
    return None


def _listdir(directory: Path) -> list[str]:
    try:
        with os.scandir(directory) as entries:
            return [e.name for e in entries]
    except (FileNotFoundError, NotADirectoryError):
        return []


def _files(ckpt_dir: Path) -> list[str]:
    found = []
    for root, _dirs, names in os.walk(ckpt_dir):
        found += [Path(root, n).relative_to(ckpt_dir).as_posix() for n in names]
    return sorted(found)


def _present(ckpt_dir: Path, patterns: Iterable[str]) -> list[str]:
    """The regular files of `ckpt_dir` matching any of the globs (relative, sorted)."""
    ckpt_dir = Path(ckpt_dir)
    found = {p.relative_to(ckpt_dir).as_posix() for pattern in patterns
             for p in ckpt_dir.glob(pattern) if p.is_file() and not p.is_symlink()}
    return sorted(f for f in found if not is_temp_file(f))


class MarkerRule(CommitRule):
    """A configured glob relative to the spool (`marker:*/COMMITTED`); the checkpoint is
    the first path component of each match, the matched files are its global files.
    Nothing says who writes the marker or when, so it vouches for no node's files."""

    def __init__(self, pattern: str) -> None:
        self.pattern = _check_marker(pattern)
        self.name = f"marker:{self.pattern}"
        parts = self.pattern.split("/")
        self._head, self._rest = parts[0], "/".join(parts[1:])

    def _select(self, spool: Path, names: list[str]) -> Iterable[str]:
        if self._head == "**":
            present = set(names)
            return {ckpt for ckpt, rel in self._spool_matches(spool) if ckpt in present}
        return [n for n in names
                if fnmatch.fnmatchcase(n, self._head) and self._inside(spool / n)]

    def _inside(self, ckpt_dir: Path) -> list[str]:
        return sorted(p.relative_to(ckpt_dir).as_posix() for p in ckpt_dir.glob(self._rest)
                      if not self.ignore(p.relative_to(ckpt_dir).as_posix()))

    def _spool_matches(self, spool: Path) -> list[tuple[str, str]]:
        found = []
        for match in spool.glob(self.pattern):
            parts = match.relative_to(spool).parts
            if len(parts) >= 2 and not self.ignore("/".join(parts[1:])):
                found.append((parts[0], "/".join(parts[1:])))
        return found

    def global_files(self, ckpt_dir: Path) -> list[str]:
        ckpt_dir = Path(ckpt_dir)
        if self._head == "**":
            rels = [rel for ckpt, rel in self._spool_matches(ckpt_dir.parent)
                    if ckpt == ckpt_dir.name]
        elif fnmatch.fnmatchcase(ckpt_dir.name, self._head):
            rels = self._inside(ckpt_dir)
        else:
            rels = []
        return sorted(r for r in rels if (ckpt_dir / r).is_file())


def _check_marker(pattern: str) -> str:
    pattern = pattern.strip()
    parts = PurePosixPath(pattern).parts if pattern else ()
    if not pattern or pattern.startswith("/") or ".." in parts:
        raise ConfigError(f"commit.rule: marker:<glob> needs a glob relative to the spool,"
                          f" like */COMMITTED; got {pattern!r}")
    if len(parts) < 2:
        raise ConfigError(f"commit.rule: marker glob {pattern!r} must name a file inside a"
                          f" checkpoint directory, like */COMMITTED")
    return "/".join(parts)


@dataclass
class _Observation:
    files: dict[Path, FileState]
    since: float            # when this exact file set was first seen (or a writer last seen)
    quiet: bool = False     # verified: no writer, settled


class QuiescenceRule(CommitRule):
    """Generic: a directory is committed when no process holds any of its files open for
    writing and its file set (paths, sizes, mtimes) has not changed for `settle` seconds.
    Empty directories are never committed. Timers live in this object, so it must be
    called repeatedly (`needs_polling`). The settle was measured on one node's files
    only: it vouches for no other node's."""

    name = "quiescence"
    needs_polling = True

    def __init__(self, settle: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.settle = float(settle)
        self._clock = clock
        self._seen: dict[str, _Observation] = {}

    def _select(self, spool: Path, names: list[str]) -> Iterable[str]:
        return self._settled_among(spool, names, self._tree)

    def settled_files(self, spool: Path, names: list[str]) -> list[str]:
        """The single files `names` at the spool root that settled (TorchFileRule)."""
        return self._settled_among(spool, names, _one_file)

    def _settled_among(self, spool: Path, names: list[str],
                       listing: Callable[[Path], dict[Path, FileState]]) -> list[str]:
        now = self._clock()
        for gone in set(self._seen) - set(names):
            del self._seen[gone]
        ready = []
        for name in names:
            try:
                files = listing(spool / name)
            except FileNotFoundError:
                self._seen.pop(name, None)
                continue
            if files and self._settled(name, files, now):
                ready.append(name)
            elif not files:
                self._seen.pop(name, None)
        return ready

    def _tree(self, ckpt_dir: Path) -> dict[Path, FileState]:
        """The files of a directory that count (an empty one is never committed)."""
        files = snapshot(ckpt_dir)
        keep = any(not self.ignore(p.relative_to(ckpt_dir).as_posix()) for p in files)
        return files if keep else {}

    def _settled(self, name: str, files: dict[Path, FileState], now: float) -> bool:
        seen = self._seen.get(name)
        if seen is None or seen.files != files:
            seen = self._seen[name] = _Observation(files, now)
        if seen.quiet:
            return True
        if now - seen.since < self.settle:
            return False
        # Asking every process is the expensive part: only for candidates, once per
        # settle period while a writer holds a file open.
        if open_for_write(files):
            seen.since = now
            return False
        seen.quiet = True
        return True

    def forget(self, ckpt_id: str) -> None:
        self._seen.pop(ckpt_id, None)


def _one_file(path: Path) -> dict[Path, FileState]:
    st = path.stat()
    return {path: (st.st_size, st.st_mtime_ns, st.st_ino)}


class AutoRule(CommitRule):
    """Per checkpoint: recognise the framework from its files (`detect_kind`) and apply
    its rule; quiescence for directories nobody recognises; single files at the spool
    root (`*.ckpt`, `*.pt`, `*.pth`, `*.safetensors`) by TorchFileRule.

    A recognized framework never falls back to quiescence: on nodes that do not hold the
    marker (DCP's `.metadata`, DeepSpeed's `latest` live on the coordinator only) the
    checkpoint is committed by the coordinator's announcement, not by a settle timer
    that a slow writer could outlast. `kind` says which rule decided (cachex status).
    """

    name = "auto"

    def __init__(self, settle: float, clock: Callable[[], float] = time.monotonic,
                 extra_global: Sequence[str] = ()) -> None:
        self.settle = float(settle)
        self._rules: dict[str, CommitRule] = {
            "megatron": MegatronRule(), "dcp": DcpRule(extra_global),
            "deepspeed": DeepSpeedRule(), "hf": HfRule(), "orbax": OrbaxRule(),
            "quiescence": QuiescenceRule(settle, clock)}
        self._files = TorchFileRule(settle, clock)
        self._kind: dict[str, str] = {}

    @property
    def needs_polling(self) -> bool:   # type: ignore[override]
        return bool({"quiescence", "torch"} & set(self._kind.values()))

    @property
    def root_files(self) -> tuple[str, ...]:    # type: ignore[override]
        return tuple(self._rules[k].root_files[0] for k in ("deepspeed", "megatron")
                     if k in self._kind.values())

    def committed(self, spool: Path) -> list[str]:
        spool = Path(spool)
        files = checkpoint_files(spool)
        self._kind.update(dict.fromkeys(files, "torch"))
        return natural_sorted([*self._select(spool, checkpoint_names(spool)),
                               *self._files._select(spool, files)])

    def _select(self, spool: Path, names: list[str]) -> Iterable[str]:
        trackers = _trackers(spool)
        for gone in set(self._kind) - set(names) - set(checkpoint_files(spool)):
            del self._kind[gone]
        groups: dict[str, list[str]] = {kind: [] for kind in self._rules}
        for name in names:
            groups[self._classify(spool / name, trackers)].append(name)
        ready: list[str] = []
        for kind, rule in self._rules.items():
            ready.extend(rule._select(spool, groups[kind]))
        return ready

    def _classify(self, ckpt_dir: Path, trackers: frozenset[str]) -> str:
        kind = self._kind.get(ckpt_dir.name)
        # sticky: a framework save never turns generic again; DCP may still turn out
        # to be Megatron's torch_dist (`common.pt`/`metadata.json` come with it)
        if kind not in (None, "quiescence", "dcp"):
            return kind
        kind = detect_kind(ckpt_dir, trackers)
        self._kind[ckpt_dir.name] = kind
        return kind

    def _rule_for(self, spool: Path, ckpt_id: str) -> CommitRule:
        # Classified afresh from this node's files when asked from another thread
        # (`_kind` belongs to the watcher's): the capture thread calls these.
        if is_checkpoint_file(ckpt_id) and not (spool / ckpt_id).is_dir():
            return self._files
        return self._rules[detect_kind(spool / ckpt_id, _trackers(spool))]

    def kind(self, ckpt_id: str) -> str:
        return self._kind.get(ckpt_id, "quiescence")

    def global_files(self, ckpt_dir: Path) -> list[str]:
        ckpt_dir = Path(ckpt_dir)
        return self._rule_for(ckpt_dir.parent, ckpt_dir.name).global_files(ckpt_dir)

    def root_entries(self, spool: Path, ckpt_id: str) -> list[str]:
        return self._rule_for(Path(spool), ckpt_id).root_entries(spool, ckpt_id)

    def is_file_checkpoint(self, spool: Path, ckpt_id: str) -> bool:
        return self._rule_for(Path(spool), ckpt_id) is self._files

    def own_marker(self, ckpt_dir: Path) -> str | None:
        ckpt_dir = Path(ckpt_dir)
        return self._rule_for(ckpt_dir.parent, ckpt_dir.name).own_marker(ckpt_dir)

    def forget(self, ckpt_id: str) -> None:
        self._kind.pop(ckpt_id, None)
        self._files.forget(ckpt_id)
        for rule in self._rules.values():
            rule.forget(ckpt_id)

    def vouches_for(self, ckpt_dir: Path) -> bool:
        ckpt_dir = Path(ckpt_dir)
        return self._rule_for(ckpt_dir.parent, ckpt_dir.name).vouches_for(ckpt_dir)

    def writes_new_files(self, spool: Path, ckpt_id: str) -> bool:
        return self._rule_for(Path(spool), ckpt_id).writes_new_files(spool, ckpt_id)


_DS_DIR = re.compile(r"global_step\d+")
_MEGATRON_DIR = re.compile(r"iter_\d{7,}")
_HF_DIR = re.compile(r"checkpoint-\d+")
_STEP_DIR = re.compile(r"(\D*_)?\d+")


def _trackers(spool: Path) -> frozenset[str]:
    return frozenset(n for n in (DeepSpeedRule.tracker, MegatronRule.tracker)
                     if (spool / n).is_file())


def detect_kind(ckpt_dir: Path, trackers: frozenset[str] | bool = frozenset()) -> str:
    """The framework that wrote `ckpt_dir`, from the names of its files and the
    trackers at the spool root: `megatron`, `dcp`, `deepspeed`, `hf`, `orbax` or
    `quiescence` (see AutoRule). `trackers` may be a bool: DeepSpeed's `latest` exists."""
    if isinstance(trackers, bool):
        trackers = frozenset({DeepSpeedRule.tracker} if trackers else ())
    top = set(_listdir(ckpt_dir))
    name = ckpt_dir.name
    if ({"common.pt", "metadata.json"} & top or _MEGATRON_DIR.fullmatch(name)
            or name == "release" and MegatronRule.tracker in trackers):
        return "megatron"
    if any(n in (".metadata", ".metadata.tmp") or n.endswith(".distcp") for n in top):
        return "dcp"
    if (DeepSpeedRule.tracker in trackers or _DS_DIR.fullmatch(name)
            or any(n.endswith(("_model_states.pt", "_optim_states.pt")) for n in top)):
        return "deepspeed"
    if HfRule.marker in top or _HF_DIR.fullmatch(name):
        return "hf"
    if ({OrbaxRule.commit_file, OrbaxRule.step_metadata} & top
            or _STEP_DIR.fullmatch(name) and any(_is_orbax_item(ckpt_dir / n) for n in top)):
        return "orbax"
    return "quiescence"


def _is_orbax_item(path: Path) -> bool:
    return bool({"_METADATA", "manifest.ocdbt", "_sharding"} & set(_listdir(path)))


_RULES: dict[str, Callable[[float, Sequence[str]], CommitRule]] = {
    "auto": lambda settle, extra: AutoRule(settle, extra_global=extra),
    "dcp": lambda _settle, extra: DcpRule(extra),
    "deepspeed": lambda _settle, _extra: DeepSpeedRule(),
    "megatron": lambda _settle, _extra: MegatronRule(),
    "hf": lambda _settle, _extra: HfRule(),
    "orbax": lambda _settle, _extra: OrbaxRule(),
    "torch": lambda settle, _extra: TorchFileRule(settle),
    "quiescence": lambda settle, _extra: QuiescenceRule(settle),
}


def make_rule(spec: str, settle: float, extra_global: Sequence[str] = ()) -> CommitRule:
    """Build the rule named by `commit.rule`; `extra_global`
    (`commit.globals`) names more coordinator-only files of a DCP checkpoint."""
    spec = str(spec).strip()
    if settle < 0:
        raise ConfigError(f"commit.settle: must be >= 0, got {settle!r}")
    if spec in _RULES:
        return _RULES[spec](settle, extra_global)
    if spec.startswith("marker:"):
        return MarkerRule(spec[len("marker:"):])
    raise ConfigError(f"commit.rule: unknown rule {spec!r} (expected {RULES})")
