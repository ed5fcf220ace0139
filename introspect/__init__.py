"""Target introspection: what stacklens reads about another process, in one layer that bpf/,
inject/ and daemon/ all stand on.

- `procfs`: every read of /proc (maps, stat, status, tasks, the target's root and exe);
- `elf`: the one ELF64 reader (symbols, sections, load bias: `elf_file`; `.eh_frame` CFI: `elf_cfi`);
- `demangle`: the one C++ demangler;
- `memory`: the one remote-memory Protocol (`ProcessMemory`) and its implementations;
- `cpython`: the one CPython locator (`find_python`) and the one `_Py_DebugOffsets` reader.

Imports nothing of bpf/, inject/, daemon/ or tui/ (an import-linter contract). Importing this
package imports none of its modules: each is imported where it is used.
"""
