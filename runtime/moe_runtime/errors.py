"""The runtime's one failure type: a clear message and an exit code, raised before serving."""

from __future__ import annotations


class RuntimeFailure(Exception):
    """Something the operator/user must fix (bad checkpoint, wrong plan, no usable backend).

    The CLI prints the message (one line, names the file/tensor/mismatch) and exits with `exit_code`.
    """

    exit_code = 2

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code
