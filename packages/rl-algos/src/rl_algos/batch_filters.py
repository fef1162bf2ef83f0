"""Which samples of a rollout batch are trained on (DAPO's dynamic sampling and overlong filtering).

- Dynamic sampling keeps only prompt groups whose rewards are not all equal: such a group has
  zero advantage for every sample and contributes no gradient, so DAPO generates more prompts
  until the batch is full of groups that do.
- Overlong filtering gives a sample that was cut by the length limit `sample_mask` 0: its
  reward says nothing about the answer it would have given.
"""

from __future__ import annotations

import torch

from rl_algos.advantages import group_index


def informative_groups(rewards: torch.Tensor, num_generations_per_prompt: int) -> torch.Tensor:
    """[G] bool: whether each consecutive group of `num_generations_per_prompt` rewards holds at
    least two different values (compared exactly)."""
    _, num_groups = group_index(rewards.shape[0], num_generations_per_prompt=num_generations_per_prompt)
    grouped = rewards.reshape(num_groups, num_generations_per_prompt)
    return grouped.amax(dim=1) != grouped.amin(dim=1)


def group_rows(groups: torch.Tensor, num_generations_per_prompt: int) -> torch.Tensor:
    """Row indices of the selected groups ([G] bool), groups kept in order."""
    selected = torch.nonzero(groups).flatten()
    offsets = torch.arange(num_generations_per_prompt)
    return (selected[:, None] * num_generations_per_prompt + offsets[None, :]).flatten()


def overlong_filtered_mask(sample_mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """`sample_mask` with the truncated samples set to 0."""
    return torch.where(truncated.to(torch.bool), torch.zeros_like(sample_mask), sample_mask)
