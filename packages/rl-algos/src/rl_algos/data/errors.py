"""The error type of the data layer."""

from __future__ import annotations

from rl_core.config.errors import ConfigError


class DataError(ConfigError):
    """Bad input data: a missing file, a malformed line, a missing column, an unusable template.

    A subclass of `ConfigError` because it is found, like a bad config key, while a run is being
    set up and must stop it before any training. The message names the file, line, record,
    column or message at fault.
    """
