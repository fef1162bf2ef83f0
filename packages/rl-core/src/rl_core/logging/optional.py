"""Lazy imports of the optional logging extras, with an install hint when one is missing."""

from __future__ import annotations

import importlib
from types import ModuleType


def import_optional(module: str, extra: str, feature: str) -> ModuleType:
    """Import `module`, or raise ImportError telling the user which rl-core extra provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{feature} needs the optional dependency '{extra}', which is not installed "
            f"(import of '{module}' failed: {exc}). Install it with: pip install \"rl-core[{extra}]\""
        ) from exc
