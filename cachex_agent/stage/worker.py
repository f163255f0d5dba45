"""The capture worker: one thread, one checkpoint at a time, spool -> stage.

Each announced checkpoint is a `CaptureHandle` (handles.py): queued when the coordinator
announces it, running from the first listing, done once its local manifest and
journal entry are durable; then the worker posts `captured` to the agent's inbox. A
part that keeps changing is captured again (bounded); a capture that cannot complete
fails with one line, never a torn part reported captured.

A copy also posts each file as soon as it is copied and checksummed (`FileCaptured`),
so that its replication can start while later files are still being copied. What is
streamed that way is only provisional: the partner keeps it only if the final manifest,
posted with `captured`, names exactly those files (peer/replicator.py). With a feed
(peer/feed.py: one partner), a file captured by hard link is posted before it is
hashed, with a PENDING checksum, and its pieces go to the replication as they are
hashed; it is posted again with its checksum.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import psutil

from .. import messages
from ..config import Config
from ..errors import CachexError, describe
from ..fsutil import remove_under
from ..handles import Handle, Point, Stage, StageLog, State
from ..journal import Journal
from ..layout import NodePaths, ckpt_dir, root_entry, spool_file
from ..manifest import PENDING, FileEntry, LocalManifest
from ..mapped import unusable
from ..messages import CaptureFailed, FileCaptured, Superseded
from ..peer.mirror import mirrored_before
from ..rules import CommitRule
from ..rules.base import holds_match
from ..rules.quiescence import FileState, snapshot, wait_for_directory, wait_settled
from ..topology import Placement
from ..versions import split, trainer_name, versioned
from .capture import (
    CaptureError,
    OnFile,
    PartChanged,
    PieceSink,
    Plan,
    capture_copy,
    capture_method,
    capture_reference,
    copies_in_kernel,
    is_stage_full,
    part_changes,
)
from .saves import OwnSaves, generation_json, save_record

log = logging.getLogger(__name__)
MEMORY_RESERVE = 1 << 30    # capture by reference when the copy would leave less than this
CAPTURE_ATTEMPTS = 3        # captures of a part that keeps changing before it fails
# where, entries, mode, why that mode (or why a link fell back to a copy), files linked,
# of those the ones hashed and fed from a mapping under a read lease
Captured = tuple[Path, list[FileEntry], str, str, int, int]


class CaptureHandle(Handle):
    stage = Stage.CAPTURE

    def __init__(self, task: dict[str, Any], log_: StageLog, worker: CaptureWorker) -> None:
        super().__init__(task["ckpt"], task["seq"], log_)
        self.task, self.worker = task, worker

    def _start(self) -> None:
        self.worker.queue.put(self)


class CaptureWorker:
    def __init__(self, config: Config, paths: NodePaths, placement: Placement, rule: CommitRule,
                 journal: Journal, log_: StageLog, post: Callable[[Any], None],
                 first_seen: Callable[[str], float | None],
                 removed: Callable[[str], bool], feed: PieceSink | None = None) -> None:
        """`feed`: where linked files' pieces go as they are hashed (peer path only)."""
        self.config, self.paths, self.placement, self.rule = config, paths, placement, rule
        self.feed = feed
        self.journal, self.log, self.post, self.first_seen = journal, log_, post, first_seen
        self.removed = removed
        self.queue: queue.Queue[CaptureHandle | None] = queue.Queue()
        self.handles: dict[str, CaptureHandle] = {}     # not ended yet
        #: this node's own saves under each reused name, counted (the watcher's thread)
        self.saves = OwnSaves(journal.typed())
        self._thread = threading.Thread(target=self._loop, name="capture", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, task: dict[str, Any]) -> CaptureHandle:
        """Capture `task["ckpt"]` (the coordinator's `commit` message)."""
        handle = CaptureHandle(task, self.log, self)
        self.handles[handle.ckpt] = handle
        handle.submit(persist={"seq": task["seq"], "global_files": task["global_files"]})
        return handle

    def cancel(self, ckpt: str) -> None:
        handle = self.handles.get(ckpt)
        if handle is not None:
            handle.cancel()

    def busy(self, ckpt: str | None = None) -> bool:
        """A capture not ended (of `ckpt`, or of any checkpoint)."""
        live = {c for c, h in list(self.handles.items()) if not h.test()}
        return ckpt in live if ckpt is not None else bool(live)

    def stop(self) -> None:
        for handle in list(self.handles.values()):
            handle.cancel()
        self.queue.put(None)

    def _loop(self) -> None:
        while (handle := self.queue.get()) is not None:
            try:
                handle.at(Point.START, rank=self.placement.rank)
                if handle.set(State.RUNNING):
                    self._capture(handle)
            except (CachexError, OSError) as exc:
                error = describe(exc)
                log.error("capture of %s failed: %s", handle.ckpt, error)
                if handle.set(State.FAILED, persist={"reason": error}, error=error):
                    self.post(CaptureFailed(ckpt=handle.ckpt, error=error))
            finally:
                self.handles.pop(handle.ckpt, None)

    def _capture(self, handle: CaptureHandle) -> None:
        task, ckpt, seq = handle.task, handle.ckpt, handle.seq
        assert seq is not None
        source = self.paths.spool_dir(ckpt)
        start = time.monotonic()
        deadline = time.monotonic() + self.config.commit.timeout
        single = self.rule.is_file_checkpoint(self.paths.spool, trainer_name(ckpt))
        # a single file is written by one rank: a node without it holds an empty part
        late = not single and (self._wait_for_part(handle, source, deadline)
                               or self._wait_for_own_marker(handle, source, deadline))
        self._wait_for_tracker(handle, trainer_name(ckpt))
        count, own = self._own_save(handle, deadline)
        # A marker vouches at most for files written before it: a directory that
        # appeared after the commit gets this node's own check.
        vouched = self.rule.vouches_for(source) and not late
        header = LocalManifest(run=self.config.run, ckpt=ckpt, seq=seq,
                               node=self.placement.node, host=self.placement.host,
                               rank=self.placement.rank, files=[])
        feed = self.feed if task.get("path", "peer") == "peer" else None
        # read before and after: the capture took that save only if it stood throughout
        before = self._generation(ckpt)
        target, entries, mode, reason, linked, leased = self._capture_whole(
            handle, source, vouched, deadline, self._streamer(handle, header), feed)
        taken = before if self._generation(ckpt) == before else None
        if count and taken != own:
            self._superseded(handle, "replaced during its capture")
        handle.hold(self.placement.node)
        manifest = dataclasses.replace(header, files=entries, captured_at=time.time())
        self.journal.save_manifest(manifest)
        # the time the feed held the capture back is the replication's (peer/feed.py)
        fed_wait = feed.waited if feed is not None and linked else 0.0
        duration = time.monotonic() - start - fed_wait
        # This node's own candidates, from its finished part: the marker's list is the
        # view of whichever node committed first (HF: node 1's trainer_state.json may
        # come before node 0 wrote the weights that it alone holds).
        candidates = sorted({*task["global_files"], *global_candidates(
            self.rule, self.paths.spool, trainer_name(ckpt))})
        if not handle.set(State.DONE, persist={
                "source": str(target), "mode": mode, "mode_reason": reason,
                "linked": linked, "bytes": manifest.bytes, "global_files": candidates,
                "save": save_record(count, taken)},
                bytes=manifest.bytes, files=len(entries), linked=linked, leased=leased, mode=mode,
                reason=reason, duration=duration, fed_wait=fed_wait,
                write_start=self.first_seen(trainer_name(ckpt)),
                committed_at=task.get("received")):
            return
        self.post(messages.Captured(ckpt=ckpt, manifest=manifest.to_json(), duration=duration,
                                    fed_wait=fed_wait, mode=mode, reason=reason,
                                    global_files=candidates))

    def _wait_for_part(self, handle: CaptureHandle, source: Path, deadline: float) -> bool:
        """Wait (until `deadline`: `commit.timeout`) for this node's directory; True if
        it was not there yet."""
        if source.is_dir():
            return False
        if self.removed(trainer_name(handle.ckpt)):
            # a trainer that keeps its newest few deleted it before this node's turn
            raise CaptureError(f"{source}: removed from the spool before its capture")
        handle.note("capture_waiting", reason=f"{source}: directory not there yet",
                    timeout=self.config.commit.timeout)
        return wait_for_directory(source, max(0.0, deadline - time.monotonic()),
                                  handle.cancelled)

    def _wait_for_own_marker(self, handle: CaptureHandle, source: Path, deadline: float
                             ) -> bool:
        """A node that saves writes its own marker, with no barrier before it (HF's
        `trainer_state.json`, Accelerate's RNG state): wait for it; True if it was not
        there yet."""
        marker = self.rule.own_marker(source)
        if marker is None or holds_match(source, marker):
            return False
        handle.note("capture_waiting", reason=f"{source / marker}: this node's marker not"
                    " there yet", timeout=self.config.commit.timeout)
        while not holds_match(source, marker):
            if time.monotonic() > deadline or handle.cancelled.wait(0.05):
                raise CaptureError(f"{source / marker}: this node's marker did not appear"
                                   f" within commit.timeout")
        return True

    def _wait_for_tracker(self, handle: CaptureHandle, ckpt: str) -> None:
        """A tracker the trainer writes just after the save the commit saw (the rule's
        `tracker_due`) is captured with it if it comes within `commit.settle`; past
        that the checkpoint is captured without it (a trainer that writes none)."""
        until = time.monotonic() + self.config.commit.settle
        while (self.rule.tracker_due(self.paths.spool, ckpt) is not None
               and time.monotonic() < until):
            if handle.cancelled.wait(0.02):
                return

    def _streamer(self, handle: CaptureHandle, header: LocalManifest) -> OnFile:
        """Post each copied file to the agent (the replicator streams it)."""
        final = self.paths.stage_dir(header.ckpt)

        def on_file(index: int, entry: FileEntry, partial: Path) -> None:
            self.post(FileCaptured(header, index, entry, partial, final))
            if entry.checksum != PENDING:
                handle.at(Point.FILE, node=self.placement.node,
                          timeout=self.config.commit.timeout)
        return on_file

    def _capture_whole(self, handle: CaptureHandle, source: Path, vouched: bool,
                       deadline: float, on_file: OnFile, feed: PieceSink | None) -> Captured:
        """Capture until a listing after the capture equals the one before it (bounded):
        a file missing or torn is never reported captured."""
        changes = ""
        for attempt in range(1, CAPTURE_ATTEMPTS + 1):
            # a part seen changing is checked by this node, whatever the marker said
            settle = 0.0 if vouched and attempt == 1 else self.config.commit.settle
            listed = self._settled(handle, source, settle, deadline)
            try:
                captured = self._capture_once(handle.ckpt, source, listed, on_file, feed)
                changes = part_changes(listed, self._listing(source))
            except PartChanged as exc:
                captured, changes = None, str(exc)
            if not changes and captured is not None:
                return captured
            log.warning("capture of %s, attempt %d: %s", handle.ckpt, attempt, changes)
            handle.note("capture_retry", attempt=attempt, reason=changes)
        remove_under(self.paths.stage, self.paths.stage_dir(handle.ckpt))
        raise CaptureError(f"{source}: still changing after {CAPTURE_ATTEMPTS} captures"
                           f" ({changes})")

    def _settled(self, handle: CaptureHandle, source: Path, settle: float, deadline: float
                 ) -> dict[Path, FileState]:
        if self._single_file(source):
            return {}           # the rule saw the file settle; the copy checks it is unchanged
        try:
            return wait_settled(source, settle, max(0.0, deadline - time.monotonic()),
                                handle.cancelled)
        except FileNotFoundError:
            raise CaptureError(f"{source}: checkpoint directory is missing") from None

    def _single_file(self, source: Path) -> bool:
        return self.rule.is_file_checkpoint(self.paths.spool, source.name)

    def _listing(self, source: Path) -> dict[Path, FileState]:
        if self._single_file(source):
            return {}
        try:
            return snapshot(source)
        except FileNotFoundError:
            raise CaptureError(f"{source}: checkpoint directory is missing") from None

    def _capture_once(self, ckpt: str, source: Path, listed: dict[Path, FileState],
                      on_file: OnFile, feed: PieceSink | None = None) -> Captured:
        """(where the captured bytes are, entries, mode, why that mode, files linked, files
        leased) of one capture."""
        mirrored = self._mirrored(ckpt)
        relpaths = sorted(rel for rel in (p.relative_to(source).as_posix() for p in listed)
                          if not self.rule.ignore(rel) and rel not in mirrored)
        roots = {root_entry(n): self.paths.spool / n
                 for n in self.rule.root_entries(self.paths.spool, trainer_name(ckpt))
                 if root_entry(n) not in mirrored}
        sizes = {rel: listed[source / rel][0] for rel in relpaths} | {
            rel: p.stat().st_size for rel, p in roots.items()}
        plan = self._plan(ckpt, relpaths, roots)
        # a linked file takes no more memory: only the copies must fit
        total = sum(size for rel, size in sizes.items() if rel not in plan.link)
        target = self.paths.stage_dir(ckpt)
        if not memory_allows(total):
            reason = f"memory short: {total} bytes would leave less than {MEMORY_RESERVE}"
        else:
            if feed is not None:
                feed.begin(ckpt)
            try:
                entries = capture_copy(source, target, [*relpaths, *roots], sources=roots,
                                       on_file=on_file, plan=plan, sink=feed)
                if plan.refused:
                    log.warning("capture of %s: %s", ckpt, plan.refused)
                return (target, entries, "copy", plan.refused, len(plan.linked),
                        len(plan.leased))
            except OSError as exc:
                if not is_stage_full(exc):
                    raise
                reason = f"stage full ({describe(exc)})"
            finally:
                if feed is not None:
                    feed.stop()
        # by reference: the flush and the replicas read the spool part and check it
        # against these checksums
        remove_under(self.paths.stage, target)     # an earlier attempt, partial or whole
        if roots:   # a reference reads the part's directory: spool-root files stay out
            reason += f"; not captured: {', '.join(sorted(p.name for p in roots.values()))}"
        log.warning("capture of %s by reference: %s", ckpt, reason)
        return source, capture_reference(source, relpaths), "reference", reason, 0, 0

    def _own_save(self, handle: CaptureHandle, deadline: float) -> tuple[int, Any]:
        """(n, the generation of this node's n-th save) for version n of a name this node
        saves itself; (0, None) on a node that has not saved it (a node that never
        does, or whose first save comes later: docs/levels.md). A node that saves waits
        (up to `commit.timeout`) for its own n-th save, committed by another node's."""
        name, version = split(handle.ckpt)
        saves = self.saves
        if not saves.count(name):
            return 0, None
        if not saves.wait(name, version, max(0.0, deadline - time.monotonic()),
                          handle.cancelled):
            raise CaptureError(f"{self.paths.spool / name}: not saved again on this node"
                               f" within commit.timeout of {handle.ckpt}'s commit")
        if saves.count(name) > version:
            self._superseded(handle, "saved again before its capture")
        return version, saves.generation(name)

    def _generation(self, ckpt: str) -> Any:
        return generation_json(self.rule.generation(self.paths.spool, trainer_name(ckpt)))

    def _superseded(self, handle: CaptureHandle, how: str) -> NoReturn:
        """This node's save of the version being captured is gone (a newer save of its
        own replaced it): the version cannot be one save of every node. Reported, and
        the capture fails; the version of the newer save carries it (None: not counted
        yet, it has not settled)."""
        name, version = split(handle.ckpt)
        newest = self.saves.count(name)
        newer = versioned(name, newest) if newest > version else None
        self.post(Superseded(ckpt=handle.ckpt, newer=newer, saves=1))
        remove_under(self.paths.stage, self.paths.stage_dir(handle.ckpt))
        raise CaptureError(f"superseded: this node's save of {handle.ckpt} was {how}"
                           f" (by {newer or 'a save not settled yet'})")

    def _mirrored(self, ckpt: str) -> set[str]:
        """The global files of a later version that this node's spool holds only as the
        mirror's copy of an earlier one (another node saved them): not this node's part."""
        name = trainer_name(ckpt)
        if name == ckpt:
            return set()
        return {path for path in global_candidates(self.rule, self.paths.spool, name)
                if mirrored_before(self.journal, self.placement.node, ckpt, path,
                                   spool_file(self.paths.spool, name, path))}

    def _plan(self, ckpt: str, relpaths: list[str], roots: dict[str, Path]) -> Plan:
        """The files to hard-link (stage.capture, the rule, the file systems): those of
        the checkpoint directory, or the single-file checkpoint itself; never a tracker
        (every save rewrites it in place)."""
        spool, stage, setting = self.paths.spool, self.paths.stage, self.config.stage.capture
        method, why = capture_method(setting, self.rule.writes_new_files(
            spool, trainer_name(ckpt)), spool, stage)
        ranged = copies_in_kernel(spool, stage)
        if method != "link":    # said when a link was asked for (the captured event)
            return Plan(ranged=ranged, refused=why if setting == "link" else "")
        single = self.rule.is_file_checkpoint(spool, trainer_name(ckpt))
        return Plan(frozenset(roots if single else relpaths), ranged=ranged,
                    lease=self.config.stage.lease and not unusable())


def global_candidates(rule: CommitRule, spool: Path, ckpt: str) -> list[str]:
    """What only this node may hold of `ckpt` and every node reads: the rule's global
    files and the spool-root files captured with it (trackers, a single-file checkpoint);
    GlobalManifest.build keeps those that one node alone holds."""
    try:
        inside = ([] if rule.is_file_checkpoint(spool, ckpt)
                  else rule.global_files(ckpt_dir(spool, ckpt)))
        return inside + [root_entry(n) for n in rule.root_entries(spool, ckpt)]
    except (OSError, ValueError, CachexError):   # gone, or a trainer's file that does not
        return []                               # parse: as the watcher takes them


def memory_allows(nbytes: int) -> bool:
    return psutil.virtual_memory().available - nbytes > MEMORY_RESERVE

