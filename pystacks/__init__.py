"""Reading a running CPython from outside: its interpreter, its threads and their Python stacks,
from the target's memory, with no BPF, no agent and no daemon.

- `python_process`: find the interpreter (`find_interpreter`), walk its threads, calibrate the TSS
  slot BPF reads the current thread's state from; `PythonStackReader`, what pystack.h needs;
- `pysym`: code object -> file, qualname, line (`PySymbolizer`), for stacks BPF recorded and
  stacks read here alike;
- `dump`: every thread's Python stack now (`stacklens dump`), read twice until it agrees.

Requires root (or CAP_SYS_PTRACE) to read /proc/PID/mem; the target is never stopped. Stands on
introspect/ (every read goes through `ProcessMemory` and `ProcFS`), cct (frames), errors and
textsafe; bpf/, daemon/ and cli/ stand on it, it imports none of them (import-linter contracts).
Importing this package imports none of its modules: each is imported where it is used.
"""
