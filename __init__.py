"""stacklens: attach-by-PID whole-stack profiler for deep-learning processes."""

__version__ = "0.1.0"
