"""What one attach/detach of the agent leaves in a Python process without a GPU (issue 45).

Run from the repository root (no privilege, no GPU; a few seconds):
    .venv/bin/python benchmarks/probe_agent_residue.py [--cycles 3]

1. A bare target (``python -I``, a fresh interpreter that runs the bootstrap text itself, as
   the pending call would) is attached once with the GPU collector on (it finds no GPU library)
   and detached; it prints the modules in ``sys.modules`` after the agent thread ended that were
   not there before the attach.
2. In this process, ``--cycles`` attach/detach cycles; then the ``in_child`` functions the
   bootstrap registered with ``os.register_at_fork`` that are still alive (CPython cannot
   unregister one: the bootstrap registers one per process), and what each one's namespace holds.
Both use the real ``AgentServer``; the cycles attach and detach as tests/unit/test_agent_bootstrap.py
does, through tests/agent_in_process.py. No ptrace.
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # tests/ (the in-process attach)

from stacklens.inject.bootstrap import FORK_MODULE, bootstrap_body  # noqa: E402
from stacklens.inject.channel.server import AgentServer  # noqa: E402
from tests.agent_in_process import attach, detach  # noqa: E402

TARGET = r"""
import sys, threading, time
before = set(sys.modules)
exec(eval(sys.stdin.readline()), {})
time.sleep(0.2)
while any(t.name.startswith("stacklens-agent") for t in threading.enumerate()):
    time.sleep(0.01)
print(sorted(set(sys.modules) - before), len(before), flush=True)
"""


def modules_left_in_a_bare_target(tmp: str) -> None:
    p = subprocess.Popen([sys.executable, "-I", "-c", TARGET], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    srv = AgentServer(p.pid, os.path.join(tmp, "bare"), config={"gpu": True})
    try:
        p.stdin.write(repr(bootstrap_body(srv.target_path, srv.target_agent_dir, srv.token)) + "\n")
        p.stdin.flush()
        assert srv.wait_hello(30), "no hello from the target"
        time.sleep(1.0)
        assert srv.stop_agent(30), "the agent did not stop"
        left, before = p.stdout.readline().rsplit(" ", 1)
        print(f"Python {sys.version.split()[0]}, bare target ({before.strip()} modules before the attach): "
              f"modules left after one attach/detach: {left}")
        p.wait(30)
    finally:
        srv.close()


def fork_hooks_after_cycles(tmp: str, cycles: int) -> None:
    srv = AgentServer(os.getpid(), os.path.join(tmp, "self"), config={"gpu": False})
    try:
        for i in range(cycles):
            attach(srv, nonce=str(i))
            detach(srv)
            srv.reset_hello()
    finally:
        srv.close()
    gc.collect()
    hooks = [o for o in gc.get_objects() if type(o).__name__ == "function" and o.__name__ == "in_child"
             and "held" in o.__globals__]
    print(f"after {cycles} attach/detach cycles: {len(hooks)} at-fork hook(s) alive")
    for hook in hooks:
        names = {k: type(v).__name__ for k, v in hook.__globals__.items() if not k.startswith("__")}
        print(f"  its namespace holds {names}; sockets held now: {len(hook.__globals__['held'])}")
    print(f"  {FORK_MODULE!r} in sys.modules: {FORK_MODULE in sys.modules}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        modules_left_in_a_bare_target(tmp)
        fork_hooks_after_cycles(tmp, a.cycles)


if __name__ == "__main__":
    main()
