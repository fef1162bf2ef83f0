"""Conversion of configs and metadata to plain YAML/JSON-friendly Python values."""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from rl_core.config.errors import ConfigError


def to_plain(value: Any, key: str = "") -> Any:
    """Recursively turn models, paths, enums, tuples, numpy/torch scalars into plain values.

    Mappings keep their key order; arrays and multi-element tensors become (nested) lists.
    Anything else that YAML/JSON cannot represent is an error naming the key.
    """
    if isinstance(value, BaseModel):
        # mode="python" keeps inf/nan floats (mode="json" would turn them into None).
        return to_plain(value.model_dump(mode="python"), key)
    if isinstance(value, enum.Enum):  # before str: a StrEnum member is a str too
        return to_plain(value.value, key)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        return {k: to_plain(v, f"{key}.{k}" if key else str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        items = sorted(value, key=repr) if isinstance(value, set | frozenset) else value
        return [to_plain(v, f"{key}.{i}" if key else str(i)) for i, v in enumerate(items)]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    # numpy scalars/arrays and torch tensors, without importing either library.
    if hasattr(value, "tolist") and callable(value.tolist):
        return to_plain(value.tolist(), key)
    where = f" at key '{key}'" if key else ""
    raise ConfigError(f"cannot store a value of type {type(value).__name__}{where}: {value!r:.80}")
