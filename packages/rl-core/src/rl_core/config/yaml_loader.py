"""The YAML loader used for recipes and override values."""

from __future__ import annotations

import re

import yaml


class ConfigYamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads exponent floats without a dot (`1e-5`, `3E4`) as floats.

    PyYAML follows YAML 1.1, where `lr: 1e-5` is the *string* "1e-5" — a classic surprise in
    training recipes (it reaches an optimizer untyped). YAML 1.2 and every other tool read it
    as a float, so we do too.
    """


ConfigYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)
