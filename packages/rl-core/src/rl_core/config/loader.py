"""Reading YAML recipes: `defaults:` inheritance, overrides, interpolation, saving.

Order of application: the `defaults:` files (in list order, recursively), then the file
itself, then command-line overrides, then `${...}` interpolation. Every key remembers where
it was set (`file.yaml:line` or the override) so validation errors can point there.
"""

from __future__ import annotations

import copy
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel

from rl_core.config.errors import ConfigError, dotted
from rl_core.config.interpolation import resolve_interpolations
from rl_core.config.overrides import apply_overrides, parse_override
from rl_core.config.plain import to_plain
from rl_core.config.validation import validate_config
from rl_core.config.yaml_loader import ConfigYamlLoader

M = TypeVar("M", bound=BaseModel)

DEFAULTS_KEY = "defaults"
_MERGE_TAG = "tag:yaml.org,2002:merge"


@dataclass
class LoadedConfig:
    data: dict[str, Any]
    origins: dict[str, str] = field(default_factory=dict)  # dotted key -> "file:line" / override


def load_config(
    path: str | os.PathLike[str],
    overrides: Sequence[str] = (),
    *,
    schema: type[BaseModel] | None = None,
) -> dict[str, Any]:
    """Load a YAML recipe into a plain dict (inheritance, overrides and interpolation applied).

    `schema`, when given, lets a plain `a.b=value` override set a key the YAML omits but the
    model declares; the result is not validated (use `load_validated_config` for that).
    """
    return load_config_with_origins(path, overrides, schema=schema).data


def load_validated_config(path: str | os.PathLike[str], model: type[M], overrides: Sequence[str] = ()) -> M:
    """`load_config` + `validate_config`, with each error pointing at the file line it came from."""
    loaded = load_config_with_origins(path, overrides, schema=model)
    return validate_config(loaded.data, model, source=os.fspath(path), origins=loaded.origins)


def load_config_with_origins(
    path: str | os.PathLike[str],
    overrides: Sequence[str] = (),
    *,
    schema: type[BaseModel] | None = None,
) -> LoadedConfig:
    loaded = _compose(Path(path), chain=(), included_by=None)
    data = apply_overrides(loaded.data, overrides, schema=schema)
    for text in overrides:
        loaded.origins[parse_override(text).dotted_key] = f"override '{text}'"
    return LoadedConfig(resolve_interpolations(data), loaded.origins)


def save_config(cfg: Mapping[str, Any] | BaseModel, path: str | os.PathLike[str]) -> Path:
    """Write `cfg` (interpolations resolved) as YAML, atomically: readers never see half a file."""
    plain = to_plain(cfg)
    if not isinstance(cfg, BaseModel):
        plain = resolve_interpolations(plain)
    text = yaml.safe_dump(plain, sort_keys=False, default_flow_style=False, allow_unicode=True)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(target, text)
    return target


def write_text_atomic(target: Path, text: str) -> None:
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Mappings merge key by key (override wins, `null` included); anything else is replaced."""
    merged: dict[str, Any] = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _compose(path: Path, chain: tuple[Path, ...], included_by: str | None) -> LoadedConfig:
    identity = path.resolve()
    if identity in chain:
        cycle = [*chain[chain.index(identity) :], identity]
        raise ConfigError("circular 'defaults' inclusion: " + " -> ".join(str(p) for p in cycle))
    document = read_yaml_file(path, included_by)
    parents, defaults_line = _pop_defaults(document, path)
    merged: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for entry in parents:
        parent = _compose(_default_path(path, entry), (*chain, identity), f"{path}:{defaults_line}")
        merged = deep_merge(merged, parent.data)
        origins.update(parent.origins)
    origins.update(document.origins)
    return LoadedConfig(deep_merge(merged, document.data), origins)


def _pop_defaults(document: LoadedConfig, path: Path) -> tuple[list[str], int]:
    if DEFAULTS_KEY not in document.data:
        return [], 0
    raw = document.data.pop(DEFAULTS_KEY)
    where = document.origins.pop(DEFAULTS_KEY, str(path))
    line = int(where.rsplit(":", 1)[1]) if ":" in where else 0
    entries = [raw] if isinstance(raw, str) else raw
    if entries is None:
        return [], line
    if not isinstance(entries, list) or not all(isinstance(e, str) and e.strip() for e in entries):
        raise ConfigError(
            f"{where}: 'defaults' must be a file name or a list of file names (relative to "
            f"{path.parent}), got {raw!r}"
        )
    return entries, line


def _default_path(including_file: Path, entry: str) -> Path:
    candidate = including_file.parent / entry
    if not candidate.exists() and candidate.suffix == "":
        return candidate.with_name(candidate.name + ".yaml")
    return candidate


def read_yaml_file(path: Path, included_by: str | None = None) -> LoadedConfig:
    """Parse one YAML file into a mapping plus the line of every key; errors give path:line:col."""
    via = f" (listed in 'defaults' at {included_by})" if included_by else ""
    if not path.is_file():
        reason = "is a directory, not a file" if path.is_dir() else "not found"
        raise ConfigError(f"config file {reason}: {path}{via}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}{via}: {exc}") from None
    loader = ConfigYamlLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return LoadedConfig({})
        origins: dict[str, str] = {}
        _record_key_lines(node, (), path, origins, set())
        data = loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        raise ConfigError(_describe_yaml_error(path, exc) + via) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: malformed YAML: {exc}{via}") from None
    finally:
        loader.dispose()
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}:{node.start_mark.line + 1}: a config file must be a mapping of keys at the top "
            f"level, got a {type(data).__name__}{via}"
        )
    return LoadedConfig(data, origins)


def _record_key_lines(
    node: yaml.Node, prefix: tuple[str, ...], path: Path, origins: dict[str, str], active: set[int]
) -> None:
    if id(node) in active:  # a recursive anchor; its keys are recorded where first seen
        return
    active.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first_line: dict[str, int] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == _MERGE_TAG:
                continue
            key, line = str(key_node.value), key_node.start_mark.line + 1
            if key in first_line:
                # PyYAML silently keeps the last duplicate; in a recipe that is almost always a mistake.
                raise ConfigError(
                    f"{path}:{line}: duplicate key '{dotted((*prefix, key))}' "
                    f"(first defined on line {first_line[key]})"
                )
            first_line[key] = line
            origins[dotted((*prefix, key))] = f"{path}:{line}"
            _record_key_lines(value_node, (*prefix, key), path, origins, active)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _record_key_lines(item, (*prefix, str(index)), path, origins, active)
    active.discard(id(node))


def _describe_yaml_error(path: Path, exc: yaml.MarkedYAMLError) -> str:
    mark = exc.problem_mark or exc.context_mark
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
    problem = exc.problem or exc.context or "invalid YAML"
    message = f"{where}: malformed YAML: {problem}"
    if exc.problem and exc.context:
        context_line = f" on line {exc.context_mark.line + 1}" if exc.context_mark else ""
        message += f" ({exc.context}{context_line})"
    snippet = mark.get_snippet() if mark else None
    return f"{message}\n{snippet}" if snippet else message
