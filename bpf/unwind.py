"""User-space unwinding of CPU samples with the libraries' `.eh_frame` (DWARF CFI).

A frame-pointer walk (bpf_get_stack) stops at the first function built without frame pointers:
on the CPU VM's torch loop every sample's walk stopped within 8 frames, in libpython3.11,
libtorch_cpu (MKL's kernels), libc (benchmarks/bench_native_stacks.py). cpu.bpf.c therefore
also sends the sample's user registers and up to SL_STACK_COPY bytes of its stack from sp up;
`CfiUnwinder` walks that copy with each library's CFI rules (introspect/elf.EhFrame, rules cached
per library and address). Where no FDE covers a pc (JIT code, the vDSO) it takes one
frame-pointer step — a guess, kept only when the saved rbp lies in the copied stack. A walk that
leaves the copy, or finds no rule and no frame pointer, is cut (the decoder marks it).
Cost: see docs/benchmarks/native-stacks.md.
"""

from __future__ import annotations

import struct
from typing import Callable

from stacklens.introspect.elf import CFA_PLT, DW_RA, DW_RBP, DW_RSP, EhFrame, ElfFile

MAX_FRAMES = 256
REGS_WORDS = 21                     # struct pt_regs (x86-64), as cpu.bpf.c copies it
_REGS = struct.Struct(f"<{REGS_WORDS}QQ")   # + stack_len
REGS_BYTES = _REGS.size
# DWARF register number -> index in struct pt_regs (r15 r14 r13 r12 bp bx r11 r10 r9 r8 ax cx dx si di
# orig_ax ip cs flags sp ss); only the callee-saved ones outlive the leaf frame
_CALLEE_SAVED = {3: 5, 6: 4, 12: 3, 13: 2, 14: 1, 15: 0}
_PT_IP, _PT_SP, _PT_BP = 16, 19, 4
_U64 = struct.Struct("<Q")
CACHE_MAX = 1 << 16
SCAN_BYTES = 512   # how far above a leaf's sp its return address is looked for


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
        self._rules: dict[tuple[str, int], object] = {}
        self.counts = {"unwinds": 0, "complete": 0, "cfi_frames": 0, "fp_guesses": 0, "leaf_scans": 0}

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

    def _rule(self, pc: int, probe: bool = False):
        m = (self._known if probe else self._find)(pc)
        if m is None:
            return None, False
        if not m.path.startswith("/"):
            return None, True
        key = (m.path, pc - m.start + m.offset)
        r = self._rules.get(key, False)
        if r is False:
            e = self._ehframe(m.path.removesuffix(" (deleted)"))
            r = None
            if e is not None:
                v = e[0].offset_to_vaddr(key[1])
                r = None if v is None else e[1].rule(v)
            if len(self._rules) >= CACHE_MAX:
                self._rules.clear()
            self._rules[key] = r
        return r, True

    def unwind(self, regs_raw: bytes, stack: bytes) -> tuple[list[int], bool]:
        """(addresses innermost first, whether the walk reached a thread's first frame)."""
        words = _REGS.unpack_from(regs_raw, 0)
        sp0, n = words[_PT_SP], min(words[REGS_WORDS], len(stack))
        top = sp0 + n - 8
        unpack = _U64.unpack_from

        def mem(a: int):
            return unpack(stack, a - sp0)[0] if sp0 <= a <= top else None

        regs = {r: words[i] for r, i in _CALLEE_SAVED.items()}
        regs[DW_RSP] = sp0
        pc = words[_PT_IP]
        out: list[int] = []
        first = True
        while len(out) < MAX_FRAMES:
            out.append(pc)
            # only the sampled pc may re-read the maps (a library mapped since): a walk's last
            # return address is often no code at all, and a re-read per sample cost 5 ms
            rule, mapped = self._rule(pc) if first else self._rule(pc - 1, probe=True)
            if not mapped:
                return out, False
            if rule is None:
                bp = regs.get(DW_RBP)
                ra = None if bp is None else mem(bp + 8)
                if ra is not None and (ra == 0 or self._rule(ra - 1, probe=True)[0] is not None):
                    self.counts["fp_guesses"] += 1
                    regs = {DW_RBP: mem(bp), DW_RSP: bp + 16}
                elif first:
                    # a leaf without CFI and without a frame pointer (MKL's hand-written kernels):
                    # the first word above sp that returns into code with CFI is taken as its
                    # return address — a guess, counted (`leaf_scans`)
                    a = self._scan(mem, sp0)
                    if a is None:
                        return out, False
                    self.counts["leaf_scans"] += 1
                    ra = mem(a)
                    regs[DW_RSP] = a + 8
                else:
                    return out, False
            else:
                if rule.outermost:
                    return out, True
                if rule.cfa_reg == CFA_PLT:
                    cfa = regs[DW_RSP] + 8 + (8 if (pc & 15) >= 11 else 0)
                else:
                    base = regs.get(rule.cfa_reg)
                    if base is None:
                        return out, False
                    cfa = base + rule.cfa_off
                new = {r: v for r, v in regs.items() if r in _CALLEE_SAVED}
                ra = None
                for r, off in rule.saved:
                    v = mem(cfa + off)
                    if r == DW_RA:
                        ra = v
                    elif r in _CALLEE_SAVED:
                        if v is None:
                            new.pop(r, None)
                        else:
                            new[r] = v
                if ra is None:
                    return out, False
                new[DW_RSP] = cfa
                regs = new
                self.counts["cfi_frames"] += 1
            if ra == 0:
                return out, True
            pc = ra
            first = False
        return out, False

    def _scan(self, mem, sp: int) -> int | None:
        """The first stack slot in SCAN_BYTES above sp holding an address just after a call in
        code that has CFI, or None."""
        for a in range(sp, sp + SCAN_BYTES, 8):
            v = mem(a)
            if v is None:
                return None
            if v > 4096 and self._rule(v - 1, probe=True)[0] is not None:
                return a
        return None
