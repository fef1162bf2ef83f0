"""Pieces every environment shares: config validation, reading conversations, building returns."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import torch
from pydantic import BaseModel

from rl_core.config import ConfigError, RLConfig
from rl_core.config import validate_config as validate_rl_config
from rl_core.interfaces import EnvironmentReturn, MessageLog


class EnvConfig(RLConfig):
    """Base of every environment config (the ``env.<task>`` section of a recipe)."""


ConfigT = TypeVar("ConfigT", bound=BaseModel)


def validate_config(
    config_cls: type[ConfigT], raw: ConfigT | Mapping[str, Any] | None, where: str
) -> ConfigT:
    """Validate ``raw`` as ``config_cls``; a `ConfigError` names ``where`` and each bad key."""
    if isinstance(raw, config_cls):
        return raw
    if raw is not None and not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping of settings, got {type(raw).__name__} {raw!r}")
    return validate_rl_config(dict(raw or {}), config_cls, source=where)


def last_assistant_text(message_log: MessageLog | Sequence[Mapping[str, Any]]) -> str:
    """Content of the last assistant turn ("" when the model has not spoken)."""
    for message in reversed(message_log):
        if message.get("role") == "assistant":
            content = message.get("content")
            return content if isinstance(content, str) else ""
    return ""


def response_length(message_log: MessageLog | Sequence[Mapping[str, Any]]) -> int:
    """Length of all assistant turns: tokens when `token_ids` are present, else characters."""
    total = 0
    for message in message_log:
        if message.get("role") != "assistant":
            continue
        token_ids = message.get("token_ids")
        if token_ids is not None and hasattr(token_ids, "__len__"):
            total += len(token_ids)
        else:
            total += len(str(message.get("content") or ""))
    return total


def make_return(
    observations: list[dict[str, str]],
    metadata: list[dict[str, Any] | None],
    next_stop_strings: list[list[str] | None],
    rewards: Sequence[float],
    terminateds: Sequence[bool],
    answers: list[str | None],
) -> EnvironmentReturn:
    sizes = {
        len(observations),
        len(metadata),
        len(next_stop_strings),
        len(rewards),
        len(terminateds),
        len(answers),
    }
    if len(sizes) != 1:
        raise AssertionError(
            f"inconsistent per-sample list lengths in an environment return: {sorted(sizes)}"
        )
    return EnvironmentReturn(
        observations=observations,
        metadata=metadata,
        next_stop_strings=next_stop_strings,
        rewards=torch.tensor(list(rewards), dtype=torch.float32),
        terminateds=torch.tensor(list(terminateds), dtype=torch.bool),
        answers=answers,
    )


def check_batch(message_log_batch: Sequence[Any], metadata: Sequence[Any], env_name: str) -> None:
    if len(message_log_batch) != len(metadata):
        raise ValueError(
            f"{env_name}.step: got {len(message_log_batch)} conversations but {len(metadata)} metadata entries"
        )


def required_field(metadata: Mapping[str, Any] | None, key: str, index: int, env_name: str) -> Any:
    if not isinstance(metadata, Mapping) or key not in metadata:
        present = sorted(metadata) if isinstance(metadata, Mapping) else type(metadata).__name__
        raise ValueError(f"{env_name}.step: metadata[{index}] has no {key!r} (present: {present})")
    return metadata[key]


def batch_rewards(batch: Mapping[str, Any]) -> torch.Tensor:
    """The per-sample rewards of a rollout batch (key ``rewards``, or ``total_reward``)."""
    for key in ("rewards", "total_reward"):
        if key in batch:
            return torch.as_tensor(batch[key], dtype=torch.float32).reshape(-1)
    raise KeyError(f"rollout batch has neither 'rewards' nor 'total_reward' (keys: {sorted(batch)})")


def batch_message_logs(batch: Mapping[str, Any]) -> list[MessageLog] | None:
    logs = batch.get("message_log") if hasattr(batch, "get") else None
    return list(logs) if logs is not None else None


def mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0
