"""The PFS bundle: one HDF5 file per node per checkpoint.

Inside a bundle (`<pfs>/<run>/ckpt/<ckpt>/node-NNNNN.h5`, layout.bundle_path):

    /                attributes format="cachex-bundle", version=1, run, ckpt, seq, node,
                     host, rank, algorithm, captured_at, complete (set True last)
    /files/000000    uint8 1-D contiguous dataset holding one captured file's bytes,
    /files/000001    attributes path (relative, '/'-separated), size, mode, checksum
    ...

Plain h5py or h5dump read it. Every HDF5 file is opened with locking disabled (Lustre).

Call order:
- the flusher: `write_bundle(final, manifest, stage_dir)`; it returns once the bundle is
  fsynced, renamed to `final`, the directory fsynced and (verify=True) re-read and
  checked. Only then may the node's part count as flushed.
- adoption on restart: `is_complete(path)`, then `read_manifest(path)` and
  `verify_bundle(path, manifest.files)`.
- `cachex verify`: `verify_bundle(path, expected)`; `cachex export` and recovery from the
  PFS: `extract(path, dest, only)`.

Errors: `BundleError` for content problems (a source that no longer matches its manifest,
a corrupt or incomplete bundle; retrying does not help); `OSError` for I/O failures (the
PFS is down, full or unwritable; worth retrying).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from ..checksum import hasher
from ..errors import CachexError, OperationError, describe
from ..fsutil import (
    commit_rename,
    create_file,
    fsync_dir,
    linked_hint,
    makedirs,
    temp_name,
    trainer_mode,
)
from ..manifest import FileEntry, LocalManifest
from ..safepath import checkpoint_id, component, index, relative_path
from .throttle import TokenBucket

log = logging.getLogger(__name__)

FORMAT = "cachex-bundle"
VERSION = 1
FILES = "files"
CHUNK = 8 * 1024 * 1024
_STRING = h5py.string_dtype()       # variable-length UTF-8, what h5py writes for a str


class BundleError(OperationError):
    """A bundle, or the data it is written from, is not what its manifest says."""


# ---------------------------------------------------------------------------- writing

def write_bundle(final: Path, manifest: LocalManifest, source_dir: Path, *,
                 chunk: int = CHUNK, throttle: TokenBucket | None = None,
                 on_bytes: Callable[[int], None] | None = None,
                 verify: bool = True, writers: int = 1) -> None:
    """Write `manifest.files` (read from `source_dir`) as the bundle `final`.

    The bytes are checksummed as they are read and must match the manifest, else
    BundleError and nothing is left behind. `final` appears only complete: written to a
    temp sibling, `complete=True` set last, fsynced, renamed, directory fsynced. With
    `verify`, the renamed bundle is re-read and checked; a bundle that fails is removed.
    `throttle.consume(n)` is called before and `on_bytes(n)` after each chunk written
    (from the writer threads: both must be thread-safe when `writers` > 1).
    `writers` threads copy whole files into their datasets at once, each through its own
    `chunk` buffer. The parent directory of `final` must exist.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 byte, got {chunk}")
    if writers < 1:
        raise ValueError(f"writers must be >= 1, got {writers}")
    final = Path(final)
    temp = temp_name(final)
    try:
        _write_temp(temp, manifest, Path(source_dir), _Copier(chunk, throttle, on_bytes,
                                                               writers))
        commit_rename(temp, final)
    except BaseException:
        _discard(temp)
        raise
    if verify:
        problems = verify_bundle(final, manifest.files)
        if problems:
            # A bundle known to be bad must not look complete to adoption or recovery.
            final.unlink(missing_ok=True)
            fsync_dir(final.parent)
            raise BundleError(f"{final}: verification after write failed: "
                              + "; ".join(problems))


def _discard(temp: Path) -> None:
    """A failing PFS may refuse the removal too (read-only, EIO): the temporary is then
    named in one line, and this node's agent removes it at its next start (cleanup.py);
    the error that failed the write is the one raised."""
    try:
        temp.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("temporary bundle %s left on the PFS (%s): the next agent start"
                    " removes it", temp, describe(exc))


def _write_temp(temp: Path, manifest: LocalManifest, source_dir: Path, copier: _Copier
                ) -> None:
    # Why os.pwrite at the dataset's offset rather than `dset[a:b] = buf`: every dataset
    # is created contiguous with its space allocated at creation (alloc time EARLY) and
    # no fill value ever written (fill time NEVER), so HDF5 only lays out metadata and
    # the payload goes to disk with the same syscalls as a plain file copy. Measured at
    # 1 GiB it matches raw os.write; slice assignment and dset.id.write cost ~5-10% more
    # CPU per GiB (selection objects, HDF5 I/O path). The result is an ordinary
    # contiguous dataset: h5py and h5dump read it like any other. The same layout lets
    # several writers fill different datasets at once: HDF5 is done before they start.
    os.close(create_file(temp))     # HDF5 creates with the umask's mode; truncating keeps 0600
    with h5py.File(temp, "w", locking=False) as h5:
        _set_root_attrs(h5, manifest)
        group = h5.create_group(FILES)
        maker = _DatasetMaker(group.id)
        offsets = [maker.create(_dataset_name(i), entry)
                   for i, entry in enumerate(manifest.files)]
        fd = os.open(temp, os.O_WRONLY)
        try:
            copier.run(source_dir, list(zip(manifest.files, offsets, strict=True)), fd)
        finally:
            os.close(fd)
        h5.attrs.modify("complete", True)


class _Copier:
    """Copies the staged files into their datasets' byte ranges, `writers` at a time.

    Largest files first, so one big file does not start last. The first failure stops
    the others at their next chunk and is raised; a file is never split (its checksum is
    computed in order).
    """

    def __init__(self, chunk: int, throttle: TokenBucket | None,
                 on_bytes: Callable[[int], None] | None, writers: int) -> None:
        self.chunk, self.throttle, self.writers = chunk, throttle, writers
        self.on_bytes = on_bytes
        self._failed = threading.Event()

    def run(self, source_dir: Path, jobs: list[tuple[FileEntry, int]], fd: int) -> None:
        jobs = sorted(jobs, key=lambda job: job[0].size, reverse=True)
        writers = min(self.writers, len(jobs))
        if writers <= 1:
            self._worker(source_dir, iter(jobs), fd)
            return
        queue = iter(jobs)
        lock = threading.Lock()

        def next_job() -> Iterator[tuple[FileEntry, int]]:
            while not self._failed.is_set():
                with lock:
                    job = next(queue, None)
                if job is None:
                    return
                yield job

        with ThreadPoolExecutor(writers, thread_name_prefix="bundle") as pool:
            futures = [pool.submit(self._worker, source_dir, next_job(), fd)
                       for _ in range(writers)]
        for future in futures:
            future.result()         # the first failure, in submission order

    def _worker(self, source_dir: Path, jobs: Iterator[tuple[FileEntry, int]], fd: int
                ) -> None:
        buffer = np.empty(self.chunk, dtype=np.uint8)
        try:
            for entry, offset in jobs:
                _copy_file(source_dir / entry.path, entry, fd, offset, buffer, self.throttle,
                           self.on_bytes, self._failed)
        except BaseException:
            self._failed.set()
            raise


def _set_root_attrs(h5: h5py.File, manifest: LocalManifest) -> None:
    attrs = h5.attrs
    attrs["format"] = FORMAT
    attrs["version"] = VERSION
    attrs["run"] = manifest.run
    attrs["ckpt"] = manifest.ckpt
    attrs["seq"] = manifest.seq
    attrs["node"] = manifest.node
    attrs["host"] = manifest.host
    attrs["rank"] = manifest.rank
    attrs["algorithm"] = manifest.algorithm
    attrs["captured_at"] = manifest.captured_at
    attrs["complete"] = False


def _dataset_name(index: int) -> str:
    return f"{index:06d}"


class _DatasetMaker:
    """Creates the per-file datasets, reusing the property list, space and types.

    Low-level calls write the same objects as `dset.attrs[...] = ...` (scalar UTF-8
    strings, int64) for a fraction of the cost: every HDF5 identifier costs ~10 us to
    create and release here, which is what a bundle of thousands of small files
    (Orbax/zarr layouts) spends its time on.
    """

    def __init__(self, group: h5py.h5g.GroupID) -> None:
        self._group = group
        self._dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        self._dcpl.set_layout(h5py.h5d.CONTIGUOUS)
        self._dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
        self._dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
        self._scalar = h5py.h5s.create(h5py.h5s.SCALAR)
        self._text = h5py.h5t.py_create(_STRING, logical=True)

    def create(self, name: str, entry: FileEntry) -> int:
        """Create the dataset with its space allocated; return the offset of its data."""
        space = h5py.h5s.create_simple((entry.size,), (entry.size,))
        dsid = h5py.h5d.create(self._group, name.encode(), h5py.h5t.STD_U8LE, space,
                               dcpl=self._dcpl)
        self._put(dsid, b"path", self._text, np.array(entry.path, _STRING))
        self._put(dsid, b"size", h5py.h5t.STD_I64LE, np.array(entry.size, np.int64))
        self._put(dsid, b"mode", h5py.h5t.STD_I64LE, np.array(entry.mode, np.int64))
        self._put(dsid, b"checksum", self._text, np.array(entry.checksum, _STRING))
        offset = dsid.get_offset()
        if offset is None and entry.size:
            raise RuntimeError(f"HDF5 allocated no space for {FILES}/{name}"
                               " despite EARLY allocation")
        return offset or 0

    def _put(self, obj: h5py.h5d.DatasetID, name: bytes, tid: h5py.h5t.TypeID,
             data: np.ndarray) -> None:
        h5py.h5a.create(obj, name, tid, self._scalar).write(data)


def _get_attr(obj: h5py.h5d.DatasetID, name: str, dtype: Any) -> Any:
    """Read a scalar attribute as `dtype`, or as stored if HDF5 cannot convert it."""
    attr = h5py.h5a.open(obj, name.encode())
    data = np.empty((), dtype=dtype)
    try:
        attr.read(data)
    except (TypeError, ValueError, OSError):      # e.g. a fixed-length string
        data = np.empty(attr.shape, dtype=attr.dtype)
        attr.read(data)
    return data[()]


def _copy_file(src: Path, entry: FileEntry, fd: int, offset: int,
               buffer: np.ndarray, throttle: TokenBucket | None,
               on_bytes: Callable[[int], None] | None, stop: threading.Event) -> None:
    """Stream `src` into the bundle at `offset`, checking size and checksum as read;
    return early once `stop` is set (another writer failed: the bundle is discarded)."""
    view = memoryview(buffer)
    digest = hasher()
    done = 0
    try:
        with open(src, "rb", buffering=0) as handle:
            while done < entry.size:
                if stop.is_set():
                    return
                n = handle.readinto(view[:min(len(view), entry.size - done)])
                if not n:
                    break
                if throttle is not None:
                    throttle.consume(n)
                digest.update(view[:n])
                _pwrite_all(fd, view[:n], offset + done)
                done += n
                if on_bytes is not None:
                    on_bytes(n)
            longer = done == entry.size and handle.readinto(view[:1])
    except FileNotFoundError:
        raise BundleError(f"{src}: listed in the manifest but missing") from None
    if done != entry.size or longer:
        raise BundleError(f"{src}: size differs from the manifest ({entry.size} bytes"
                          f" expected, {'more' if longer else done} found)")
    if digest.hexdigest() != entry.checksum:
        raise BundleError(f"{src}: checksum {digest.hexdigest()} differs from the"
                          f" manifest's {entry.checksum}; the staged copy changed or is"
                          f" corrupt{linked_hint(src)}")


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data = data[written:]
        offset += written


# ---------------------------------------------------------------------------- reading

def read_manifest(path: Path) -> LocalManifest:
    """The LocalManifest a complete bundle was written from (BundleError otherwise)."""
    with _open(path) as h5:
        attrs = _checked_root(path, h5, need_complete=True)
        files = [entry for _, _, entry in _datasets(path, h5)]
        return LocalManifest(run=_str(attrs["run"]),
                             ckpt=checkpoint_id(_str(attrs["ckpt"]), path),
                             seq=int(attrs["seq"]), node=index(int(attrs["node"]), path),
                             host=component(_str(attrs["host"]), path, "host"),
                             rank=int(attrs["rank"]),
                             files=files, captured_at=float(attrs["captured_at"]),
                             algorithm=_str(attrs["algorithm"]))


def is_complete(path: Path) -> bool:
    """True only for a readable cachex bundle whose `complete` attribute is set."""
    try:
        with _open(path) as h5:
            _checked_root(path, h5, need_complete=True)
            return True
    except (OSError, ValueError, KeyError, CachexError):
        # not HDF5, not ours, attributes of other types (an array's truth value, bytes
        # that are no UTF-8): not a complete bundle. Any other error is a bug, raised
        return False


def verify_bundle(path: Path, expected: list[FileEntry] | None = None) -> list[str]:
    """Re-read every dataset and compare; return the problems found (empty = good).

    Checks each dataset's length and checksum against its own attributes and, when
    `expected` is given, that the bundle holds exactly those entries with the same
    sizes and checksums. Every problem names the bundle and the file's path.
    """
    try:
        with _open(path) as h5, _RawFile(path) as raw:
            _checked_root(path, h5, need_complete=True)
            problems: list[str] = []
            found: dict[str, FileEntry] = {}
            for _, dset, entry in _datasets(path, h5):
                found[entry.path] = entry
                problem = _check_dataset(dset, entry, raw, None)
                if problem:
                    problems.append(f"{path}: file {entry.path!r}: {problem}")
    except (BundleError, OSError) as exc:
        return [str(exc)]
    if expected is not None:
        problems += _compare(path, found, expected)
    return problems


def _compare(path: Path, found: dict[str, FileEntry], expected: list[FileEntry]) -> list[str]:
    problems = []
    for want in expected:
        have = found.get(want.path)
        if have is None:
            problems.append(f"{path}: file {want.path!r}: missing from the bundle")
        elif (have.size, have.checksum) != (want.size, want.checksum):
            problems.append(f"{path}: file {want.path!r}: bundle has {have.size} bytes"
                            f" {have.checksum}, expected {want.size} bytes {want.checksum}")
    names = {want.path for want in expected}
    problems += [f"{path}: file {name!r}: in the bundle but not expected"
                 for name in found if name not in names]
    return problems


def extract(path: Path, dest: Path, only: set[str] | None = None,
            failed: dict[str, str] | None = None,
            done: Callable[[int], None] | None = None) -> list[FileEntry]:
    """Write the bundle's files (or those named in `only`) under `dest`; return them.

    Each file lands atomically (temp, fsync, rename) at its relative path with its mode,
    streamed in chunks and checked against its checksum on the way (BundleError on a
    mismatch, a name in `only` that the bundle lacks; UnsafeInput for an unsafe path,
    before anything is written). With `failed`, a file whose bytes do not match is left
    out and its problem recorded there (path -> problem), the others extracted. `done`
    is told each file's size once it is handled (progress).
    """
    dest = Path(dest)
    written: list[FileEntry] = []
    with _open(path) as h5, _RawFile(path) as raw:
        _checked_root(path, h5, need_complete=True)
        chosen = [(name, entry) for name, _, entry in _datasets(path, h5)
                  if only is None or entry.path in only]
        missing = (only or set()) - {entry.path for _, entry in chosen}
        if missing:
            raise BundleError(f"{path}: not in the bundle: {', '.join(sorted(missing))}")
        group = h5[FILES].id
        parents: set[Path] = set()
        for name, entry in chosen:
            target = dest / entry.path
            makedirs(target.parent)
            parents.add(target.parent)
            try:
                _extract_one(path, h5py.h5d.open(group, name), entry, raw, target)
            except BundleError as exc:
                if failed is None:
                    raise
                failed[entry.path] = str(exc)
                continue
            finally:
                if done is not None:
                    done(entry.size)
            written.append(entry)
    for parent in parents:
        fsync_dir(parent)
    return written


def _extract_one(path: Path, dset: h5py.h5d.DatasetID, entry: FileEntry, raw: _RawFile,
                 target: Path) -> None:
    temp = temp_name(target)
    try:
        fd = create_file(temp)
        try:
            problem = _check_dataset(dset, entry, raw, fd)
            if problem:
                raise BundleError(f"{path}: file {entry.path!r}: {problem}")
            os.fchmod(fd, trainer_mode(entry.mode))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, target)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def _check_dataset(dset: h5py.h5d.DatasetID, entry: FileEntry, raw: _RawFile,
                   out_fd: int | None) -> str | None:
    """Hash the dataset's bytes (copying them to `out_fd` if given); say what is wrong."""
    shape, dtype = dset.shape, dset.dtype
    if len(shape) != 1 or dtype != np.uint8:
        return f"dataset is {dtype}{shape}, expected 1-D uint8"
    if shape[0] != entry.size:
        return f"dataset holds {shape[0]} bytes, its size attribute says {entry.size}"
    digest = hasher()
    for window in _windows(dset, entry.size, raw):
        digest.update(window)
        if out_fd is not None:
            _write_all(out_fd, window)
    if digest.hexdigest() != entry.checksum:
        return f"checksum mismatch (data hashes to {digest.hexdigest()}, recorded" \
               f" {entry.checksum})"
    return None


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data):]


def _windows(dset: h5py.h5d.DatasetID, size: int, raw: _RawFile) -> Iterator[memoryview]:
    """The dataset's bytes in chunk-sized views, straight from the file when possible."""
    if size == 0:
        return
    offset = dset.get_offset()
    if offset is not None and raw.covers(offset, size):
        yield from raw.windows(offset, size)
        return
    # Not a plain contiguous dataset (e.g. repacked with filters): let HDF5 decode it.
    buffer = raw.buffer
    decoded = h5py.Dataset(dset)
    for start in range(0, size, len(buffer)):
        n = min(len(buffer), size - start)
        decoded.read_direct(buffer, np.s_[start:start + n], np.s_[0:n])
        yield memoryview(buffer)[:n]


class _RawFile:
    """The bundle opened a second time, for reading dataset bytes at their offsets.

    Reads through an mmap when the file system allows it: hashing straight from the page
    cache avoids a copy, which makes the verify pass after a write ~2x cheaper in CPU
    (0.11 s vs 0.23 s per GiB here for pread into an 8 MiB buffer, 0.16 s for 1 MiB).
    Each window's pages are dropped from the mapping (MADV_DONTNEED) once hashed: RSS
    counts the mapped pages of a file, so without that a verify held the whole bundle
    (a 4 GiB part, 4 GiB of RSS); with it, one window. Dropping costs nothing measurable
    and the page cache keeps the data. Mapping each window separately costs ~10% more
    CPU (a mmap/munmap per window). Ranges are checked against the file size first, so a
    truncated bundle is reported instead of raising SIGBUS. Falls back to pread into one
    buffer.
    """

    def __init__(self, path: Path, chunk: int = CHUNK) -> None:
        self.buffer = np.empty(chunk, dtype=np.uint8)
        self._fd = os.open(path, os.O_RDONLY)
        self._size = os.fstat(self._fd).st_size
        self._map: mmap.mmap | None = None
        try:
            self._map = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
            self._map.madvise(mmap.MADV_SEQUENTIAL)
        except (OSError, ValueError):     # empty file, or no mmap on this file system
            self._map = None

    def __enter__(self) -> _RawFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:           # a caller still holds a view; GC unmaps it
                pass
            self._map = None
        os.close(self._fd)

    def covers(self, offset: int, size: int) -> bool:
        return 0 <= offset and offset + size <= self._size

    def windows(self, offset: int, size: int) -> Iterator[memoryview]:
        step = len(self.buffer)
        if self._map is not None:
            yield from self._mapped_windows(offset, size, step)
            return
        view = memoryview(self.buffer)
        for start in range(offset, offset + size, step):
            n = os.preadv(self._fd, [view[:min(step, offset + size - start)]], start)
            if n <= 0:
                raise OSError(f"short read at offset {start}")
            yield view[:n]


    def _mapped_windows(self, offset: int, size: int, step: int) -> Iterator[memoryview]:
        assert self._map is not None
        dropped = offset - offset % mmap.PAGESIZE     # madvise wants page-aligned starts
        with memoryview(self._map) as whole:
            for start in range(offset, offset + size, step):
                end = min(start + step, offset + size)
                with whole[start:end] as window:
                    yield window
                # Only whole pages already hashed: the one `end` falls in is still needed.
                upto = end - end % mmap.PAGESIZE
                if upto > dropped:
                    self._map.madvise(mmap.MADV_DONTNEED, dropped, upto - dropped)
                    dropped = upto


def _open(path: Path) -> h5py.File:
    path = Path(path)
    if not path.exists():
        raise BundleError(f"{path}: no such bundle")
    try:
        return h5py.File(path, "r", locking=False)
    except OSError as exc:
        raise BundleError(f"{path}: not a readable HDF5 file ({exc})") from None


def _checked_root(path: Path, h5: h5py.File, need_complete: bool) -> Any:
    attrs = h5.attrs
    if _str(attrs.get("format", "")) != FORMAT:
        raise BundleError(f"{path}: not a cachex bundle (format attribute"
                          f" {attrs.get('format')!r})")
    if attrs.get("version") != VERSION:
        raise BundleError(f"{path}: cachex bundle version {attrs.get('version')!r} is not"
                          f" supported (this cachex reads version {VERSION})")
    if need_complete and not bool(attrs.get("complete", False)):
        raise BundleError(f"{path}: incomplete bundle (the complete attribute is not set)")
    if FILES not in h5:
        raise BundleError(f"{path}: bundle has no '{FILES}' group")
    return attrs


def _datasets(path: Path, h5: h5py.File
              ) -> Iterator[tuple[bytes, h5py.h5d.DatasetID, FileEntry]]:
    """Each dataset in manifest order, open, with the FileEntry its attributes describe
    (its path checked: UnsafeInput names the bundle and the path).

    One dataset is open at a time: HDF5 scans every open object of the file when it
    opens an attribute, so holding thousands open makes reading quadratic.
    """
    group = h5[FILES].id
    for name in sorted(group, key=lambda n: (len(n), n)):
        try:
            dset = h5py.h5d.open(group, name)
            entry = FileEntry(path=relative_path(_str(_get_attr(dset, "path", _STRING)),
                                                 f"{path}: {FILES}/{_str(name)}"),
                              size=int(_get_attr(dset, "size", np.int64)),
                              mode=int(_get_attr(dset, "mode", np.int64)),
                              checksum=_str(_get_attr(dset, "checksum", _STRING)))
        except (KeyError, ValueError, TypeError) as exc:
            raise BundleError(f"{path}: {FILES}/{_str(name)} is not a dataset with path,"
                              f" size, mode and checksum attributes ({exc})") from None
        yield name, dset, entry
        del dset


def _str(value: Any) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        return bytes(value).decode("utf-8")
    return str(value)
