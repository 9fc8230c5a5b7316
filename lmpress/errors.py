"""Errors lmpress reports to users, and the exit codes they map to."""

from __future__ import annotations

EXIT_PASS = 0
EXIT_GATE_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_RUNTIME_ERROR = 3


class LmpressInputError(Exception):
    """A user's mistake: a bad recipe, a missing file, an impossible setting.

    The message is one line that says what is wrong, where, and what would work;
    the CLI prints it without a traceback and exits with code 2.
    """

    exit_code = EXIT_BAD_INPUT


class LmpressStopped(Exception):
    """A run that could not go on through no fault of its input (a launched process lost its peers, its launcher
    stopped it), whose saved state a ``--resume`` continues. The CLI prints the one-line message without a
    traceback and exits with code 3."""

    exit_code = EXIT_RUNTIME_ERROR
