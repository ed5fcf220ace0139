"""stacklens.tui."""
