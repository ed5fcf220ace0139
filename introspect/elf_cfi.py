"""Call frame information from an ELF file's `.eh_frame`: how to find a caller's frame without
frame pointers. `EhFrame(elf).rule(vaddr)` gives the `CfiRule` at a link-time address (the FDE found
through `.eh_frame_hdr`'s search table, its CFA program run up to that address); x86-64, what GCC and
Clang emit. Callers import these from `stacklens.introspect.elf`; bpf/unwind.py walks stacks with them.

Pure file parsing over an `ElfFile`'s mapped bytes (`stacklens.introspect.elf_file`), no privileges.
Nothing is parsed up front but the search table; a lookup is a binary search and one FDE's program.
"""

from __future__ import annotations

import struct
from bisect import bisect_right
from dataclasses import dataclass

from stacklens.introspect.elf_file import ElfFile

# DWARF register numbers on x86-64
DW_RBP, DW_RSP, DW_RA = 6, 7, 16
CFA_PLT = -1          # the CFA is the PLT's expression (rsp + 8, + 8 more past the push): see CfiRule
_DEREF = "deref"      # EhFrame._run's state: the CFA is the word at register + offset
_S4 = struct.Struct("<i")
_HDR_ENTRY = struct.Struct("<ii")


@dataclass(frozen=True)
class CfiRule:
    """What a function's CFI says at one pc: CFA = register `cfa_reg` + `cfa_off` (CFA_PLT: the
    PLT's expression; `cfa_deref`: the CFA is the word stored there, GCC's stack realignment),
    `saved`: (DWARF register, offset from the CFA) of the registers saved on the stack (the
    return address is register 16), `saved_at`: (register, base register, offset) of those saved
    at an address given by another register (DW_CFA_expression `DW_OP_breg`, same realignment),
    `outermost`: the return address is undefined (_start, clone: the thread's first frame),
    `start`: the link-time address of the function's first instruction (its FDE's initial location)."""

    cfa_reg: int
    cfa_off: int
    saved: tuple[tuple[int, int], ...]
    outermost: bool
    start: int = 0
    cfa_deref: bool = False
    saved_at: tuple[tuple[int, int, int], ...] = ()


def _uleb(m, p: int) -> tuple[int, int]:
    r = s = 0
    while True:
        b = m[p]
        p += 1
        r |= (b & 0x7F) << s
        s += 7
        if b < 0x80:
            return r, p


def _sleb(m, p: int) -> tuple[int, int]:
    r, end = _uleb(m, p)
    if m[end - 1] & 0x40:               # the sign bit of the last byte read
        r -= 1 << 7 * (end - p)
    return r, end


def _breg(m, p: int, end: int, tail: int) -> tuple[int, int] | None:
    """(register, offset) of a DWARF expression from p to end that is one DW_OP_breg<r> <sleb>
    followed by `tail` more bytes; None for any other expression."""
    if not 0x70 <= m[p] <= 0x8F:
        return None
    off, q = _sleb(m, p + 1)
    return (m[p] - 0x70, off) if q + tail == end else None


class EhFrame:
    """An ELF file's `.eh_frame` read through its `.eh_frame_hdr` search table: `rule(vaddr)`
    finds the FDE covering a link-time address by binary search and runs its CFA program up to
    that address. Nothing is parsed up front but the table (kept as the file's bytes); CIEs are
    parsed once each. Handles what GCC and Clang emit for x86-64 (the PLT's
    DW_CFA_def_cfa_expression is recognized as such; other expressions give no rule)."""

    def __init__(self, elf: ElfFile):
        self._m = m = elf.data
        self._elf = elf
        self._cies: dict[int, tuple] = {}
        self._n = 0
        self.available = False
        hdr = elf.sections.get(".eh_frame_hdr")
        if hdr is None or hdr.size < 12:
            return
        ver, _ptr_enc, cnt_enc, tab_enc = m[hdr.offset:hdr.offset + 4]
        if ver != 1 or tab_enc != 0x3B or cnt_enc != 0x03:   # datarel sdata4 table, udata4 count
            return
        self._hdr_vaddr = hdr.addr
        p = hdr.offset + 4
        p += 4 if _ptr_enc & 0x0F in (0x03, 0x0B) else 8
        self._n = struct.unpack_from("<I", m, p)[0]
        self._tab = p + 4
        self._locs = memoryview(m)[self._tab:self._tab + 8 * self._n].cast("i")[0::2] if not isinstance(m, bytes) \
            else memoryview(m[self._tab:self._tab + 8 * self._n]).cast("i")[0::2]
        self.available = self._n > 0

    def _fde_for(self, vaddr: int) -> int | None:
        rel = vaddr - self._hdr_vaddr
        i = bisect_right(self._locs, rel) - 1
        if i < 0:
            return None
        fde_vaddr = self._hdr_vaddr + _HDR_ENTRY.unpack_from(self._m, self._tab + 8 * i)[1]
        return self._elf.vaddr_to_offset(fde_vaddr)

    def _ptr(self, enc: int, p: int) -> tuple[int, int]:
        """An encoded pointer at file offset p -> (value, next offset); pcrel is made absolute."""
        m = self._m
        fmt = enc & 0x0F
        if fmt == 0x00 or fmt == 0x04:
            v, n = struct.unpack_from("<Q", m, p)[0], p + 8
        elif fmt == 0x03:
            v, n = struct.unpack_from("<I", m, p)[0], p + 4
        elif fmt == 0x0B:
            v, n = _S4.unpack_from(m, p)[0], p + 4
        elif fmt == 0x0C:
            v, n = struct.unpack_from("<q", m, p)[0], p + 8
        elif fmt == 0x02:
            v, n = struct.unpack_from("<H", m, p)[0], p + 2
        elif fmt == 0x0A:
            v, n = struct.unpack_from("<h", m, p)[0], p + 2
        elif fmt == 0x01:
            v, n = _uleb(m, p)
        elif fmt == 0x09:
            v, n = _sleb(m, p)
        else:
            raise ValueError(f"pointer encoding 0x{enc:x}")
        if enc & 0x70 == 0x10:
            v += self._elf.offset_to_vaddr(p) or 0
        return v, n

    def _cie(self, off: int) -> tuple:
        c = self._cies.get(off)
        if c is not None:
            return c
        m = self._m
        ln = struct.unpack_from("<I", m, off)[0]
        p = off + 8
        end = off + 4 + ln
        ver = m[p]
        p += 1
        z = m.find(b"\0", p)
        aug = bytes(m[p:z]).decode("ascii", "replace")
        p = z + 1
        code_align, p = _uleb(m, p)
        data_align, p = _sleb(m, p)
        if ver == 1:
            p += 1
        else:
            _, p = _uleb(m, p)
        fde_enc = 0x00
        if aug.startswith("z"):
            alen, p = _uleb(m, p)
            q = p
            for ch in aug[1:]:
                if ch == "R":
                    fde_enc = m[q]
                    q += 1
                elif ch == "P":
                    q = self._ptr(m[q] & 0x7F, q + 1)[1]
                elif ch == "L":
                    q += 1
            p += alen
        c = (code_align, data_align, fde_enc, p, end, aug.startswith("z"))
        self._cies[off] = c
        return c

    def rule(self, vaddr: int) -> CfiRule | None:
        """The CFI rule at link-time address `vaddr`; None where no FDE covers it or its program
        uses what this reader does not follow."""
        if not self.available:
            return None
        try:
            off = self._fde_for(vaddr)
            if off is None:
                return None
            m = self._m
            ln = struct.unpack_from("<I", m, off)[0]
            if ln == 0 or ln == 0xFFFFFFFF:
                return None
            cie_off = off + 4 - struct.unpack_from("<I", m, off + 4)[0]
            ca, da, enc, cie_ins, cie_end, has_z = self._cie(cie_off)
            start, p = self._ptr(enc, off + 8)
            length, p = self._ptr(enc & 0x0F, p)
            if not start <= vaddr < start + length:
                return None
            if has_z:
                alen, p = _uleb(m, p)
                p += alen
            state = [DW_RSP, 8, {DW_RA: -8}, False]
            self._run(cie_ins, cie_end, ca, da, enc, start, 1 << 64, state, None)
            init = (state[0], state[1], dict(state[2]), state[3])
            self._run(p, off + 4 + ln, ca, da, enc, start, vaddr, state, init)
        except (struct.error, IndexError, ValueError):
            return None
        if state[3] is None:
            return None
        saved = tuple((r, v) for r, v in state[2].items() if type(v) is int)
        at = tuple((r,) + v for r, v in state[2].items() if type(v) is tuple)
        ra = state[2].get(DW_RA)
        if type(ra) is tuple:
            return None
        return CfiRule(state[0], state[1], saved, ra is None, start, state[3] == _DEREF, at)

    def _run(self, p: int, end: int, ca: int, da: int, enc: int, loc: int, target: int, state: list,  # long: one dispatch over DWARF CFA opcodes, a call per opcode would cost the walk
             init) -> None:
        """Runs CFA instructions from p to end while loc <= target. state: [cfa_reg, cfa_off,
        {reg: offset from CFA, or (base register, offset): saved at an address given by another
        register; absent: same value / undefined for RA}, how the CFA is formed (False: register +
        offset, True: the PLT's expression, _DEREF: the word at register + offset, None: not followed)]."""
        m = self._m
        stack: list = []
        while p < end:
            op = m[p]
            p += 1
            hi, lo = op & 0xC0, op & 0x3F
            if hi == 0x40:
                loc += lo * ca
                if loc > target:
                    return
                continue
            if hi == 0x80:
                v, p = _uleb(m, p)
                state[2][lo] = v * da
                continue
            if hi == 0xC0:
                if init is not None and lo in init[2]:
                    state[2][lo] = init[2][lo]
                else:
                    state[2].pop(lo, None)
                continue
            if op == 0x00:
                continue
            if op in (0x02, 0x03, 0x04):
                n = {0x02: 1, 0x03: 2, 0x04: 4}[op]
                loc += int.from_bytes(m[p:p + n], "little") * ca
                p += n
                if loc > target:
                    return
            elif op == 0x01:
                loc, p = self._ptr(enc, p)
                if loc > target:
                    return
            elif op in (0x05, 0x11):
                r, p = _uleb(m, p)
                v, p = (_uleb if op == 0x05 else _sleb)(m, p)
                state[2][r] = v * da
            elif op == 0x06:
                r, p = _uleb(m, p)
                if init is not None and r in init[2]:
                    state[2][r] = init[2][r]
                else:
                    state[2].pop(r, None)
            elif op in (0x07, 0x08):
                r, p = _uleb(m, p)
                state[2].pop(r, None)
            elif op == 0x09:
                r, p = _uleb(m, p)
                _, p = _uleb(m, p)
                state[2].pop(r, None)      # saved in another register: not followed
            elif op == 0x0A:
                stack.append((state[0], state[1], dict(state[2]), state[3]))
            elif op == 0x0B:
                if stack:
                    state[0], state[1], state[2], state[3] = stack.pop()
            elif op == 0x0C:
                state[0], p = _uleb(m, p)
                state[1], p = _uleb(m, p)
                state[3] = False
            elif op == 0x12:
                state[0], p = _uleb(m, p)
                v, p = _sleb(m, p)
                state[1] = v * da
                state[3] = False
            elif op == 0x0D:
                state[0], p = _uleb(m, p)
            elif op == 0x0E:
                state[1], p = _uleb(m, p)
            elif op == 0x13:
                v, p = _sleb(m, p)
                state[1] = v * da
            elif op == 0x0F:
                n, p = _uleb(m, p)
                # the PLT's: rsp + 8 + ((rip & 15) >= 11) * 8 (DW_OP_breg7 8; DW_OP_breg16 0; ...)
                if m[p] == 0x77 and m[p + 2] == 0x80:
                    state[0], state[1], state[3] = CFA_PLT, 8, True
                else:
                    # GCC's stack realignment: DW_OP_breg<r> off; DW_OP_deref
                    b = _breg(m, p, p + n, 1)
                    if b is not None and m[p + n - 1] == 0x06:
                        state[0], state[1], state[3] = b[0], b[1], _DEREF
                    else:
                        state[0], state[1], state[3] = -2, 0, None
                p += n
            elif op in (0x10, 0x16):
                r, p = _uleb(m, p)
                n, p = _uleb(m, p)
                # saved at DW_OP_breg<b> off (the realignment's saves); other expressions: not followed
                b = _breg(m, p, p + n, 0) if op == 0x10 else None
                if b is not None:
                    state[2][r] = b
                else:
                    state[2].pop(r, None)
                p += n
            elif op in (0x14, 0x15):
                r, p = _uleb(m, p)
                _, p = (_uleb if op == 0x14 else _sleb)(m, p)
                state[2].pop(r, None)
            elif op == 0x2E:
                _, p = _uleb(m, p)
            elif op == 0x2F:
                r, p = _uleb(m, p)
                v, p = _uleb(m, p)
                state[2][r] = -v * da
            else:
                raise ValueError(f"CFA instruction 0x{op:x}")
