"""The configuration error type and the "did you mean" helpers shared by loader and validator."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence


class ConfigError(ValueError):
    """A configuration problem; the message names the file, line, key or value at fault."""


def closest_key(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate most similar to `name` (difflib ratio >= 0.6), or None."""
    matches = difflib.get_close_matches(name, sorted(set(candidates)), n=1, cutoff=0.6)
    return matches[0] if matches else None


def dotted(parts: Sequence[str | int]) -> str:
    """`("grpo", "lr")` -> `"grpo.lr"`; list indices appear as plain numbers (`envs.0.name`)."""
    return ".".join(str(p) for p in parts)


def suggestion(parts: Sequence[str | int], depth: int, candidates: Iterable[str]) -> str:
    """` (did you mean 'a.b.c'?)` for the key `parts` whose segment at `depth` is unknown.

    The suggestion replaces only the unknown segment, so a typo in a section name still
    suggests the full key the user most likely meant. Empty string when nothing is close.
    """
    best = closest_key(str(parts[depth]), candidates)
    if best is None:
        return ""
    fixed = [*parts[:depth], best, *parts[depth + 1 :]]
    return f" (did you mean '{dotted(fixed)}'?)"
