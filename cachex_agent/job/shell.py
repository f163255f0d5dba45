"""The batch shell as the package sees it after the job library's hand-over: the
variables the template set (saved by the library in `$CX_RUNDIR/vars`) and the launch
lines only the library builds (`cx_step`: the site's launcher, its flags, the step's
environment), asked for the node set of the moment."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from ..errors import OperationError

ASK_TIMEOUT = 60


class BatchShell:
    def __init__(self, lib: Path, saved: Path) -> None:
        self.lib, self.saved = lib, saved
        self.assigned: dict[str, str] = {}     # values the package settled (CACHEX_CONFIG)

    def read(self, names: list[str]) -> dict[str, str]:
        """The template's values of those variables ("" when unset)."""
        words = " ".join(f'"${{{name}-}}"' for name in names)
        said = self._ask(f"printf '%s\\0' {words}", "variables")
        return dict(zip(names, said, strict=True))

    def step(self, kind: str, ppn: int, nodes: tuple[str, ...], spares: tuple[str, ...],
             arg: str = "") -> list[str]:
        """The command line of a step on that node set, as `cx_step` builds it."""
        script = (f"CX_SET=({shlex.join(nodes)}); CX_SPARE=({shlex.join(spares)});"
                  f" cx_step {shlex.quote(kind)} {ppn} {shlex.quote(arg)};"
                  " printf '%s\\0' \"${CX_ARGV[@]}\"")
        return self._ask(script, f"{kind} command")

    def _ask(self, script: str, what: str) -> list[str]:
        sets = "".join(f" {k}={shlex.quote(v)};" for k, v in self.assigned.items())
        prelude = (f"source {shlex.quote(str(self.saved))}; source"
                   f" {shlex.quote(str(self.lib))};{sets} ")
        try:
            said = subprocess.run(["bash", "-c", prelude + script], capture_output=True,
                                  text=True, timeout=ASK_TIMEOUT, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as exc:
            raise OperationError(f"the job library gave no {what} within"
                                 f" {ASK_TIMEOUT}s") from exc
        if said.returncode != 0:
            raise OperationError(f"the job library gave no {what}: {said.stderr.strip()}")
        return said.stdout.split("\0")[:-1]
