"""The bootstrap and the agent, run inside this test process against a real AgentServer
(SO_PEERCRED pid = ours, tests/agent_in_process.py): connect, sample, detach, leave nothing behind."""

import json
import os
import socket
import sys
import threading
import time

from stacklens.inject.channel.server import AgentServer
from stacklens.records.agent import AgentHello, PySample
from stacklens.inject.agent import Agent
from stacklens.inject.agent.channel import Channel
from stacklens.inject.bootstrap import bootstrap_body, pending_call_text
from tests.agent_in_process import agent_threads, attach, detach, wait


def test_pending_call_text_is_one_statement_binding_nothing():
    text = pending_call_text("/run/x.sock", "/run/agent", "tok").decode()
    ns = {}
    code = compile(text, "<string>", "exec")
    assert code.co_names == ("exec",)       # the outer statement only calls exec
    assert text.count("\n") == 1 and "\0" not in text
    assert ns == {}


def _fds() -> set[tuple[str, str]]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:
            pass
    return out


def test_bootstrap_round_trip_and_clean_detach(tmp_path):
    srv = AgentServer(os.getpid(), tmp_path / "agents", config={"sample_hz": 200, "gpu": False})
    try:
        # the fds open now; earlier tests' leftovers may close meanwhile (garbage collection of
        # their pipes), so the check is that the agent leaves no fd of its own behind
        fds_before = _fds()
        attach(srv)
        assert wait(lambda: any(isinstance(r, PySample) for r in srv._queue._records), 30)
        recs = srv.poll()
        assert isinstance(recs[0], AgentHello) and recs[0].pid == os.getpid()
        agent_tid = recs[0].tid
        assert not any(isinstance(r, PySample) and r.tid == agent_tid for r in recs)  # skips itself
        assert any(m.startswith("_stacklens_agent") for m in sys.modules)
        # a second bootstrap while one runs does nothing
        exec(bootstrap_body(srv.target_path, srv.target_agent_dir, srv.token), {})
        assert len(agent_threads()) == 1
        detach(srv)
        assert not [m for m in sys.modules if m.startswith("_stacklens_agent")]
        assert wait(lambda: not (_fds() - fds_before), 30), _fds() - fds_before
    finally:
        srv.close()


def test_bootstrap_without_server_exits_silently(tmp_path, capfd):
    exec(bootstrap_body(str(tmp_path / "nobody.sock"), str(tmp_path), "tok"), {})
    assert wait(lambda: not agent_threads(), 30)
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_channel_back_pressure_drops_and_never_blocks():
    a, b = socket.socketpair()
    try:
        ch = Channel(a, max_outbox=1 << 16)
        t0 = time.monotonic()
        for i in range(2000):
            ch.send({"t": "note", "level": "info", "msg": "x" * 200, "t_ns": i})
            ch.pump(0)
        assert time.monotonic() - t0 < 2.0
        assert ch.dropped_msgs > 0 and len(ch.out) <= 1 << 16
    finally:
        a.close()
        b.close()


def test_gpu_queue_is_bounded():
    a, b = socket.socketpair()
    try:
        ag = Agent(a, "tok", config={"max_gpu_queue": 1000})
        for i in range(5000):
            ag.gpu.sink("kernel", [i])
        assert len(ag.gpu.queue) == 1000 and ag.gpu.dropped == 4000
    finally:
        a.close()
        b.close()


def test_server_rejects_other_peers(tmp_path):
    srv = AgentServer(os.getppid() if os.getppid() > 1 else 1, tmp_path / "agents")
    try:
        c = socket.socket(socket.AF_UNIX)
        c.connect(srv.path)
        c.settimeout(2)
        assert c.recv(10) == b""          # closed on us: our pid is not the target's
        c.close()
        assert wait(lambda: srv.stats().get("rejected_peer") == 1, 30)
        mode = os.stat(srv.path).st_mode & 0o777
        assert mode in (0o600, 0o660)
        assert os.stat(srv.dir).st_mode & 0o022 == 0
    finally:
        srv.close()


def test_kernel_rows_travel_with_a_per_message_name_table():
    """The agent sends each distinct kernel name once per message; the daemon's strict parser
    gets the same records back."""
    from stacklens.inject.agent import wire
    from stacklens.records.agent import KernelRecord
    from stacklens.inject.channel.messages import parse_message

    a, b = socket.socketpair()
    try:
        ag = Agent(a, "tok")
        names = ["void at::native::vectorized_elementwise_kernel<4>(int)", "sm80_xmma_gemm"]
        for i in range(3000):
            ag.gpu.sink("kernel", [names[i % 2], i, i + 5, 0, 7, i, 1, 1, 1, 128, 1, 1, 0])
        ag.gpu.send()
        data = bytes(ag.ch.out)
        msgs, used = wire.decode_all(data)
        assert used == len(data)
        assert len(msgs) == 2 and all(m["n"] == names for m in msgs)
        assert len(data) < 3000 * 60            # ~40 bytes a row instead of the names' 80+
        recs = [r for m in msgs for r in parse_message(m)]
        assert len(recs) == 3000
        assert recs[1] == KernelRecord(names[1], 1, 6, 0, 7, 1, (1, 1, 1), (128, 1, 1), 0)
        assert wire.MAX_FRAME > max(len(json.dumps(m)) for m in msgs)
    finally:
        a.close()
        b.close()


def test_bootstrap_and_agent_switch_intervals_unwind_in_order(tmp_path):
    """The bootstrap sets 0.5 ms, the agent its switch_s on top; at detach the agent puts back the
    bootstrap's value and the bootstrap its own: the target ends with the interval it had."""
    before = sys.getswitchinterval()
    srv = AgentServer(os.getpid(), tmp_path / "agents",
                      config={"sample_hz": 50, "gpu": False, "switch_s": 0.004})
    try:
        attach(srv)
        assert wait(lambda: abs(sys.getswitchinterval() - 0.004) < 1e-6, 30)
        detach(srv)
        assert sys.getswitchinterval() == before
    finally:
        srv.close()
        wait(lambda: not agent_threads(), 30)
        sys.setswitchinterval(before)


_SLOW_EXIT_AGENT = '''
import sys, threading
def main(sock, token):
    hold = sys.modules["_test_slow_exit"]
    threading.current_thread().name = "stacklens-agent-exiting"
    hold.exiting.set()
    hold.release.wait(10)
'''


def test_an_exiting_agent_does_not_restore_the_interval_under_the_next_one(tmp_path):
    """Agent A is past its rename ("-exiting") but its bootstrap has not finished; agent B starts
    meanwhile. A's exit must leave B's fast interval alone (it used to restore the program's: B then
    starved on a main thread that releases the GIL often, and never stopped); B's exit restores it."""
    import types
    from stacklens.inject.bootstrap import GIL_STATE_MODULE, SWITCH_INTERVAL_S

    before = sys.getswitchinterval()
    slow_dir = tmp_path / "slow"
    slow_dir.mkdir()
    (slow_dir / "__init__.py").write_text(_SLOW_EXIT_AGENT)
    hold = types.ModuleType("_test_slow_exit")
    hold.exiting, hold.release = threading.Event(), threading.Event()
    sys.modules["_test_slow_exit"] = hold
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "a.sock"))
    listener.listen(1)
    srv = AgentServer(os.getpid(), tmp_path / "agents", config={"sample_hz": 50, "gpu": False})
    try:
        exec(bootstrap_body(str(tmp_path / "a.sock"), str(slow_dir), "tok", nonce="a"), {})
        assert hold.exiting.wait(5)
        assert sys.getswitchinterval() == SWITCH_INTERVAL_S
        attach(srv, nonce="b")
        hold.release.set()                                   # A's bootstrap finishes under B
        assert wait(lambda: not any(t.name.endswith("-exiting") for t in threading.enumerate()), 30)
        assert sys.getswitchinterval() == SWITCH_INTERVAL_S  # B still runs on the fast interval
        assert sys.modules[GIL_STATE_MODULE].users == 1
        detach(srv)
        assert sys.getswitchinterval() == before             # the last one out restored it
        assert GIL_STATE_MODULE not in sys.modules
    finally:
        hold.release.set()
        srv.close()
        listener.close()
        sys.modules.pop("_test_slow_exit", None)
        sys.setswitchinterval(before)
