"""The runtime's failure types: a clear message and an exit status, raised before serving.

Exit statuses of `moe-runtime` (and `moe-operator`): 0 ok; 1 bad input (a flag value, a
checkpoint, a plan file that does not fit this node, no usable backend, no GPU for `probe`);
2 the plan has errors; 3 usage (unknown flag or subcommand, a missing or malformed argument).
"""

from __future__ import annotations

EXIT_OK, EXIT_BAD_INPUT, EXIT_PLAN_ERRORS, EXIT_USAGE = 0, 1, 2, 3


class RuntimeFailure(Exception):
    """Something the operator/user must fix (bad checkpoint, wrong plan, no usable backend).

    The CLI prints the message (one line, names the file/tensor/mismatch) and exits with `exit_code`.
    """

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        self.exit_code = type(self).exit_code if exit_code is None else exit_code


class BadInput(RuntimeFailure):
    """A flag value, path or request the user must fix (exit 1)."""

    exit_code = EXIT_BAD_INPUT


class PlanFailure(RuntimeFailure):
    """The plan itself has errors (exit 2)."""

    exit_code = EXIT_PLAN_ERRORS
