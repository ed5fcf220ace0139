"""What the daemon does for processes no one asked it to attach: it compiles ahead the BPF
programs their CPython builds would need (`WarmUp`), and attaches the ones its auto-attach rule
matches (`auto_attach_scan`). Both walk the node's processes (daemon/discovery.py scan) and
leave the processes attached or being attached alone."""

from __future__ import annotations

import logging
from typing import Callable

from stacklens.daemon.discovery import scan
from stacklens.errors import AlreadyAttached, NoSuchProcess

log = logging.getLogger(__name__)


class WarmUp:
    """The programs compiled ahead: `prepare(pid)` compiles what an attach to pid would compile
    (None: no warm-up); at most `limit` CPython builds over the daemon's life."""

    def __init__(self, prepare: Callable[[int], bool] | None) -> None:
        self.prepare = prepare
        self.warmed: set[str] = set()     # CPython builds whose program was compiled (or failed)

    def done(self, limit: int) -> bool:
        return self.prepare is None or len(self.warmed) >= limit

    def run(self, daemon, limit: int) -> int:
        """Compiles the BPF programs that the torch/JAX processes running now would need, one per
        CPython build (what a program is compiled for), for at most `limit` builds: the first
        attach to such a process, or to another of the same build, then compiles nothing. A build
        whose compile failed is not tried again (an attach will say why); a process that exited
        meanwhile is (another of its build may come). Returns how many builds it prepared now."""
        if self.done(limit):
            return 0
        n = 0
        for info in scan(daemon.procfs, gpu_only=False):
            if daemon.closing or self.done(limit):
                break
            if daemon.knows(info.pid) or not info.python or info.python in self.warmed:
                continue
            log.info("warm-up: compiling the BPF program for the CPython build of PID %d", info.pid)
            try:
                if self.prepare(info.pid):
                    daemon.counters["warm_up_compiles"] += 1
            except NoSuchProcess:
                continue
            except Exception:  # noqa: BLE001 — counted; the attach reports the error itself
                daemon.counters["warm_up_failures"] += 1
            self.warmed.add(info.python)
            n += 1
        return n


def auto_attach_scan(daemon) -> list[int]:
    """Attaches (probes, never the agent) to the processes the daemon's auto-attach rule
    matches; races with Attach RPCs end in AlreadyAttached (counted). The PIDs it attached."""
    if daemon.auto_attach is None:
        return []
    attached = []
    for info in scan(daemon.procfs):
        if daemon.closing:
            break
        if daemon.knows(info.pid) or not daemon.auto_attach.matches(info):
            continue
        try:
            daemon.attach(info.pid, agent=False)
            attached.append(info.pid)
        except AlreadyAttached:
            daemon.counters["auto_attach_raced"] += 1
        except Exception:  # noqa: BLE001 — counted; a bad process must not stop the scan
            daemon.counters["auto_attach_failures"] += 1
    return attached
