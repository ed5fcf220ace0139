"""stacklens.analyzer."""
