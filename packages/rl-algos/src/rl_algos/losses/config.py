"""Building a loss's typed config from a model instance or a plain mapping (e.g. a YAML section)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel

from rl_core.config import validate_config

C = TypeVar("C", bound=BaseModel)


def coerce_config(cfg: C | Mapping[str, Any] | None, model: type[C]) -> C:
    """`cfg` itself if it already is a `model`; a mapping is validated (errors name the key)."""
    if cfg is None:
        return model()
    if isinstance(cfg, model):
        return cfg
    if isinstance(cfg, Mapping):
        return validate_config(cfg, model, source=model.__name__)
    raise TypeError(f"expected a {model.__name__} or a mapping of its fields, got {type(cfg).__name__}")
