"""bpf/unwind.py CfiUnwinder on made-up stacks and CFI rules (no process, no files), and the CFA
programs of introspect/elf_cfi.EhFrame that GCC's stack realignment emits."""

from __future__ import annotations

import struct

from stacklens.bpf.unwind import REGS_BYTES, CfiUnwinder
from stacklens.introspect.elf_cfi import EhFrame, CfiRule
from stacklens.introspect.procfs import Mapping

LIB = Mapping(0x1000_0000, 0x2000_0000, "r-xp", 0, 1, "/lib/libfake.so")
SP = 0x7FFF_0000
RSP, RBP, RBX, RA = 7, 6, 3, 16
# struct pt_regs word indices (r15 r14 r13 r12 bp bx r11 r10 r9 r8 ax cx dx si di orig_ax ip cs flags sp ss)
PT_BP, PT_BX, PT_IP, PT_SP = 4, 5, 16, 19


def rule(cfa_reg, cfa_off, saved=((RA, -8),), start=0, **kw) -> CfiRule:
    return CfiRule(cfa_reg, cfa_off, tuple(saved), False, start, **kw)


OUTERMOST = CfiRule(RSP, 8, (), True)


class _Elf:
    def offset_to_vaddr(self, off: int) -> int:
        return off


class _Eh:
    """Rules by link-time address range: [(start, end, rule)]."""

    def __init__(self, ranges):
        self.ranges = ranges

    def rule(self, v: int):
        return next((r for s, e, r in self.ranges if s <= v < e), None)


def unwinder(ranges) -> CfiUnwinder:
    find = lambda a: LIB if LIB.start <= a < LIB.end else None  # noqa: E731
    u = CfiUnwinder(find, lambda p: p)
    eh = (_Elf(), _Eh(ranges))
    u._ehframe = lambda path: eh
    return u


def regs(ip: int, sp: int = SP, bp: int = 0, bx: int = 0, stack_len: int = 0) -> bytes:
    w = [0] * 22
    w[PT_IP], w[PT_SP], w[PT_BP], w[PT_BX], w[21] = ip, sp, bp, bx, stack_len
    raw = struct.pack("<22Q", *w)
    assert len(raw) == REGS_BYTES
    return raw


def stack(*words: int) -> bytes:
    return struct.pack(f"<{len(words)}Q", *words)


A = LIB.start  # file offset 0 = link-time address 0 (see _Elf)


def test_walks_cfa_rules_to_the_outermost_frame():
    # leaf f (CFA = rsp + 16, rbp saved at CFA - 16) -> g (CFA = rbp + 16) -> _start (outermost)
    u = unwinder([(0x100, 0x200, rule(RSP, 16, ((RBP, -16), (RA, -8)))),
                  (0x200, 0x300, rule(RBP, 16, ((RBP, -16), (RA, -8)))),
                  (0x300, 0x400, OUTERMOST)])
    g_bp = SP + 32
    st = stack(g_bp, A + 0x250,      # f's frame: saved rbp, return into g
               0, 0,                 # g's locals
               0, A + 0x350)         # g's frame at rbp: saved rbp, return into _start
    addrs, complete = u.unwind(regs(A + 0x180, stack_len=len(st)), st)
    assert addrs == [A + 0x180, A + 0x250, A + 0x350]
    assert complete
    assert u.counts["cfi_frames"] == 2 and u.counts["reached_end"] == 1


def test_a_sample_in_an_entry_uprobes_trap_takes_the_return_address_at_sp():
    # pc one past the function's first byte (the int3): its CFI row already counts a 1-byte push
    # the trap kept from happening; the return address is at sp
    u = unwinder([(0x100, 0x200, rule(RSP, 16, ((RBP, -16), (RA, -8)), start=0x100)),
                  (0x200, 0x300, OUTERMOST)])
    st = stack(A + 0x250, 0x1234)
    addrs, complete = u.unwind(regs(A + 0x101, stack_len=len(st)), st)
    assert addrs == [A + 0x101, A + 0x250] and complete
    assert u.counts["at_breakpoint"] == 1


def test_after_a_real_push_at_entry_the_cfi_row_stays():
    u = unwinder([(0x100, 0x200, rule(RSP, 16, ((RBP, -16), (RA, -8)), start=0x100)),
                  (0x200, 0x300, OUTERMOST)])
    st = stack(SP + 0x40, A + 0x250)     # pushed rbp (a stack address, no code), return address
    addrs, complete = u.unwind(regs(A + 0x101, stack_len=len(st)), st)
    assert addrs == [A + 0x101, A + 0x250] and complete
    assert u.counts["at_breakpoint"] == 0


def test_a_sample_on_an_entry_whose_push_the_kernel_emulated_takes_the_return_address_above_it():
    u = unwinder([(0x100, 0x200, rule(RSP, 8, start=0x100)), (0x200, 0x300, OUTERMOST)])
    st = stack(SP + 0x40, A + 0x250)     # pushed rbp, return address
    addrs, complete = u.unwind(regs(A + 0x100, stack_len=len(st)), st)
    assert addrs == [A + 0x100, A + 0x250] and complete
    assert u.counts["at_breakpoint"] == 1
    st = stack(A + 0x250, A + 0x260)     # a plain sample on the first byte: the CFI row
    assert unwinder([(0x100, 0x200, rule(RSP, 8, start=0x100)), (0x200, 0x300, OUTERMOST)]).unwind(
        regs(A + 0x100, stack_len=len(st)), st) == ([A + 0x100, A + 0x250], True)


def test_gcc_stack_realignment_cfa_is_read_from_rbp_minus_8():
    # CFA = *(rbp - 8); rbp saved at *(rbp + 0), rbx at rbp - 24 (DW_CFA_expression)
    u = unwinder([(0x100, 0x200, rule(RBP, -8, ((RA, -8),), cfa_deref=True,
                                      saved_at=((RBP, RBP, 0), (RBX, RBP, -24)))),
                  (0x200, 0x300, rule(RBP, 16, ((RBP, -16), (RA, -8)))),
                  (0x300, 0x400, OUTERMOST)])
    bp = SP + 32
    cfa = SP + 64
    caller_bp = SP + 80
    st = stack(0, 0x77,               # SP: locals; SP + 8: rbx saved at rbp - 24
               0, cfa,                # SP + 24 = rbp - 8: the CFA
               caller_bp, 0,          # rbp: saved rbp; the copy of the return address
               0, A + 0x250,          # CFA - 16, CFA - 8: return into g
               0, 0,                  # g's locals
               0, A + 0x350)          # caller_bp: saved rbp, return into _start
    addrs, complete = u.unwind(regs(A + 0x180, bp=bp, stack_len=len(st)), st)
    assert addrs == [A + 0x180, A + 0x250, A + 0x350] and complete


def test_a_save_slot_below_sp_means_the_register_was_popped_already():
    # f in its epilogue: CFA = rsp + 8, the CFI still says rbp at CFA - 16 (below sp): rbp holds
    # the caller's value, and g's CFA is rbp-based
    u = unwinder([(0x100, 0x200, rule(RSP, 8, ((RBP, -16), (RA, -8)))),
                  (0x200, 0x300, rule(RBP, 16, ((RBP, -16), (RA, -8)))),
                  (0x300, 0x400, OUTERMOST)])
    g_bp = SP + 16
    st = stack(A + 0x250, 0, 0, A + 0x350)
    addrs, complete = u.unwind(regs(A + 0x180, bp=g_bp, stack_len=len(st)), st)
    assert addrs == [A + 0x180, A + 0x250, A + 0x350] and complete


def test_a_leaf_without_cfi_is_walked_by_a_scan_for_its_return_address():
    u = unwinder([(0x200, 0x300, OUTERMOST)])
    st = stack(7, SP + 0x1000, A + 0x250)
    addrs, complete = u.unwind(regs(A + 0x180, stack_len=len(st)), st)
    assert addrs == [A + 0x180, A + 0x250] and complete
    assert u.counts["leaf_scans"] == 1


def test_a_leaf_whose_frame_outgrows_the_scan_is_walked_from_its_saved_base():
    # MKL's AVX-512 sgemm kernel: `sub $0x40,%rsp; (saves); mov %rsp,%rbp; sub N,%rsp;
    # and $-4096,%rsp; mov %rbp,0x78(%rsp)`: its return address is at the saved base + 0x40,
    # tens of KiB above sp, with the packing buffer (no code addresses) in between
    u = unwinder([(0x200, 0x300, OUTERMOST)])
    base_i = 2048                                      # the base 16 KiB above sp
    words = [0] * (base_i + 16)
    words[0x78 // 8] = SP + 8 * base_i                 # the saved base, in the leaf's first words
    words[base_i + 0x40 // 8] = A + 0x250              # the return address, above the saved registers
    st = stack(*words)
    addrs, complete = u.unwind(regs(A + 0x180, stack_len=len(st)), st)
    assert addrs == [A + 0x180, A + 0x250] and complete
    assert u.counts["leaf_scans"] == 1


def test_a_leaf_with_no_return_address_near_sp_or_its_bases_is_cut():
    u = unwinder([(0x200, 0x300, OUTERMOST)])
    words = [0] * 2100
    words[0x78 // 8] = SP + 8 * 1024                   # a pointer into the stack, nothing code near it
    words[2000] = A + 0x250                            # code, but far from every base: not taken
    st = stack(*words)
    addrs, complete = u.unwind(regs(A + 0x180, stack_len=len(st)), st)
    assert addrs == [A + 0x180] and not complete
    assert u.counts["cut_scan"] == 1


def test_a_walk_that_leaves_the_copy_is_cut():
    u = unwinder([(0x100, 0x200, rule(RSP, 64))])
    st = stack(0, 0)
    addrs, complete = u.unwind(regs(A + 0x180, stack_len=len(st)), st)
    assert addrs == [A + 0x180] and not complete
    assert u.counts["cut_left_copy"] == 1


def test_an_address_outside_every_mapping_cuts_the_walk():
    u = unwinder([(0x100, 0x200, rule(RSP, 8))])
    st = stack(0x42)
    addrs, complete = u.unwind(regs(A + 0x180, stack_len=len(st)), st)
    assert addrs == [A + 0x180, 0x42] and not complete
    assert u.counts["cut_unmapped"] == 1


def _run(program: bytes, target: int) -> list:
    eh = EhFrame.__new__(EhFrame)
    eh._m = program
    state = [RSP, 8, {RA: -8}, False]
    eh._run(0, len(program), 1, -8, 0x1B, 0, target, state, None)
    return state


def test_cfa_programs_of_gcc_stack_realignment():
    # as GCC emits for a function aligning its stack to 32 bytes (torch's AVX2 kernels):
    prog = bytes([0x0C, 13, 0,                # DW_CFA_def_cfa r13 0
                  0x10, 6, 2, 0x76, 0,        # DW_CFA_expression rbp: DW_OP_breg6 0
                  0x0F, 3, 0x76, 0x78, 0x06,  # DW_CFA_def_cfa_expression DW_OP_breg6 -8; DW_OP_deref
                  0x10, 3, 2, 0x76, 0x68])    # DW_CFA_expression rbx: DW_OP_breg6 -24
    cfa_reg, cfa_off, saved, how = _run(prog, 0)
    assert (cfa_reg, cfa_off, how) == (RBP, -8, "deref")
    assert saved == {RA: -8, RBP: (RBP, 0), RBX: (RBP, -24)}


def test_other_cfa_expressions_are_not_followed():
    prog = bytes([0x0F, 3, 0x76, 0x78, 0x23])   # DW_OP_breg6 -8; DW_OP_plus_uconst (no operand: unknown)
    assert _run(prog, 0)[3] is None


def test_the_cfi_walk_is_opt_in(monkeypatch):
    from stacklens.bpf.attach import ProbeConfig

    monkeypatch.delenv("STACKLENS_NATIVE_UNWIND", raising=False)
    assert not ProbeConfig().cfi_unwind
    monkeypatch.setenv("STACKLENS_NATIVE_UNWIND", "cfi")
    assert ProbeConfig().cfi_unwind
    monkeypatch.setenv("STACKLENS_NATIVE_UNWIND", "fp")
    assert not ProbeConfig().cfi_unwind


def test_a_saved_base_guess_that_ends_in_garbage_is_dropped():
    # the base's neighbour returns into code with CFI, but that frame's CFA leads to a word in
    # no mapping: a stale frame, not the leaf's caller; the leaf alone is kept, cut
    u = unwinder([(0x200, 0x300, rule(RSP, 16))])
    base_i = 2048
    words = [0] * (base_i + 16)
    words[0x78 // 8] = SP + 8 * base_i
    words[base_i + 8] = A + 0x250
    words[base_i + 10] = 0x5000                        # "returns" into no mapping
    st = stack(*words)
    addrs, complete = u.unwind(regs(A + 0x180, stack_len=len(st)), st)
    assert addrs == [A + 0x180] and not complete
    assert u.counts["base_scans"] == 1 and u.counts["base_scans_dropped"] == 1
