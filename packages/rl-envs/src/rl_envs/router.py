"""Route a mixed batch to the environment of each sample's ``task_name`` and merge the results."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rl_core.interfaces import EnvironmentReturn, MessageLog


def split_by_task(task_names: Sequence[str], known: Sequence[str]) -> dict[str, list[int]]:
    """Indices of the batch per task name, in first-seen order; unknown names are an error."""
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(task_names):
        if name not in known:
            raise ValueError(
                f"sample {i} has task_name {name!r}, which has no environment; configured: {sorted(known)}"
            )
        groups.setdefault(name, []).append(i)
    return groups


def merge_returns(
    parts: Mapping[str, tuple[list[int], EnvironmentReturn]], batch_size: int
) -> EnvironmentReturn:
    """Scatter per-task returns back to batch order."""
    observations: list[Any] = [None] * batch_size
    metadata: list[Any] = [None] * batch_size
    stop_strings: list[Any] = [None] * batch_size
    answers: list[Any] = [None] * batch_size
    rewards = torch.zeros(batch_size, dtype=torch.float32)
    terminateds = torch.zeros(batch_size, dtype=torch.bool)
    for name, (indices, ret) in parts.items():
        if len(ret.observations) != len(indices):
            raise RuntimeError(
                f"environment {name!r} returned {len(ret.observations)} results for {len(indices)} samples"
            )
        index = torch.tensor(indices, dtype=torch.long)
        rewards[index] = ret.rewards.to(torch.float32).reshape(-1)
        terminateds[index] = ret.terminateds.to(torch.bool).reshape(-1)
        for j, i in enumerate(indices):
            observations[i] = ret.observations[j]
            metadata[i] = ret.metadata[j]
            stop_strings[i] = ret.next_stop_strings[j]
            answers[i] = ret.answers[j]
    return EnvironmentReturn(observations, metadata, stop_strings, rewards, terminateds, answers)


def _select(batch: Mapping[str, Any], indices: list[int], batch_size: int) -> dict[str, Any]:
    """The rows ``indices`` of every per-sample entry (tensors and lists of length B)."""
    index = torch.tensor(indices, dtype=torch.long)
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch_size:
            out[key] = value.index_select(0, index)
        elif isinstance(value, list) and len(value) == batch_size:
            out[key] = [value[i] for i in indices]
        else:
            out[key] = value
    return out


def _scatter(target: dict[str, Any], rows: Mapping[str, Any], indices: list[int], batch_size: int) -> None:
    """Write the per-sample entries of ``rows`` (a `_select`ed sub-batch) back at ``indices``."""
    for key, value in rows.items():
        original = target.get(key)
        if isinstance(original, torch.Tensor) and original.dim() > 0 and original.shape[0] == batch_size:
            original[torch.tensor(indices, dtype=torch.long)] = torch.as_tensor(value).to(original.dtype)
        elif isinstance(original, list) and len(original) == batch_size:
            for j, i in enumerate(indices):
                original[i] = value[j]


class EnvironmentRouter:
    """Holds one environment actor per task name and steps a mixed batch through them.

    Each group is sent to its actor concurrently; results come back in the batch's order.
    """

    def __init__(self, environments: Mapping[str, Any]) -> None:
        if not environments:
            raise ValueError("EnvironmentRouter needs at least one environment")
        self.environments = dict(environments)

    def step(
        self, message_log_batch: list[MessageLog], metadata: list[dict[str, Any]], task_names: Sequence[str]
    ) -> EnvironmentReturn:
        import ray

        if not (len(message_log_batch) == len(metadata) == len(task_names)):
            raise ValueError(
                f"router.step: {len(message_log_batch)} conversations, {len(metadata)} metadata entries "
                f"and {len(task_names)} task names must match"
            )
        groups = split_by_task(task_names, list(self.environments))
        futures = {
            name: self.environments[name].step.remote(
                [message_log_batch[i] for i in idx], [metadata[i] for i in idx]
            )
            for name, idx in groups.items()
        }
        parts = {name: (groups[name], ret) for name, ret in zip(futures, ray.get(list(futures.values())))}
        return merge_returns(parts, len(task_names))

    def global_post_process_and_metrics(
        self, batch: Mapping[str, Any], task_names: Sequence[str]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Each environment post-processes its own samples; metrics are prefixed ``<task>/``."""
        import ray

        size = len(task_names)
        groups = split_by_task(task_names, list(self.environments))
        futures = {
            name: self.environments[name].global_post_process_and_metrics.remote(_select(batch, idx, size))
            for name, idx in groups.items()
        }
        # Copies, so the caller's batch is not modified in place.
        merged = {
            k: v.clone() if isinstance(v, torch.Tensor) else list(v) if isinstance(v, list) else v
            for k, v in batch.items()
        }
        metrics: dict[str, Any] = {}
        for name, (sub_batch, sub_metrics) in zip(futures, ray.get(list(futures.values()))):
            _scatter(merged, sub_batch, groups[name], size)
            metrics.update({f"{name}/{k}": v for k, v in sub_metrics.items()})
        return merged, metrics

    def shutdown(self) -> None:
        import ray

        ray.get([env.shutdown.remote() for env in self.environments.values()])
        for env in self.environments.values():
            ray.kill(env)
