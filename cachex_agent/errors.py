"""The exceptions that reach the command line as one line, never as a traceback."""


class CachexError(Exception):
    """An expected failure. `exit_code` is what the CLI returns for it."""

    exit_code = 1


class ConfigError(CachexError):
    """Bad configuration or usage: names the key or path involved."""

    exit_code = 2


class OperationError(CachexError):
    """An operation that could not be completed (verify mismatch, missing checkpoint)."""

    exit_code = 1


def describe(exc: BaseException) -> str:
    """One line for a log or `cachex status`: `path: reason` for OS errors."""
    if isinstance(exc, OSError) and exc.strerror:
        where = f"{exc.filename}: " if exc.filename else ""
        return f"{where}{exc.strerror}"
    return str(exc)
