"""`${a.b.c}` references and `${env:VAR}` / `${env:VAR,default}` environment lookups.

A string that is exactly one reference takes the referenced value with its type (an int
stays an int, a mapping is copied); references embedded in longer strings are substituted
as text. Environment values are always strings (pydantic converts them for typed fields).
A backslash escapes a reference: `\\${x}` stays the literal text `${x}`.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Mapping
from typing import Any

from rl_core.config.errors import ConfigError, dotted, suggestion

# Group 1: escaping backslash; group 2: the reference body; group 3: an unterminated "${".
_TOKEN_RE = re.compile(r"(\\)?\$\{([^{}]*)\}|(\$\{)")
_WHOLE_RE = re.compile(r"^\$\{([^{}]*)\}$")
_ENV_PREFIX = "env:"


def resolve_interpolations(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Return a copy of `cfg` with every reference resolved (errors name the holding key)."""
    return _Resolver(cfg).resolve_node(dict(cfg), ())  # type: ignore[no-any-return]


class _Resolver:
    def __init__(self, root: Mapping[str, Any]) -> None:
        self._root = root
        self._in_progress: list[str] = []  # keys being resolved, outermost first (cycle check)
        self._done: dict[str, Any] = {}

    def resolve_node(self, node: Any, key: tuple[str, ...]) -> Any:
        if isinstance(node, Mapping):
            return {k: self.resolve_node(v, (*key, str(k))) for k, v in node.items()}
        if isinstance(node, list):
            return [self.resolve_node(v, (*key, str(i))) for i, v in enumerate(node)]
        if isinstance(node, str) and "${" in node:
            return self._resolve_string(node, key)
        return node

    def _resolve_string(self, text: str, key: tuple[str, ...]) -> Any:
        name = dotted(key)
        if name in self._done:
            return copy.deepcopy(self._done[name])
        if name in self._in_progress:
            chain = [*self._in_progress[self._in_progress.index(name) :], name]
            raise ConfigError(f"interpolation cycle: {' -> '.join(chain)}")
        self._in_progress.append(name)
        try:
            whole = _WHOLE_RE.match(text)
            if whole is not None:
                value = self._lookup(whole[1], name, text)
            else:
                value = _TOKEN_RE.sub(lambda m: self._substitute(m, name, text), text)
        finally:
            self._in_progress.pop()
        self._done[name] = value
        return copy.deepcopy(value)

    def _substitute(self, match: re.Match[str], holder: str, text: str) -> str:
        if match[3] is not None:
            raise ConfigError(f"config key '{holder}': unterminated '${{' in {text!r}")
        if match[1] is not None:
            return "${" + match[2] + "}"
        value = self._lookup(match[2], holder, text)
        if isinstance(value, Mapping | list):
            raise ConfigError(
                f"config key '{holder}': '${{{match[2]}}}' is a {type(value).__name__} and cannot be "
                f"embedded in the string {text!r} (make the reference the whole value instead)"
            )
        if isinstance(value, bool):
            return "true" if value else "false"
        return "null" if value is None else str(value)

    def _lookup(self, body: str, holder: str, text: str) -> Any:
        body = body.strip()
        if body.startswith(_ENV_PREFIX):
            return _lookup_env(body[len(_ENV_PREFIX) :], holder)
        if not body:
            raise ConfigError(f"config key '{holder}': empty reference '${{}}' in {text!r}")
        target = tuple(body.split("."))
        node: Any = self._root
        for depth, segment in enumerate(target):
            if isinstance(node, Mapping) and segment in node:
                node = node[segment]
            elif isinstance(node, list) and segment.isdigit() and int(segment) < len(node):
                node = node[int(segment)]
            else:
                candidates = [str(k) for k in node] if isinstance(node, Mapping) else []
                hint = suggestion(target, depth, candidates)
                raise ConfigError(
                    f"config key '{holder}' refers to '${{{body}}}', but '{dotted(target[: depth + 1])}' "
                    f"does not exist{hint}"
                )
        return self.resolve_node(node, target)


def _lookup_env(spec: str, holder: str) -> str:
    name, has_default, default = spec.partition(",")
    name = name.strip()
    if not name:
        raise ConfigError(f"config key '{holder}': '${{env:}}' needs a variable name")
    value = os.environ.get(name)
    if value is not None:
        return value
    if has_default:
        return default.strip()
    raise ConfigError(
        f"config key '{holder}' refers to environment variable '{name}', which is not set "
        f"(set it, or give a default: '${{env:{name},<default>}}')"
    )
