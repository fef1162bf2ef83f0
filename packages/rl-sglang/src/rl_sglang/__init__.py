"""SGLang generation workers for rl (GPU only)."""

__version__ = "0.1.0"
