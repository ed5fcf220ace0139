"""stacklens.inject.agent."""
