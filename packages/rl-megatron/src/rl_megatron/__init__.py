"""Megatron-Core policy worker and HF <-> Megatron weight conversion for rl."""

__version__ = "0.1.0"
