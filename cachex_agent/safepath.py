"""The one check of every name and path that comes from outside the process.

Manifests, the PFS index, the journal, bundle attributes, replica stores and MPI messages
all carry checkpoint ids and relative file paths that cachex later joins to a directory
and writes, reads or removes. A PFS manifest is writable by anyone with write access to
the run directory, so each value is checked where it is parsed, before any consumer sees
it: a relative path stays under the directory it is joined to, and a checkpoint id is a
single directory name that the watchers would take as a checkpoint.

Every refusal is an `UnsafeInput` naming where the value came from and the value.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from .errors import OperationError
from .fsutil import NAME_MAX
from .names import is_checkpoint_name


class UnsafeInput(OperationError):
    """A name or path from a file or message that must not be used."""


def relative_path(value: Any, where: object, what: str = "file path") -> str:
    """`value` if it is a non-empty relative '/'-separated path that stays below the
    directory it is joined to: no '..', '.' or empty component, no NUL."""
    problem = _path_problem(value)
    if problem:
        raise UnsafeInput(f"{where}: unsafe {what} {value!r} ({problem})")
    return value


def relative_paths(values: Iterable[Any], where: object, what: str = "file path") -> list[str]:
    return [relative_path(v, where, what) for v in values]


def checkpoint_id(value: Any, where: object, directory: str | None = None) -> str:
    """`value` if it is one valid component and a checkpoint name (not hidden, not a
    temporary directory); with `directory`, also equal to the directory it names."""
    problem = _path_problem(value) or ("more than one path component" if "/" in value
                                       else None)
    if problem is None and not is_checkpoint_name(value):
        problem = "hidden or temporary names are never checkpoints"
    if problem is None and directory is not None and value != directory:
        problem = f"differs from {directory!r}, the name it is stored under"
    if problem:
        raise UnsafeInput(f"{where}: unsafe checkpoint id {value!r} ({problem})")
    return value


def component(value: Any, where: object, what: str) -> str:
    """A single path component (e.g. a host name used in a `{host}` path template)."""
    problem = _path_problem(value) or ("more than one path component" if "/" in value
                                       else None)
    if problem:
        raise UnsafeInput(f"{where}: unsafe {what} {value!r} ({problem})")
    return value


def index(value: Any, where: object, what: str = "node") -> int:
    """A node or rank number: a non-negative int (not a bool, not a string)."""
    if type(value) is not int or value < 0:
        raise UnsafeInput(f"{where}: {what} {value!r} is not a non-negative integer")
    return value


# The names checkpoints are made of (`__12_0.distcp`, `model/layer.0.bin`): taken at
# once; anything else gets every check below. Each component 1..NAME_MAX ASCII bytes,
# never "." or "..".
_COMPONENT = rf"(?!\.\.?(?:/|\Z))[A-Za-z0-9_.+=@,~-]{{1,{NAME_MAX}}}"
_PLAIN = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*\Z")


def _path_problem(value: Any) -> str | None:
    if type(value) is str and _PLAIN.match(value):
        return None
    if not isinstance(value, str):
        return f"not a string but {type(value).__name__}"
    if not value:
        return "empty"
    if "\0" in value:
        return "contains a NUL byte"
    if value.startswith("/"):
        return "absolute"
    for part in value.split("/"):
        if part in ("", ".", ".."):
            return f"component {part!r}" if part else "empty component"
        try:
            size = len(part.encode())
        except UnicodeEncodeError:
            return "not valid UTF-8"
        if size > NAME_MAX:
            return f"a component of {size} bytes (at most {NAME_MAX})"
    return None
