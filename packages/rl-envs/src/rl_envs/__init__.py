"""Environments for rl: math verification, sandboxed code, reward model, multi-turn games and tools."""

__version__ = "0.1.0"
