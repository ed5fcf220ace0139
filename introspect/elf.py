"""The ELF64 reader of stacklens, one module per concern; callers take its names from here.

- introspect/elf_file.py: `ElfFile` (program headers, sections, .dynsym/.symtab, address <-> file
  offset, load bias), `SymbolTable` (address -> function), `symbol_offsets` (name -> file offset,
  read once per version of a file), `file_identity`;
- introspect/elf_cfi.py: `EhFrame` and `CfiRule`, the call frame information of `.eh_frame` (how to
  find a caller's frame without frame pointers), read over an `ElfFile`.

Used by the BPF side (probe offsets, op discovery, native symbolization and unwinding, the
Python-stack reader) and by the injector (finding `_PyRuntime` in a target), so it lives in
introspect/: stdlib and `stacklens.errors` only. Pure file parsing, no privileges; what a file costs
and which errors it raises are told in elf_file.py.
"""

from stacklens.introspect.elf_cfi import CFA_PLT, DW_RA, DW_RBP, DW_RSP, CfiRule, EhFrame
from stacklens.introspect.elf_file import (
    ET_EXEC, PT_LOAD, SHT_DYNSYM, SHT_SYMTAB, STT_FUNC, STT_GNU_IFUNC, ElfFile, Section, Segment, Symbol,
    SymbolTable, file_identity, symbol_offsets)

__all__ = [
    "CFA_PLT", "DW_RA", "DW_RBP", "DW_RSP", "ET_EXEC", "PT_LOAD", "SHT_DYNSYM", "SHT_SYMTAB", "STT_FUNC",
    "STT_GNU_IFUNC", "CfiRule", "EhFrame", "ElfFile", "Section", "Segment", "Symbol", "SymbolTable",
    "file_identity", "symbol_offsets",
]
