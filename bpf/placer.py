"""ProbePlacer: probes placed on the sites bpf/scan.py found in one process's libraries.

One uprobe_multi link per entry program and library file (kernel >= 6.6, bpf/uprobe_multi.py):
~0.01-0.2 s to attach thousands of offsets, one close() of its fd to detach them all (~0.05 s).
Without uprobe_multi (the fallback) one perf-event uprobe per site on the program's numbered
stubs (sl_api_entry_N, sl_op_entry_N, …), ~0.1 s each to remove, removed with the BCC module.
Requires root (CAP_BPF + CAP_PERFMON).
"""

from __future__ import annotations

import errno
import os

from stacklens.errors import AttachError, NoSuchProcess

from stacklens.bpf import autograd
from stacklens.bpf.loader import ProgramLoader
from stacklens.bpf.spec import ProbeSite
from stacklens.bpf.uprobe_multi import UprobeMultiError, attach_uprobe_multi


class ProbePlacer:
    """The probes of one process on the program `program` has loaded now: each method places
    one kind of probe on one library file (`path`: as we open it, /proc/PID/root/…); the links'
    fds are kept until close()."""

    def __init__(self, pid: int, program: ProgramLoader):
        self.pid = pid
        self.program = program
        self.links: list[int] = []

    @property
    def fallback(self) -> bool:
        return self.program.fallback

    def api(self, path: str, present: tuple[ProbeSite, ...]) -> None:
        """GPU API and collective probes: entry on every site, return on those whose spec has `ret`."""
        if self.program.fallback:
            for p in present:
                self.program.bpf.attach_uprobe(name=path.encode(), sym=p.export.encode(),
                                               fn_name=f"sl_api_entry_{p.spec.index}".encode(), pid=self.pid)
                if p.spec.ret:
                    self.program.bpf.attach_uretprobe(name=path.encode(), sym=p.export.encode(),
                                                      fn_name=f"sl_api_return_{p.spec.index}".encode(),
                                                      pid=self.pid)
            return
        programs = self.program.programs
        self.links.append(self._link(programs["api_entry"].fd, path, [p.offset for p in present],
                                     [p.spec.index for p in present]))
        rets = [p for p in present if p.spec.ret]
        if rets:
            self.links.append(self._link(programs["api_return"].fd, path, [p.offset for p in rets],
                                         [p.spec.index for p in rets], retprobe=True))

    def ops(self, path: str, offsets: list[int], indices: list[int]) -> None:
        """Operator probes at file `offsets`; each call's op is `indices` (into the op names)."""
        if self.program.fallback:
            from stacklens.introspect.elf import ElfFile

            with ElfFile(path) as elf:  # BCC takes a virtual address and converts it
                for off, i in zip(offsets, indices):
                    self.program.bpf.attach_uprobe(name=path.encode(), addr=elf.offset_to_vaddr(off),
                                                   fn_name=f"sl_op_entry_{i}".encode(), pid=self.pid)
            return
        self.links.append(self._link(self.program.programs["op_entry"].fd, path, offsets, indices))

    def autograd(self, path: str, offsets: dict[str, int]) -> None:
        """The forward→backward link's entry points (autograd.SYMBOLS, at `offsets`)."""
        if self.program.fallback:
            for i, sym in enumerate(autograd.SYMBOLS):
                self.program.bpf.attach_uprobe(name=path.encode(), sym=sym.encode(),
                                               fn_name=f"sl_autograd_{i}".encode(), pid=self.pid)
            return
        self.links.append(self._link(self.program.programs["autograd"].fd, path,
                                     [offsets[s] for s in autograd.SYMBOLS], [0, 1]))

    def _link(self, prog_fd: int, path: str, offsets: list[int], cookies: list[int],
              retprobe: bool = False) -> int:
        try:
            return attach_uprobe_multi(prog_fd, path, offsets, cookies, pid=self.pid, retprobe=retprobe)
        except UprobeMultiError as e:
            if e.errno == errno.ESRCH:
                raise NoSuchProcess(f"process {self.pid} exited during attach; nothing was left attached") from e
            if e.errno == errno.ENOENT:
                raise NoSuchProcess(f"{path} vanished during attach (process {self.pid} exited?)") from e
            raise AttachError(f"{e}; is the kernel >= 6.6 (uprobe_multi)? "
                              f"ProbeConfig(force_fallback=True) uses per-probe uprobes") from e

    def close(self) -> None:
        """Detach every link (per-probe uprobes go with the program's module); safe to call twice."""
        links, self.links = self.links, []
        for fd in links:
            try:
                os.close(fd)
            except OSError:
                pass
