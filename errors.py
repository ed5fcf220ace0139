"""One error hierarchy for stacklens, mapped to CLI exit codes and gRPC status codes here.

Every message says what to do next.
"""

from __future__ import annotations


class StacklensError(Exception):
    """Base of every error stacklens reports to a user."""

    exit_code = 1
    grpc_code = "INTERNAL"


class InputError(StacklensError):
    """A file or argument the user gave cannot be used."""

    exit_code = 2
    grpc_code = "INVALID_ARGUMENT"


class NoSuchProcess(StacklensError):
    exit_code = 3
    grpc_code = "NOT_FOUND"


class PermissionDenied(StacklensError):
    exit_code = 4
    grpc_code = "PERMISSION_DENIED"


class MemoryReadError(StacklensError, OSError):
    """The target's memory could not be read at that address (unmapped, a short read, the process
    gone). Also an ``OSError`` (``errno`` set, EFAULT unless known), so callers that treat any
    failed read alike catch it as one; raised by every `introspect.memory.ProcessMemory`."""

    def __init__(self, message: str, err: int = 14) -> None:  # 14: EFAULT
        super().__init__(message)
        self.errno = err


class AttachError(StacklensError):
    exit_code = 5
    grpc_code = "FAILED_PRECONDITION"


class UnsupportedVersion(AttachError):
    exit_code = 6
    grpc_code = "FAILED_PRECONDITION"


class NotApplicable(StacklensError):
    """The target does not have what a probe or collector needs (e.g. no GPU library mapped)."""

    exit_code = 7
    grpc_code = "FAILED_PRECONDITION"


class AlreadyAttached(StacklensError):
    exit_code = 8
    grpc_code = "ALREADY_EXISTS"


class AttachCancelled(AttachError):
    """A detach cancelled an attach in progress: nothing stays attached."""

    exit_code = 12
    grpc_code = "ABORTED"


class StillAttaching(StacklensError):
    """The daemon's attach of a PID has not ended: a client stopped following it, or asked for
    what only an attached process has. The attach goes on in the daemon."""

    exit_code = 13
    grpc_code = "FAILED_PRECONDITION"


class DaemonUnavailable(StacklensError):
    exit_code = 9
    grpc_code = "UNAVAILABLE"


class Timeout(StacklensError):
    exit_code = 10
    grpc_code = "DEADLINE_EXCEEDED"


class IncompleteProfile(StacklensError):
    """A one-shot profile without the samples its target's CPU time made due (cli/oneshot.py)."""

    exit_code = 11
    grpc_code = "DATA_LOSS"


EXIT_USAGE = 64  # argparse-level misuse


class ProtocolError(ValueError):
    """A message of the agent (or a record in it) that breaks the protocol: refused and counted,
    never trusted (inject/validate.py checks; the join's clip_text raises it for a non-string)."""
