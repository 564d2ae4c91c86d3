"""Exceptions that map to the CLI's exit codes (README, Commands: 2 bad input, 3 diverged, 1 other)."""


class LcsbError(Exception):
    exit_code = 1


class BadInput(LcsbError):
    """A recipe, data file, model path or flag the user must fix; the message says how."""

    exit_code = 2


class Diverged(LcsbError):
    exit_code = 3
