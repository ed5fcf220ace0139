"""stacklensd, the CLI and the agent on the oldest grpcio / protobuf / prometheus-client that
pyproject.toml allows (daemon/protogen.py OLDEST), in a venv of their own (issue 23).

The venv is built from the package index once (~20 s) and reused; without an index the test is
skipped with the reason. The daemon serves Health, ListProcesses (`stacklens ps`), an error status
(`stacklens advise` of an unattached PID), grpc.health.v1 and server reflection (grpcio-health-checking
and grpcio-reflection of that grpcio) and a Prometheus scrape; the agent must import neither grpc
nor protobuf.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from stacklens.daemon import protogen

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def oldest(tmp_path_factory):
    try:
        py = protogen.oldest_venv()
    except RuntimeError as e:
        pytest.skip(f"cannot build the oldest-grpcio venv ({', '.join(protogen.OLDEST)}): {e}")
    path = tmp_path_factory.mktemp("sl-path")
    (path / "stacklens").symlink_to(ROOT)   # the repo root is the package (as run_all.sh does)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PYTHONPATH"] = str(path)
    return py, env


def _run(oldest, *args, **kw) -> subprocess.CompletedProcess:
    py, env = oldest
    return subprocess.run([str(py), *args], env=env, capture_output=True, text=True, timeout=60, **kw)


# Health/Check and a reflection list_services with the oldest grpcio-health-checking/-reflection
STANDARD_SERVICES = """
import sys, grpc
from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as hg
from grpc_reflection.v1alpha import reflection_pb2 as r, reflection_pb2_grpc as rg
from stacklens.daemon.client import DaemonClient
c = DaemonClient(sys.argv[1])
st = hg.HealthStub(c.channel).Check(h.HealthCheckRequest(), metadata=c._md, timeout=10).status
ls = rg.ServerReflectionStub(c.channel).ServerReflectionInfo(iter([r.ServerReflectionRequest(list_services="")]),
                                                             metadata=c._md, timeout=10)
print(h.HealthCheckResponse.ServingStatus.Name(st), *sorted(s.name for x in ls for s in x.list_services_response.service))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_venv_has_exactly_the_oldest_versions(oldest):
    names = [p.split("==")[0] for p in protogen.OLDEST]
    r = _run(oldest, "-c", "import sys, importlib.metadata as m; print(*(m.version(n) for n in sys.argv[1:]))", *names)
    assert r.returncode == 0, r.stderr
    want = [p.split("==")[1] for p in protogen.OLDEST]
    assert r.stdout.split() == want


def test_the_agent_needs_no_grpc_or_protobuf(oldest):
    r = _run(oldest, "-c", "import sys, stacklens.inject.agent, stacklens.inject.agent.wire;"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'google')))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_daemon_and_cli_run_on_the_oldest_grpcio(oldest, tmp_path):
    py, env = oldest
    sock = tmp_path / "run" / "s.sock"
    port = _free_port()
    d = subprocess.Popen([str(py), "-m", "stacklens.daemon.server", "--socket", str(sock),
                          "--metrics-address", f"127.0.0.1:{port}", "--log-level", "WARNING"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not sock.exists() and d.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sock.exists(), f"stacklensd did not start: {d.poll()} {d.stderr.read() if d.poll() is not None else ''}"
        cli = ("-m", "stacklens.cli.main", "--socket", str(sock))
        ps = _run(oldest, *cli, "ps")
        assert ps.returncode == 0, ps.stderr
        assert ps.stdout.startswith("     PID COMM")
        health = _run(oldest, "-c", "import sys; from stacklens.daemon.client import DaemonClient;"
                      "h = DaemonClient(sys.argv[1]).health(); print(h.version, h.attached)", str(sock))
        assert health.returncode == 0, health.stderr
        assert health.stdout.split()[1] == "0"
        std = _run(oldest, "-c", STANDARD_SERVICES, str(sock))
        assert std.returncode == 0, std.stderr
        assert std.stdout.split() == ["SERVING", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                                      "grpc.reflection.v1alpha.ServerReflection", "stacklens.v1.Stacklens"]
        adv = _run(oldest, *cli, "advise", str(2**22 + 1))   # above pid_max: never a process
        assert adv.returncode != 0 and "not attached" in adv.stderr, (adv.returncode, adv.stdout, adv.stderr)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "stacklens" in body
    finally:
        d.terminate()
        try:
            d.wait(timeout=10)
        except subprocess.TimeoutExpired:
            d.kill()
            d.wait()
        for f in (d.stdout, d.stderr):
            f.close()
