"""Message logs -> right-padded training / generation batches, and rollout bookkeeping.

A message's tokens are trained on (token_mask 1) only if it is an assistant message that is
marked `trainable` (SFT, DPO, RM data) or, without that mark, carries `generation_logprobs`
(it was generated during a rollout, DESIGN.md §3). Everything else — system, user, tool and
environment turns, the prompt's assistant header, padding — is 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from rl_algos.data.chat import Message, MessageLog, tokenize_observation
from rl_algos.data.processors import DatumSpec, PreferenceDatum
from rl_core.data import BatchedDataDict

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def is_trainable(message: Mapping[str, Any]) -> bool:
    if message["role"] != "assistant":
        return False
    if "trainable" in message:
        return bool(message["trainable"])
    return "generation_logprobs" in message


def message_token_mask(message: Mapping[str, Any]) -> torch.Tensor:
    """[n] float32: all ones for a trainable message's n tokens, else all zeros."""
    n = int(message["token_ids"].numel())
    return torch.full((n,), 1.0 if is_trainable(message) else 0.0, dtype=torch.float32)


def flatten_message_log(log: Sequence[Mapping[str, Any]], key: str = "token_ids") -> torch.Tensor:
    """Concatenate one per-token field over the messages of a log.

    `key` is `token_ids` (int64), `token_mask` (derived, float32) or a per-token float field
    such as `generation_logprobs`, which messages without it fill with zeros.
    """
    parts: list[torch.Tensor] = []
    for message in log:
        n = int(message["token_ids"].numel())
        if key == "token_mask":
            parts.append(message_token_mask(message))
        elif key in message:
            value = torch.as_tensor(message[key])
            if value.shape != (n,):
                raise ValueError(
                    f"message '{message['role']}' has {n} tokens but its '{key}' has shape {tuple(value.shape)}"
                )
            parts.append(value)
        else:
            parts.append(torch.zeros(n, dtype=torch.float32))
    if not parts:
        return torch.zeros(0, dtype=torch.long if key == "token_ids" else torch.float32)
    return torch.cat(parts)


def split_by_messages(flat: torch.Tensor, log: Sequence[Mapping[str, Any]]) -> list[torch.Tensor]:
    """The inverse of `flatten_message_log`: cut a [L] (or [L, ...]) per-token tensor of the
    flattened sequence into one piece per message. Extra trailing positions (padding) are ignored."""
    lengths = [int(m["token_ids"].numel()) for m in log]
    if flat.shape[0] < sum(lengths):
        raise ValueError(
            f"sequence of {flat.shape[0]} positions is shorter than the log's {sum(lengths)} tokens"
        )
    return list(torch.split(flat[: sum(lengths)], lengths))


def collate_message_logs(
    logs: Sequence[Sequence[Mapping[str, Any]]], pad_token_id: int
) -> BatchedDataDict[Any]:
    """Right-padded `input_ids` [B, T] (int64), `input_lengths` [B], `token_mask` [B, T]
    (float32) and, when any message carries them, `generation_logprobs` [B, T] (float32)."""
    if not logs:
        raise ValueError("cannot collate an empty batch")
    with_logprobs = any("generation_logprobs" in m for log in logs for m in log)
    keys = ["token_ids", "token_mask", *(["generation_logprobs"] if with_logprobs else [])]
    rows = {key: [flatten_message_log(log, key) for log in logs] for key in keys}
    lengths = torch.tensor([row.numel() for row in rows["token_ids"]], dtype=torch.long)
    width = int(lengths.max())

    def pad(values: list[torch.Tensor], fill: float, dtype: torch.dtype) -> torch.Tensor:
        out = torch.full((len(values), width), fill, dtype=dtype)
        for i, value in enumerate(values):
            out[i, : value.numel()] = value
        return out

    batch: BatchedDataDict[Any] = BatchedDataDict()
    batch["input_ids"] = pad(rows["token_ids"], pad_token_id, torch.long)
    batch["input_lengths"] = lengths
    batch["token_mask"] = pad(rows["token_mask"], 0.0, torch.float32)
    if with_logprobs:
        batch["generation_logprobs"] = pad(rows["generation_logprobs"], 0.0, torch.float32)
    return batch


def collate_datums(datums: Sequence[DatumSpec], pad_token_id: int) -> BatchedDataDict[Any]:
    """A batch of datums: `collate_message_logs` plus `sample_mask` (the loss multipliers),
    `idx`, `length` and the per-sample lists `message_log`, `extra_env_info`, `task_name`."""
    batch = collate_message_logs([d.message_log for d in datums], pad_token_id)
    batch["sample_mask"] = torch.tensor([d.loss_multiplier for d in datums], dtype=torch.float32)
    batch["idx"] = torch.tensor([d.idx for d in datums], dtype=torch.long)
    batch["length"] = torch.tensor([d.length for d in datums], dtype=torch.long)
    batch["message_log"] = [d.message_log for d in datums]
    batch["extra_env_info"] = [d.extra_env_info for d in datums]
    batch["task_name"] = [d.task_name for d in datums]
    return batch


def collate_preference(datums: Sequence[PreferenceDatum], pad_token_id: int) -> BatchedDataDict[Any]:
    """Preference pairs as 2B rows, chosen at even rows (2i) and rejected at odd rows (2i + 1),
    so micro-batches of even size keep pairs together."""
    logs = [log for d in datums for log in (d.chosen, d.rejected)]
    batch = collate_message_logs(logs, pad_token_id)
    batch["sample_mask"] = torch.tensor(
        [d.loss_multiplier for d in datums], dtype=torch.float32
    ).repeat_interleave(2)
    batch["idx"] = torch.tensor([d.idx for d in datums], dtype=torch.long).repeat_interleave(2)
    batch["is_chosen"] = torch.tensor([True, False] * len(datums))
    batch["message_log"] = logs
    return batch


def append_generated_message(
    log: MessageLog,
    tokenizer: PreTrainedTokenizerBase,
    token_ids: torch.Tensor,
    logprobs: torch.Tensor | None = None,
) -> Message:
    """Append a generated assistant turn (its exact generated tokens, end-of-turn token
    included when the model produced it). With `logprobs` it is trained on in RL."""
    token_ids = token_ids.to(torch.long).reshape(-1)
    message: Message = {
        "role": "assistant",
        "content": str(tokenizer.decode(token_ids.tolist(), skip_special_tokens=True)),
        "token_ids": token_ids,
    }
    if logprobs is not None:
        logprobs = logprobs.to(torch.float32).reshape(-1)
        if logprobs.shape != token_ids.shape:
            raise ValueError(f"{token_ids.numel()} generated tokens but {logprobs.numel()} logprobs")
        message["generation_logprobs"] = logprobs
    log.append(message)
    return message


def append_observation(
    log: MessageLog,
    tokenizer: PreTrainedTokenizerBase,
    observation: Mapping[str, Any],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> Message:
    """Append an environment / tool / user turn, tokenised in the chat template's turn format
    (with the template's glue after the previous turn and, by default, the next assistant
    header), so the log stays what the template would render for the conversation."""
    token_ids = tokenize_observation(
        tokenizer, log, observation, add_generation_prompt=add_generation_prompt, tools=tools
    )
    message: Message = {**observation, "content": observation.get("content") or "", "token_ids": token_ids}
    log.append(message)
    return message
