"""Protocols and plumbing for rl: BatchedDataDict, NamedSharding, Ray virtual cluster and worker groups, isolated worker venvs, config, logging, checkpoints."""

__version__ = "0.1.0"
