"""PyTorch DTensor/FSDP2 policy worker and Hugging Face generation backend for rl."""

__version__ = "0.1.0"
