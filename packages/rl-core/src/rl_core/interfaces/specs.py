"""Field contracts of the batches that cross component boundaries.

These TypedDicts name the keys of the `BatchedDataDict`s exchanged between the algorithm
loop, the policy, the generation backend and the environments (DESIGN.md §3). All tensors
are batch-first; token tensors are right-padded and come with their unpadded lengths.
"""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict

import torch


class Message(TypedDict):
    """One turn of a conversation.

    `token_ids` are the tokens this turn contributes to the flattened sequence. An assistant
    message is trained on only if it was generated, i.e. it carries `generation_logprobs`.
    """

    role: str
    content: str
    token_ids: torch.Tensor
    generation_logprobs: NotRequired[torch.Tensor]


MessageLog = list[Message]


class GenerationInput(TypedDict):
    input_ids: torch.Tensor  # [B, T] int64, right-padded
    input_lengths: torch.Tensor  # [B] int64
    stop_strings: NotRequired[list[list[str] | None]]  # per sample, merged with the config's


class GenerationOutput(TypedDict):
    output_ids: torch.Tensor  # [B, T_total] prompt + generated tokens, right-padded
    logprobs: torch.Tensor  # [B, T_total] float32; 0 on prompt and padding positions
    generation_lengths: torch.Tensor  # [B] number of generated tokens
    unpadded_sequence_lengths: torch.Tensor  # [B] prompt length + generated length
    truncated: torch.Tensor  # [B] bool: stopped by max_new_tokens / max length, not by a stop


class TrainingBatch(TypedDict):
    """What `PolicyInterface.train` consumes (the RL losses read the optional keys)."""

    input_ids: torch.Tensor  # [B, T]
    input_lengths: torch.Tensor  # [B]
    token_mask: torch.Tensor  # [B, T] 1 where the token is trained on (generated tokens)
    sample_mask: torch.Tensor  # [B] 1 for samples that count, 0 for filtered/padding ones
    generation_logprobs: NotRequired[torch.Tensor]  # [B, T] logprobs from the rollout engine
    prev_logprobs: NotRequired[torch.Tensor]  # [B, T] logprobs of the policy before the update
    reference_policy_logprobs: NotRequired[torch.Tensor]  # [B, T]
    advantages: NotRequired[torch.Tensor]  # [B, T] (sequence advantages broadcast over tokens)


class LogprobOutput(TypedDict):
    logprobs: torch.Tensor  # [B, T] logprob of token t given tokens < t; position 0 is 0


class ReferenceLogprobOutput(TypedDict):
    reference_logprobs: torch.Tensor  # [B, T]


class TopkLogitsOutput(TypedDict):
    topk_logits: torch.Tensor  # [B, T, k] logits predicting token t+1 from position t
    topk_indices: torch.Tensor  # [B, T, k] int64


TRAINING_FIELDS: tuple[str, ...] = (
    "input_ids",
    "input_lengths",
    "token_mask",
    "sample_mask",
    "generation_logprobs",
    "prev_logprobs",
    "reference_policy_logprobs",
    "advantages",
)

Metrics = dict[str, Any]
