"""Typed configs: the `RLConfig` base model and pydantic errors turned into readable ones."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Self, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import ErrorDetails

from rl_core.config.errors import ConfigError, dotted, suggestion
from rl_core.config.plain import to_plain
from rl_core.config.schema import (
    describe_type,
    is_model,
    item_type,
    schema_children,
    strip_annotated,
    union_members,
    value_type,
)

M = TypeVar("M", bound=BaseModel)


class RLConfig(BaseModel):
    """Base class of every typed config section: unknown keys are errors, assignments are
    validated, and field names may start with `model_` (e.g. `model_name`)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: Sequence[str] = ()) -> Self:
        """Load a recipe (with `defaults:` and overrides) and validate it as this model."""
        from rl_core.config.loader import load_validated_config

        return load_validated_config(path, cls, overrides)

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)


def config_to_dict(model: BaseModel) -> dict[str, Any]:
    """The model as plain YAML-ready data (paths as strings, tuples as lists, inf kept)."""
    return to_plain(model)  # type: ignore[no-any-return]


def validate_config(
    cfg: Mapping[str, Any],
    model: type[M],
    source: str | None = None,
    origins: Mapping[str, str] | None = None,
) -> M:
    """Validate `cfg` as `model`; every problem is listed in one `ConfigError`.

    `source` (e.g. the recipe path) heads the message; `origins` maps dotted keys to where
    they were set (`file.yaml:12`, an override) and is appended to each problem it covers.
    """
    try:
        return model.model_validate(cfg)
    except ValidationError as exc:
        problems = describe_validation_errors(exc, model, origins or {})
    where = f" in {source}" if source else ""
    count = f"{len(problems)} problem{'s' if len(problems) != 1 else ''}"
    raise ConfigError(f"invalid config{where} ({count}):\n" + "\n".join(f"  - {p}" for p in problems))


# pydantic error types that mean "the value has the wrong type" (reported with the expected type).
_TYPE_ERROR_SUFFIXES = ("_type", "_parsing", "_from_float")
_TYPE_ERRORS = {"literal_error", "enum", "none_required", "int_from_float", "bool_parsing"}


def describe_validation_errors(
    exc: ValidationError, model: type[BaseModel], origins: Mapping[str, str]
) -> list[str]:
    problems: list[str] = []
    reported_type_errors: set[str] = set()
    for error in exc.errors():
        location = _locate(model, error["loc"])
        key = dotted(location.parts) or "(top level)"
        where = f" [{origins[key]}]" if key in origins else ""
        kind = error["type"]
        if kind == "extra_forbidden":
            hint = suggestion(location.parts, len(location.parts) - 1, location.siblings)
            problems.append(f"unknown key '{key}'{hint}{where}")
        elif kind == "missing":
            problems.append(f"missing required key '{key}' ({describe_type(location.annotation)}){where}")
        elif kind in _TYPE_ERRORS or kind.endswith(_TYPE_ERROR_SUFFIXES):
            # A union field yields one error per member; report the field once, with its full type.
            if key in reported_type_errors:
                continue
            reported_type_errors.add(key)
            value = error.get("input")
            problems.append(
                f"{key}: expected {describe_type(location.annotation)}, got {_short_repr(value)} "
                f"({type(value).__name__}){where}"
            )
        else:
            problems.append(f"{key}: {_message(error)} (got {_short_repr(error.get('input'))}){where}")
    return problems


def _message(error: ErrorDetails) -> str:
    msg = error["msg"]
    return msg[0].lower() + msg[1:] if msg else error["type"]


def _short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Location:
    def __init__(self) -> None:
        self.parts: list[str | int] = []
        self.annotation: Any = Any  # the declared type of the field the error is about
        self.siblings: list[str] = []  # valid keys next to the last part (for suggestions)


def _locate(model: type[BaseModel], loc: tuple[str | int, ...]) -> _Location:
    """Map a pydantic error location to the user's dotted key and the field's declared type.

    pydantic inserts the name of the union member it tried (`int`, `GRPOConfig`, ...) into
    locations inside unions; those tags are not keys the user wrote and are dropped.
    """
    location = _Location()
    current: Any = model
    for element in loc:
        members = union_members(current)
        if isinstance(element, int):
            location.parts.append(element)
            current = item_type(current) if item_type(current) is not Any else value_type(current)
            location.annotation = current
            continue
        if len(members) > 1 and any(_type_tag(m) == element for m in members):
            current = next(m for m in members if _type_tag(m) == element)
            continue
        children = schema_children(current)
        location.parts.append(element)
        if children is None:  # free-form mapping: descend into its value type
            current = value_type(current)
        elif element in children:
            current = children[element]
        else:
            location.siblings = sorted(children)
            current = Any
        location.annotation = current
    return location


def _type_tag(tp: Any) -> str:
    tp = strip_annotated(tp)
    if is_model(tp):
        return str(tp.__name__)
    return getattr(tp, "__name__", str(tp))


__all__ = [
    "RLConfig",
    "config_to_dict",
    "describe_validation_errors",
    "validate_config",
]
