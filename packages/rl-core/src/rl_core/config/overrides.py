"""Command-line overrides: `a.b=value` (replace), `+a.b=value` (add), `++a.b=value` (add or
replace), `~a.b` (delete). Values are parsed as YAML, so `8`, `1.5e-3`, `true`, `null`,
`[1,2]` and `{k: v}` get their natural types and anything else stays a string.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import yaml
from pydantic import BaseModel

from rl_core.config.errors import ConfigError, dotted, suggestion
from rl_core.config.schema import schema_children
from rl_core.config.yaml_loader import ConfigYamlLoader


class OverrideKind(Enum):
    REPLACE = ""  # the key must exist (in the config or, if given, the schema)
    ADD = "+"  # the key must not exist yet
    FORCE = "++"  # add or replace, creating missing sections
    DELETE = "~"


@dataclass(frozen=True)
class Override:
    kind: OverrideKind
    key: tuple[str, ...]
    value: Any
    text: str

    @property
    def dotted_key(self) -> str:
        return dotted(self.key)


_SEGMENT = r"[A-Za-z0-9_\-/]+"
_OVERRIDE_RE = re.compile(
    rf"^(?P<prefix>\+\+|\+|~)?(?P<key>{_SEGMENT}(?:\.{_SEGMENT})*)(?:(?P<eq>=)(?P<value>.*))?$", re.DOTALL
)
_SYNTAX_HELP = "expected 'key.path=value', '+key.path=value', '++key.path=value' or '~key.path'"


def parse_override(text: str) -> Override:
    """Parse one override string; malformed syntax is a `ConfigError` quoting it."""
    match = _OVERRIDE_RE.match(text)
    if match is None:
        raise ConfigError(f"malformed override '{text}': {_SYNTAX_HELP}")
    kind = OverrideKind(match["prefix"] or "")
    key = tuple(match["key"].split("."))
    if kind is OverrideKind.DELETE:
        if match["eq"] is not None:
            raise ConfigError(
                f"malformed override '{text}': a deletion takes no value; use '~{match['key']}'"
            )
        return Override(kind, key, None, text)
    if match["eq"] is None:
        raise ConfigError(f"malformed override '{text}': missing '=value'; {_SYNTAX_HELP}")
    return Override(kind, key, _parse_value(match["value"], text), text)


def _parse_value(raw: str, text: str) -> Any:
    if raw == "":
        return ""  # `key=` means the empty string, not null (write `key=null` for that)
    try:
        return yaml.load(raw, Loader=ConfigYamlLoader)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"malformed override '{text}': the value is not valid YAML ({problem})") from None


def apply_overrides(
    cfg: Mapping[str, Any], overrides: Sequence[str], schema: type[BaseModel] | None = None
) -> dict[str, Any]:
    """Return a copy of `cfg` with the overrides applied in order.

    A plain `a.b=value` may only replace a key that exists in `cfg`, or one that `schema`
    declares (a typed field left at its default in the YAML). Unknown keys are errors that
    name the full dotted key and suggest the closest valid one.
    """
    if isinstance(overrides, str):
        raise TypeError("overrides must be a sequence of strings, not a single string")
    result: dict[str, Any] = copy.deepcopy(dict(cfg))
    for text in overrides:
        _apply_one(result, parse_override(text), schema)
    return result


def _apply_one(cfg: dict[str, Any], override: Override, schema: type[BaseModel] | None) -> None:
    key = override.key
    container: Any = cfg
    for depth, segment in enumerate(key[:-1]):
        child = _get_child(container, segment)
        if isinstance(child, dict | list):
            container = child
            continue
        if child is not _MISSING and child is not None:
            raise ConfigError(
                f"cannot apply override '{override.text}': '{dotted(key[: depth + 1])}' holds "
                f"{child!r} ({type(child).__name__}), not a mapping"
            )
        # The section is absent (or null): only creatable if the override or schema allows it.
        creatable = override.kind in (OverrideKind.ADD, OverrideKind.FORCE) or (
            override.kind is OverrideKind.REPLACE and _schema_declares(schema, key[: depth + 1])
        )
        if not creatable:
            raise _unknown_key_error(override, cfg, schema, depth)
        if not isinstance(container, dict):
            raise ConfigError(f"cannot apply override '{override.text}': cannot add a key to a list")
        container[segment] = {}
        container = container[segment]

    last = key[-1]
    current = _get_child(container, last)
    exists = current is not _MISSING
    if isinstance(container, list) and not exists:
        raise ConfigError(
            f"cannot apply override '{override.text}': index {last} is out of range for "
            f"'{dotted(key[:-1])}' (length {len(container)})"
        )
    if override.kind is OverrideKind.DELETE:
        if not exists:
            raise _unknown_key_error(override, cfg, schema, len(key) - 1)
        if isinstance(container, list):
            del container[int(last)]
        else:
            del container[last]
        return
    if override.kind is OverrideKind.ADD and exists:
        flag = f"{override.dotted_key}={override.text.split('=', 1)[1]}"
        raise ConfigError(
            f"cannot apply override '{override.text}': key '{override.dotted_key}' already exists "
            f"(value {current!r}); use '{flag}' to replace it or '++{flag}' to add-or-replace"
        )
    if override.kind is OverrideKind.REPLACE and not exists and not _schema_declares(schema, key):
        raise _unknown_key_error(override, cfg, schema, len(key) - 1)
    if isinstance(container, list):
        container[int(last)] = override.value
    else:
        container[last] = override.value


class _Missing:
    pass


_MISSING: Any = _Missing()


def _get_child(container: Any, segment: str) -> Any:
    if isinstance(container, dict):
        return container.get(segment, _MISSING)
    if isinstance(container, list) and segment.isdigit() and int(segment) < len(container):
        return container[int(segment)]
    return _MISSING


def _schema_declares(schema: type[BaseModel] | None, key: Sequence[str]) -> bool:
    if schema is None:
        return False
    node: Any = schema
    for segment in key:
        children = schema_children(node)
        if children is None:  # free-form mapping or Any: every key is allowed below here
            return True
        if segment not in children:
            return False
        node = children[segment]
    return True


def _unknown_key_error(
    override: Override, cfg: Mapping[str, Any], schema: type[BaseModel] | None, depth: int
) -> ConfigError:
    """`unknown config key 'a.b' (did you mean 'a.c'?)`; candidates come from cfg and schema."""
    key = override.key
    candidates: set[str] = set()
    container: Any = cfg
    for segment in key[:depth]:
        container = _get_child(container, segment)
    if isinstance(container, dict):
        candidates.update(str(k) for k in container)
    if schema is not None:
        node: Any = schema
        for segment in key[:depth]:
            children = schema_children(node)
            node = children.get(segment) if children else None
        children = schema_children(node) if node is not None else None
        if children:
            candidates.update(children)
    hint = suggestion(key, depth, candidates)
    add_hint = ""
    if not hint and override.kind is OverrideKind.REPLACE:
        add_hint = f"; to add a new key write '++{override.text}'"
    return ConfigError(
        f"unknown config key '{override.dotted_key}'{hint} in override '{override.text}'{add_hint}"
    )
