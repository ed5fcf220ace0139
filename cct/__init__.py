"""stacklens.cct."""
