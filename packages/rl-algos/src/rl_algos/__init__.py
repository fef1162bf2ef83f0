"""Losses, advantages and training loops (GRPO/DAPO/GSPO, SFT, DPO, RM, distillation, eval) and the `rl` command."""

__version__ = "0.1.0"
