"""One check of a PID given by a user (issue 34): the CLI's client and the daemon's gRPC service
both refuse what is not a process id with introspect.procfs.check_pid_range, the number check
that needs no process (the live check, check_pid, is for a process on this host). No privilege."""

from __future__ import annotations

import pytest

from stacklens.daemon import client, grpc_service
from stacklens.errors import InputError
from stacklens.introspect import procfs


@pytest.mark.parametrize("pid", [1, 4_194_304, 2**31 - 1])
def test_a_pid_number_passes(pid):
    procfs.check_pid_range(pid)


@pytest.mark.parametrize("pid", [0, -1, 2**31, 2**40, "123", 1.0, None])
def test_what_is_not_a_pid_number_is_refused_with_what_to_do(pid):
    with pytest.raises(InputError, match=r"invalid PID .* 1\.\.2147483647 \(see `stacklens ps`\)"):
        procfs.check_pid_range(pid)


def test_client_and_service_use_the_one_range_check():
    for mod in (client, grpc_service):
        assert mod.check_pid_range is procfs.check_pid_range, mod.__name__
        assert not hasattr(mod, "_check_pid"), mod.__name__
