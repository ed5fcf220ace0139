"""One error hierarchy for stacklens, mapped to CLI exit codes and gRPC status codes here.

Every message says what to do next.
"""

from __future__ import annotations


class StacklensError(Exception):
    """Base of every error stacklens reports to a user."""

    exit_code = 1
    meaning = "an error without a code of its own; `doctor`: a check failed"
    grpc_code = "INTERNAL"


class InputError(StacklensError):
    """A file or argument the user gave cannot be used."""

    exit_code = 2
    meaning = "a file or argument that cannot be used"
    grpc_code = "INVALID_ARGUMENT"


class NoSuchProcess(StacklensError):
    exit_code = 3
    meaning = "no such process, or the daemon is not attached to it"
    grpc_code = "NOT_FOUND"


class PermissionDenied(StacklensError):
    exit_code = 4
    meaning = "not permitted (run as root, or grant CAP_BPF, CAP_PERFMON, CAP_SYS_PTRACE)"
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
    meaning = "the attach failed"
    grpc_code = "FAILED_PRECONDITION"


class UnsupportedVersion(AttachError):
    exit_code = 6
    meaning = "a Python, CUDA or torch version stacklens does not support"
    grpc_code = "FAILED_PRECONDITION"


class NotApplicable(StacklensError):
    """The target does not have what a probe or collector needs (e.g. no GPU library mapped)."""

    exit_code = 7
    meaning = "the target lacks what the probes need (e.g. no GPU library mapped)"
    grpc_code = "FAILED_PRECONDITION"


class AlreadyAttached(StacklensError):
    exit_code = 8
    meaning = "already attached"
    grpc_code = "ALREADY_EXISTS"


class AttachCancelled(AttachError):
    """A detach cancelled an attach in progress: nothing stays attached."""

    exit_code = 12
    meaning = "a detach cancelled the attach"
    grpc_code = "ABORTED"


class StillAttaching(StacklensError):
    """The daemon's attach of a PID has not ended: a client stopped following it, or asked for
    what only an attached process has. The attach goes on in the daemon."""

    exit_code = 13
    meaning = "the attach goes on in the daemon (attach --wait ran out, or the PID is still attaching)"
    grpc_code = "FAILED_PRECONDITION"


class DaemonUnavailable(StacklensError):
    exit_code = 9
    meaning = "the daemon cannot be reached"
    grpc_code = "UNAVAILABLE"


class Timeout(StacklensError):
    exit_code = 10
    meaning = "the daemon did not answer in time"
    grpc_code = "DEADLINE_EXCEEDED"


class IncompleteProfile(StacklensError):
    """A one-shot profile without the samples its target's CPU time made due (cli/oneshot.py)."""

    exit_code = 11
    meaning = "a one-shot profile without the samples its target's CPU time made due"
    grpc_code = "DATA_LOSS"


EXIT_USAGE = 64  # argparse-level misuse (EX_USAGE)
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)


def exit_codes() -> list[tuple[int, str]]:
    """Every exit status of the CLI with what it means, in order: the one table `--help` and the
    README list (read from the hierarchy's `exit_code`/`meaning`, and the two set outside it)."""
    table = {0: "success", EXIT_USAGE: "usage: an unknown command or option, a missing or malformed argument",
             EXIT_INTERRUPTED: "interrupted (Ctrl-C)"}
    todo = [StacklensError]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if "exit_code" in cls.__dict__:
            table.setdefault(cls.exit_code, cls.meaning)
    return sorted(table.items())


class ProtocolError(ValueError):
    """A message of the agent (or a record in it) that breaks the protocol: refused and counted,
    never trusted (inject/channel/validate.py checks; the join's clip_text raises it for a
    non-string)."""
