"""Drive a long-lived GPU target (tests/targets/gpu_workloads.py, gpu_ground_truth.py) over stdin/stdout.

The target prints `ready {json}`, then answers each command line with one JSON line. Anything
else it prints on stdout (library chatter) is kept in `noise`, never parsed. Stdlib only.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

TARGETS = Path(__file__).resolve().parent


class TargetError(RuntimeError):
    pass


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (VmRSS), 0 if unknown."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


PIN_ENV = "STACKLENS_PIN_CPUS"   # a CPU list the target pins itself to at its start (pin_self_from_env)


def cpu_list(spec: str) -> set[int]:
    """"4-7,12" -> {4, 5, 6, 7, 12}; ValueError on an empty or malformed list ("7-4", "x", "4,,5")."""
    out: set[int] = set()
    parts = spec.strip().split(",")
    for part in parts:
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"bad CPU list {spec!r}: {part!r} is not N or N-M")
        lo_i, hi_i = int(lo), int(hi) if dash else int(lo)
        if hi_i < lo_i:
            raise ValueError(f"bad CPU list {spec!r}: range {part!r} runs backwards")
        out.update(range(lo_i, hi_i + 1))
    return out


def cpu_spec(cpus) -> str:
    """{4, 5, 6, 7, 12} -> "4-7,12" (what cpu_list reads back)."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [c]
    if run:
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(out)


def pin_self_from_env() -> str | None:
    """Pin the calling thread (a target's main thread, before it starts any other) to the CPUs in
    $STACKLENS_PIN_CPUS; threads it creates later inherit them. Returns the list, None if unset."""
    spec = os.environ.get(PIN_ENV, "").strip()
    if not spec:
        return None
    os.sched_setaffinity(0, cpu_list(spec))
    return spec


class Target:
    def __init__(self, script: str, args: list[str], *, env: dict[str, str] | None = None,
                 stderr_path: str | os.PathLike[str] | None = None, ready_timeout: float = 600.0,
                 python: str | None = None) -> None:
        path = script if os.path.isabs(script) else str(TARGETS / script)
        full_env = dict(os.environ)
        full_env.update({"PYTHONUNBUFFERED": "1", "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
                         "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                         "TRANSFORMERS_OFFLINE": "1"})
        if env:
            full_env.update(env)
        self.stderr_path = str(stderr_path) if stderr_path else None
        self._err = open(stderr_path, "ab") if stderr_path else subprocess.DEVNULL
        self.argv = [python or sys.executable, path, *args]
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._err, env=full_env, text=True, bufsize=1)
        self.pid = self.proc.pid
        self.noise: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.info: dict = {}
        line = self._next_line(ready_timeout, want=lambda s: s.startswith("ready"))
        rest = line[len("ready"):].strip()
        if rest:
            try:
                self.info = json.loads(rest)
            except ValueError:
                self.info = {"ready": rest}

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def _next_line(self, timeout: float, want) -> str:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TargetError(f"target {self.pid} gave no answer within {timeout:.0f}s")
            try:
                line = self._lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if line is None:
                rc = self.proc.wait(timeout=5)
                raise TargetError(f"target {self.pid} exited (rc={rc}); stdout tail: {self.noise[-5:]}; "
                                  f"stderr tail: {self.stderr_tail()}")
            if want(line):
                return line
            if len(self.noise) < 2000:
                self.noise.append(line[:500])

    def cmd(self, line: str, timeout: float = 600.0) -> dict:
        """Send one command, return its JSON answer; raise TargetError on error/timeout/exit."""
        if self.proc.poll() is not None:
            raise TargetError(f"target {self.pid} already exited (rc={self.proc.returncode})")
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        word = line.split()[0]

        def mine(s: str) -> bool:  # a late answer to an earlier, timed-out command is skipped
            if not s.startswith("{"):
                return False
            try:
                return json.loads(s).get("cmd") == word
            except ValueError:
                return False

        obj = json.loads(self._next_line(timeout, want=mine))
        if obj.get("error"):
            raise TargetError(f"target error on {line!r}: {obj['error']}")
        return obj

    def stderr_tail(self, n: int = 600) -> str:
        if not self.stderr_path:
            return "(not kept)"
        try:
            if self._err is not subprocess.DEVNULL:
                self._err.flush()
            with open(self.stderr_path, "rb") as fh:
                fh.seek(0, 2)
                fh.seek(max(0, fh.tell() - n))
                return fh.read().decode(errors="replace")
        except OSError as e:
            return f"(unreadable: {e})"

    def rss(self) -> int:
        return rss_bytes(self.pid)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self, timeout: float = 30.0) -> int | None:
        try:
            if self.proc.poll() is None and self.proc.stdin:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.stdin.close()
            self.proc.wait(timeout=timeout)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self._err is not subprocess.DEVNULL:
            self._err.close()
        return self.proc.returncode

    def __enter__(self) -> "Target":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def stdin_lines(poll_s: float = 0.05):
    """Command lines from fd 0 without ever blocking in C for long.

    A target waiting in a plain `sys.stdin.readline()` sits in read(2) and never reaches the
    interpreter's eval breaker, so an agent injected with Py_AddPendingCall (3.10-3.13) or PEP 768
    (3.14) would wait forever. Polling keeps the main thread running bytecode while idle.
    """
    import select

    buf = b""
    while True:
        r, _, _ = select.select([0], [], [], poll_s)
        if not r:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            if buf.strip():
                yield buf.decode(errors="replace")
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield line.decode(errors="replace")
