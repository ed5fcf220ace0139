"""stacklens.bpf."""
