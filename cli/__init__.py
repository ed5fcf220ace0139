"""stacklens.cli: the `stacklens` commands (`main.py`: the parser and the exit codes).

The one package that joins the daemon's parts and the TUI; nothing else imports it (import-linter
contract). `profile`, `record` and `demo` attach probes themselves (root, or CAP_BPF +
CAP_PERFMON + CAP_SYS_PTRACE); the other commands read files or talk to `stacklensd`.
"""
