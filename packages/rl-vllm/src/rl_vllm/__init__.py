"""vLLM generation workers (sync and async engines) with weight refit for rl."""

__version__ = "0.1.0"
