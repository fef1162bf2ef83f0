"""Configuration: YAML recipes with `defaults:` inheritance, command-line overrides,
`${...}` interpolation and pydantic validation with readable errors."""

from rl_core.config.errors import ConfigError
from rl_core.config.interpolation import resolve_interpolations
from rl_core.config.loader import (
    LoadedConfig,
    deep_merge,
    load_config,
    load_config_with_origins,
    load_validated_config,
    save_config,
)
from rl_core.config.overrides import Override, apply_overrides, parse_override
from rl_core.config.plain import to_plain
from rl_core.config.validation import RLConfig, config_to_dict, validate_config

__all__ = [
    "ConfigError",
    "LoadedConfig",
    "Override",
    "RLConfig",
    "apply_overrides",
    "config_to_dict",
    "deep_merge",
    "load_config",
    "load_config_with_origins",
    "load_validated_config",
    "parse_override",
    "resolve_interpolations",
    "save_config",
    "to_plain",
    "validate_config",
]
