"""`stacklens dump PID` / `stacklens dump --job LAUNCHER_PID`: every thread's Python stack now,
as text or JSON, without the daemon or the agent (pystacks/dump.py reads, pystacks/dumpjob.py finds
the ranks). Root (or CAP_SYS_PTRACE); the target is not stopped.

Where a running stacklensd has the process attached, its GPU side follows, as the probes saw it:
the calls still waiting (a sync, a collective: how long, at which line) and each thread's last
kernel launch (`GetInFlight`); otherwise the dump says why that part is not known.
"""

from __future__ import annotations

import json
import os
import sys

from stacklens.pystacks.dumpjob import JobDump
from stacklens.errors import InputError
from stacklens.pystacks.dump import ProcessDump, ThreadDump


def thread_text(t: ThreadDump) -> list[str]:
    tags = [s for s in ("main" if t.main else "", "holds the GIL" if t.holds_gil else "",
                        "moving: stack read while it ran" if not t.consistent else "") if s]
    head = f"Thread {t.tid or '?'} \"{t.name}\" {t.state} ({t.syscall})"
    if tags:
        head += " [" + ", ".join(tags) + "]"
    lines = [head]
    if not t.python:
        lines.append("    (no Python)")
    elif not t.frames:
        lines.append("    (no Python frames)")
    lines += [f"    {f.function} ({f.file}:{f.line})" for f in t.frames]
    if t.truncated:
        lines.append("    … (outer frames cut)")
    if t.note:
        lines.append(f"    ({t.note})")
    return lines


def process_text(d: ProcessDump, only_python: bool = False) -> str:
    gil = {"held": f"held by thread {d.gil_holder_tid}" if d.gil_holder_tid else "held (by ?)",
           "released": "released (no thread holds it)", "unknown": "unknown"}[d.gil]
    lines = [f"Process {d.pid} ({d.comm}), Python {d.python_version}; GIL: {gil}",
             f"read in {d.elapsed_ms:.1f} ms, the target not stopped"]
    lines += [f"note: {n}" for n in d.notes]
    for t in d.threads:
        if only_python and not t.python:
            continue
        lines.append("")
        lines += thread_text(t)
    hidden = sum(1 for t in d.threads if not t.python)
    if only_python and hidden:
        lines += ["", f"({hidden} threads without Python not shown; --all shows them)"]
    return "\n".join(lines) + "\n"


def job_text(j: JobDump) -> str:
    lines = [f"Job under launcher {j.launcher}: WORLD_SIZE {j.world_size or '?'}, "
             f"{len(j.ranks)} rank processes found"]
    lines += [f"note: {n}" for n in j.notes]
    for r in j.ranks:
        if r.error:
            what = f"not dumped: {r.error}"
        elif r.collective:
            what = f"waits in {r.collective}" + (f", called from {r.caller}" if r.caller else "")
        else:
            main = r.dump.main_thread() if r.dump else None
            top = main.frames[0] if main and main.frames else None
            what = "not in a collective" + (f": main thread at {top}" if top else "")
        lines.append(f"  rank {r.rank.rank} (PID {r.rank.pid}): {what}")
    for rank, why in j.missing:
        lines.append(f"MISSING rank {rank}: {why}")
    if not j.missing and j.ranks:
        lines.append("no rank missing")
    for r in j.ranks:
        if r.dump:
            lines += ["", f"== rank {r.rank.rank} ==", process_text(r.dump, only_python=True).rstrip()]
    return "\n".join(lines) + "\n"


def _py_line(path) -> str:
    """`file:line (function)` of the innermost Python frame of a path of labels, else its end."""
    for label in reversed(path):
        if label.startswith("py:"):
            file, func, line = label[3:].rsplit(":", 2)
            return f"{file}:{line} ({func})"
    return path[-1] if path else "?"


def in_flight_text(r) -> list[str]:
    lines = ["", "GPU side, as stacklensd's probes saw it:"]
    for w in r.waiting:
        lines.append(f"  thread {w.tid} \"{w.thread}\" waits in {w.api} for {w.since_s:.1f} s, at {_py_line(w.path)}")
    for x in r.last_launches:
        lines.append(f"  thread {x.tid} \"{x.thread}\" last launched {x.kernel or '?'} {x.ago_s:.1f} s ago, "
                     f"from {_py_line(x.path)}")
    if not r.waiting and not r.last_launches:
        lines.append("  no call waiting, no kernel launch seen since the attach")
    if r.last_launches:
        lines.append("  (whether a launched kernel has finished is not seen by the probes)")
    return lines


def in_flight(socket_path: str | None, pid: int):
    """(the daemon's GetInFlight answer or None, why not)."""
    from stacklens.daemon.client import DaemonClient
    from stacklens.errors import StacklensError

    if not socket_path or not os.path.exists(socket_path):
        return None, f"no stacklensd at {socket_path}"   # at once: a dump must not wait for a daemon
    try:
        with DaemonClient(socket_path, timeout=5) as c:
            return c.in_flight(pid), ""
    except StacklensError as e:
        return None, str(e)


def run_dump(pid: int, *, job: bool, as_json: bool, all_threads: bool = False,
             socket_path: str | None = None) -> int:
    if job:
        from stacklens.pystacks.dumpjob import dump_job

        j = dump_job(pid)
        if not j.ranks and not j.missing:       # nothing under it is a rank: a wrong PID
            raise InputError(j.notes[0] if j.notes else f"no process under PID {pid} sets RANK")
        sys.stdout.write(json.dumps(j.to_json(), indent=1) + "\n" if as_json else job_text(j))
        return 0
    from stacklens.daemon.core import check_target
    from stacklens.pystacks.dump import dump_process

    check_target(pid, who="stacklens dump")   # a kernel thread, a zombie, a protected process: said as such
    d = dump_process(pid)
    gpu, why = in_flight(socket_path, pid)
    if as_json:
        from stacklens.cli.daemoncmds import to_json

        doc = d.to_json()
        doc["gpu_in_flight"] = to_json(gpu) if gpu is not None else {"unavailable": why}
        sys.stdout.write(json.dumps(doc, indent=1) + "\n")
        return 0
    text = process_text(d, only_python=not all_threads)
    if gpu is not None:
        text += "\n".join(in_flight_text(gpu)) + "\n"
    else:
        text += f"\nGPU side: not known ({why})\n"
    sys.stdout.write(text)
    return 0
