"""Target: maps a file named libcuda.so.1 (argv[1]: a copy of any ELF library), so discovery lists
it as a GPU process (`stacklens ps` shows it "not attached"). Prints `ready`, waits for a line on
stdin, exits."""

import mmap
import sys

with open(sys.argv[1], "rb") as f:
    m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
print("ready", flush=True)
sys.stdin.readline()
m.close()
