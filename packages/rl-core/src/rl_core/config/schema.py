"""Walking a pydantic model's field annotations by key, for override checks and error texts."""

from __future__ import annotations

import enum
import inspect
import types
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel


def strip_annotated(tp: Any) -> Any:
    while get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    return tp


def union_members(tp: Any) -> list[Any]:
    """Members of a Union/Optional without NoneType; `[tp]` for anything else."""
    tp = strip_annotated(tp)
    if get_origin(tp) in (Union, types.UnionType):
        return [strip_annotated(m) for m in get_args(tp) if m is not type(None)]
    return [tp]


def is_model(tp: Any) -> bool:
    return inspect.isclass(tp) and issubclass(tp, BaseModel)


def model_fields_by_key(model: type[BaseModel]) -> dict[str, Any]:
    """Field annotations keyed by field name and by alias (what a YAML file may spell)."""
    fields: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        fields[name] = info.annotation
        if info.alias:
            fields[info.alias] = info.annotation
    return fields


def is_mapping_type(tp: Any) -> bool:
    origin = get_origin(tp) or tp
    return inspect.isclass(origin) and issubclass(origin, Mapping)


def schema_children(tp: Any) -> dict[str, Any] | None:
    """The keys allowed directly below a node of type `tp`, with their annotations.

    None means "anything goes" (a free-form mapping or `Any`); an empty dict means the node
    is a scalar or list and has no named children.
    """
    children: dict[str, Any] = {}
    for member in union_members(tp):
        if member is Any or is_mapping_type(member):
            return None
        if is_model(member):
            children.update(model_fields_by_key(member))
    return children


def item_type(tp: Any) -> Any:
    """Element type of a list/tuple/sequence annotation (Any when unknown)."""
    for member in union_members(tp):
        origin = get_origin(member) or member
        if inspect.isclass(origin) and issubclass(origin, Sequence) and origin is not str:
            args = [a for a in get_args(member) if a is not Ellipsis]
            return args[0] if args else Any
    return Any


def value_type(tp: Any) -> Any:
    """Value type of a mapping annotation (Any when unknown)."""
    for member in union_members(tp):
        if is_mapping_type(member):
            args = get_args(member)
            return args[1] if len(args) == 2 else Any
    return Any


def describe_type(tp: Any) -> str:
    """A short human name for an annotation: `int`, `float | None`, `one of 'a', 'b'`."""
    tp = strip_annotated(tp)
    if tp is type(None):
        return "None"
    if tp is Any:
        return "any value"
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return " | ".join(describe_type(m) for m in get_args(tp))
    if origin is Literal:
        return "one of " + ", ".join(repr(v) for v in get_args(tp))
    if inspect.isclass(tp) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in tp)
    if is_model(tp):
        return f"a mapping ({tp.__name__})"
    if origin is not None:
        return str(tp).replace("typing.", "").replace("collections.abc.", "")
    if inspect.isclass(tp):
        return tp.__name__
    return str(tp)
