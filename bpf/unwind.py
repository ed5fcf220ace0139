"""User-space unwinding of CPU samples with the libraries' `.eh_frame` (DWARF CFI).

A frame-pointer walk (bpf_get_stack) stops at the first function built without frame pointers:
on the CPU VM's torch loop every sample's walk stopped within 8 frames, in libpython3.11,
libtorch_cpu (MKL's kernels), libc (benchmarks/bench_native_stacks.py). cpu.bpf.c therefore
also sends the sample's user registers and up to SL_STACK_COPY bytes of its stack from sp up;
`CfiUnwinder` walks that copy with each library's CFI rules (introspect/elf.EhFrame). Where no
FDE covers a pc (JIT code, the vDSO) it takes one frame-pointer step — a guess, kept only when
the saved rbp lies in the copied stack. A walk that leaves the copy, or finds no rule and no
frame pointer, is cut (the decoder marks it; `counts` says why).
Cost: one dict lookup and a few reads of the copy per frame, the CFI program of an address run
once (rows cached by address): 33-59 µs of CPU per walked sample of a torch loop replayed
offline, ~160 µs live on the busy 2-vCPU VM (docs/benchmarks/native-stacks.md). No privileges
(it reads the target's files).
"""

from __future__ import annotations

import struct
from typing import Callable

from stacklens.introspect.elf import CFA_PLT, DW_RA, EhFrame, ElfFile

MAX_FRAMES = 256
REGS_WORDS = 21                     # struct pt_regs (x86-64), as cpu.bpf.c copies it
_REGS = struct.Struct(f"<{REGS_WORDS}QQ")   # + stack_len
REGS_BYTES = _REGS.size
# DWARF register number (rax rdx rcx rbx rsi rdi rbp rsp r8..r15) -> index in struct pt_regs
# (r15 r14 r13 r12 bp bx r11 r10 r9 r8 ax cx dx si di orig_ax ip cs flags sp ss)
_PT_INDEX = (10, 12, 11, 5, 13, 14, 4, 19, 9, 8, 7, 6, 3, 2, 1, 0)
_CALLEE_SAVED = frozenset((3, 6, 12, 13, 14, 15))   # rbx rbp r12-r15: they outlive a call
_CALLER_SAVED = tuple(r for r in range(16) if r not in _CALLEE_SAVED and r != 7)
_PT_IP, _PT_SP = 16, 19
_RBP, _RSP = 6, 7
CACHE_MAX = 1 << 17  # rows kept by address (~100 B each); then the cache starts again
SCAN_BYTES = 512   # how far above a leaf's sp its return address is looked for
BASE_REACH = 128   # how far above a saved frame base (`_scan_base`) it is looked for
CUTS = ("cut_unmapped", "cut_no_rule", "cut_left_copy", "cut_scan", "cut_max_frames", "cut_unaligned")
# a row: what the walk does at one address (`_row`). Tuples (cfa_reg, cfa_off, ra_off, saves,
# entry, cfa_deref, saves_at) for CFI (see _compile); these two for the rest
_NO_RULE = ("no_rule",)       # mapped, but no CFI covers it: a frame-pointer step, or a leaf scan
_OUTERMOST = ("outermost",)   # the thread's first frame (the return address is undefined)


class CfiUnwinder:
    """Registers + a copy of the stack -> innermost-first return addresses. `find(addr)`: the
    executable mapping at addr (procfs.Mapping) or None; `host_path(path)`: where the target's
    file is readable from here."""

    def __init__(self, find: Callable, host_path: Callable[[str], str], known: Callable | None = None):
        """`known(addr)`: like `find` but never re-reads the maps: for every address but the
        sampled pc (return addresses, the words a leaf scan or a frame-pointer guess tests; a
        re-read of a torch process's maps per miss made a walk cost 3.3-5 ms)."""
        self._find = find
        self._known = known or find
        self._host = host_path
        self._eh: dict[str, tuple[ElfFile, EhFrame] | None] = {}
        # rows by absolute address: like the symbolizer's frames (procmaps.NativeSymbolizer), an
        # address keeps its meaning while the process lives (a library unmapped and another one
        # mapped at the same address would be misread; nothing the profiled programs do)
        self._rows: dict[int, tuple] = {}
        self.counts = dict.fromkeys(("unwinds", "complete", "cfi_frames", "fp_guesses", "leaf_scans",
                                     "base_scans", "base_scans_dropped", "at_breakpoint", "reached_end")
                                    + CUTS, 0)

    def _ehframe(self, path: str):
        e = self._eh.get(path, False)
        if e is False:
            try:
                elf = ElfFile(self._host(path))
                e = (elf, EhFrame(elf))
            except Exception:  # noqa: BLE001 — an unreadable file: no CFI for it (fp steps only)
                e = None
            self._eh[path] = e
        return e

    def _row(self, addr: int, sampled: bool = False) -> tuple | None:
        """The row at `addr` (a sampled pc, or a return address - 1); None where no executable
        mapping holds it (not cached: only the sampled pc may re-read the maps, and a library
        mapped since must then be found)."""
        m = (self._find if sampled else self._known)(addr)
        if m is None:
            return None
        row = _NO_RULE
        if m.path.startswith("/"):
            e = self._ehframe(m.path.removesuffix(" (deleted)"))
            if e is not None:
                v = e[0].offset_to_vaddr(addr - m.start + m.offset)
                rule = None if v is None else e[1].rule(v)
                if rule is not None:
                    row = _compile(rule, addr, v - rule.start)
        if len(self._rows) >= CACHE_MAX:
            self._rows.clear()
        self._rows[addr] = row
        return row

    def unwind(self, regs_raw: bytes, stack) -> tuple[list[int], bool]:
        """(addresses innermost first, whether the walk reached a thread's first frame). A walk
        from a saved-base guess (`_scan_base`) is dropped (the leaf alone, cut) where it ends in
        garbage, an address in no mapping or in code without CFI: a wrong guess reads stale
        frames (measured once: 71 walks through a static initializer's frame left from the
        import); a right one ends at the thread's first frame or the copy's end."""
        self._based = False
        counts = self.counts
        garbage = counts["cut_unmapped"] + counts["cut_no_rule"]
        out, complete = self._walk(regs_raw, stack)
        if self._based and counts["cut_unmapped"] + counts["cut_no_rule"] > garbage:
            counts["base_scans_dropped"] += 1
            return out[:1], False
        return out, complete

    def _walk(self, regs_raw: bytes, stack) -> tuple[list[int], bool]:  # long: the walk is one loop, a call per frame would cost it
        words = _REGS.unpack_from(regs_raw, 0)
        sp0, n = words[_PT_SP], min(words[REGS_WORDS], len(stack))
        counts = self.counts
        if sp0 & 7:
            counts["cut_unaligned"] += 1
            return [words[_PT_IP]], False
        mem = memoryview(stack)[:n & ~7].cast("B").cast("Q")   # the copy as words: mem[(a - sp0) >> 3]
        nw = len(mem)
        regs = [words[i] for i in _PT_INDEX]     # the leaf's registers, by DWARF number
        rows = self._rows
        row_of = self._row
        pc = words[_PT_IP]
        out = [pc]
        row = rows.get(pc) or row_of(pc, True)
        first = True
        while True:
            if row is None:
                counts["cut_unmapped"] += 1
                return out, False
            if row is _NO_RULE:
                # a frame-pointer step, kept where the saved rbp's return address is code (or 0)
                bp = regs[_RBP]
                i = (bp - sp0) >> 3 if bp is not None and not bp & 7 else -1
                ra = mem[i + 1] if 0 <= i < nw - 1 else None
                if ra is not None and (ra == 0 or (rows.get(ra - 1) or row_of(ra - 1)) is not None):
                    counts["fp_guesses"] += 1
                    regs[_RBP] = mem[i]
                    regs[_RSP] = bp + 16
                    for r in (3, 12, 13, 14, 15):
                        regs[r] = None          # saved somewhere this guess does not know
                elif first:
                    # a leaf without CFI and without a frame pointer (MKL's hand-written kernels):
                    # the first word above sp that returns into code with CFI is taken as its
                    # return address — a guess, counted (`leaf_scans`)
                    i = self._scan(mem, nw)
                    if i is None:
                        i = self._scan_base(mem, nw, sp0)
                        self._based = i is not None
                        counts["base_scans"] += self._based
                    if i is None:
                        counts["cut_scan"] += 1
                        return out, False
                    counts["leaf_scans"] += 1
                    ra = mem[i]
                    regs[_RSP] = sp0 + 8 * i + 8
                else:
                    counts["cut_no_rule"] += 1
                    return out, False
            elif row is _OUTERMOST:
                counts["reached_end"] += 1
                return out, True
            else:
                cfa_reg, cfa_off, ra_off, saves, entry, deref, saves_at = row
                if first and entry >= 0:
                    # a sample in an entry uprobe's trap (int3 on the function's first byte; 8%
                    # of a torch loop's samples are in the op probes'): at pc = entry + 1 nothing
                    # is pushed yet, the return address is at sp, though the CFI row there counts
                    # a 1-byte push (taken where that word is code: after a real push it is the
                    # pushed register); at pc = entry with the kernel's emulated push done, it is
                    # at sp + 8 (taken only where the word at sp is no code)
                    i = 1 - entry
                    ra = mem[i] if i < nw else None
                    if ra is not None and (rows.get(ra - 1) or row_of(ra - 1)) not in (None, _NO_RULE) and (
                            entry or (rows.get(mem[0] - 1) or row_of(mem[0] - 1)) in (None, _NO_RULE)):
                        counts["at_breakpoint"] += 1
                        # a push leaves the register as it was: nothing to restore
                        cfa_reg, cfa_off, ra_off, saves, deref, saves_at = _RSP, 8 * i + 8, -8, (), False, ()
                base = regs[cfa_reg]
                if base is None:
                    counts["cut_left_copy"] += 1
                    return out, False
                cfa = base + cfa_off
                if deref:       # GCC's realignment: the CFA was saved at rbp - 8
                    i = (cfa - sp0) >> 3
                    cfa = mem[i] if 0 <= i < nw and not cfa & 7 else 1
                i = (cfa + ra_off - sp0) >> 3
                if not 0 <= i < nw or cfa & 7:
                    counts["cut_left_copy"] += 1
                    return out, False
                ra = mem[i]
                if saves_at:    # at addresses given by this frame's registers: read before any changes
                    got = []
                    for r, b, off in saves_at:
                        a = regs[b]
                        i = (a + off - sp0) >> 3 if a is not None and not (a + off) & 7 else -1
                        got.append((r, mem[i] if 0 <= i < nw else None))
                    for r, v in got:
                        regs[r] = v
                for r, off in saves:
                    # a slot below sp: the function has popped it already (GCC's epilogues keep
                    # the CFI's "saved at" after the pop), so the register holds the caller's value
                    i = (cfa + off - sp0) >> 3
                    if i >= 0:
                        regs[r] = mem[i] if i < nw else None
                regs[_RSP] = cfa
                counts["cfi_frames"] += 1
            if ra == 0:
                counts["reached_end"] += 1
                return out, True
            if first:
                first = False
                for r in _CALLER_SAVED:
                    regs[r] = None              # clobbered by the calls below the caller
            if len(out) >= MAX_FRAMES:
                counts["cut_max_frames"] += 1
                return out, False
            out.append(ra)
            pc = ra - 1                         # the call instruction: its row, not the next one's
            row = rows.get(pc) or row_of(pc)

    def _scan(self, mem, nw: int) -> int | None:
        """The index of the first word in SCAN_BYTES above sp holding an address just after a
        call in code that has CFI, or None."""
        rows, row_of = self._rows, self._row
        for i in range(min(nw, SCAN_BYTES // 8)):
            v = mem[i]
            if v > 4096 and (rows.get(v - 1) or row_of(v - 1)) not in (None, _NO_RULE):
                return i
        return None


    def _scan_base(self, mem, nw: int, sp0: int) -> int | None:
        """For a leaf whose frame is larger than SCAN_BYTES (MKL's AVX-512 sgemm kernels align a
        packing buffer of tens of KiB below their return address and keep their frame's base in
        a slot near sp): the index of the first return address (code with CFI, as `_scan`) in
        the BASE_REACH bytes at a saved base, a word in SCAN_BYTES above sp that points into the
        copy above them; or None."""
        rows, row_of = self._rows, self._row
        top = sp0 + 8 * nw
        for i in range(min(nw, SCAN_BYTES // 8)):
            b = mem[i]
            if b & 7 or not sp0 + SCAN_BYTES <= b < top:
                continue
            j0 = (b - sp0) >> 3
            for j in range(j0, min(nw, j0 + BASE_REACH // 8)):
                v = mem[j]
                if v > 4096 and (rows.get(v - 1) or row_of(v - 1)) not in (None, _NO_RULE):
                    return j
        return None


def _compile(rule, addr: int, from_start: int) -> tuple:
    """A CfiRule at `addr` -> the row the walk applies: (CFA register, CFA offset, return
    address offset from the CFA, ((callee-saved register, offset from the CFA), ...), which entry
    trap state a sample at addr may be in (1: one byte past the function's first one, 0: on it,
    -1: neither), whether the CFA is the word at register + offset, ((callee-saved register, base
    register, offset), ...))."""
    if rule.outermost:
        return _OUTERMOST
    saved = dict(rule.saved)
    ra_off = saved.get(DW_RA)
    entry = from_start if from_start in (0, 1) else -1   # the trap states unwind tries
    if rule.cfa_reg == CFA_PLT:
        # the PLT's expression: rsp + 8, + 8 more past its push (pc & 15 >= 11)
        return (_RSP, 16 if (addr & 15) >= 11 else 8, ra_off, (), -1, False, ())
    if not 0 <= rule.cfa_reg < 16 or ra_off is None:
        return _NO_RULE
    return (rule.cfa_reg, rule.cfa_off, ra_off,
            tuple((r, off) for r, off in rule.saved if r in _CALLEE_SAVED), entry, rule.cfa_deref,
            tuple((r, b, off) for r, b, off in rule.saved_at if r in _CALLEE_SAVED and 0 <= b < 16))
