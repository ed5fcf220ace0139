"""stacklens.daemon."""
