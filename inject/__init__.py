"""stacklens.inject."""
