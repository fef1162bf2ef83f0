"""Multi-turn rollouts: generate, let the environments answer, repeat.

One turn, for every conversation still active: generate a reply (batched over all of them),
append it to the conversation's message log with its generation log-probs, and step the
environments (routed by `task_name`). A conversation ends when its environment says so, when
its reply was cut by the length limit, after `max_rollout_turns` replies, or when the next
observation would not leave room for a single generated token. Otherwise the environment's
observation is appended in the chat template's format, ending in the assistant header, and
the conversation takes part in the next turn.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from rl_algos.data.chat import MessageLog as ChatLog
from rl_algos.data.collate import append_generated_message, append_observation, collate_message_logs
from rl_algos.data.processors import message_log_length
from rl_core.data import BatchedDataDict
from rl_core.interfaces import EnvironmentReturn, GenerationInterface, MessageLog

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class EnvironmentStepper(Protocol):
    """Steps a batch of conversations through the environment of each one's task
    (`rl_envs.EnvironmentRouter` over Ray actors, or anything with the same `step`)."""

    def step(
        self, message_log_batch: list[MessageLog], metadata: list[dict[str, Any]], task_names: Sequence[str]
    ) -> EnvironmentReturn: ...


@dataclass
class RolloutResult:
    """The finished conversations and how the rollout went.

    `batch` is the input batch with `message_log` grown by the generated and observation turns,
    plus per sample: `total_reward` [B] float32 (sum over turns), `num_turns` [B] int64 (replies
    generated), `response_length` [B] int64 (generated tokens over all turns), `truncated` [B]
    bool (stopped by a length limit), `terminated` [B] bool (ended by the environment) and
    `answers` (the environment's extracted final answers).
    """

    batch: BatchedDataDict[Any]
    metrics: dict[str, float] = field(default_factory=dict)


def run_multi_turn_rollout(
    generation: GenerationInterface,
    batch: BatchedDataDict[Any],
    tokenizer: PreTrainedTokenizerBase,
    environments: EnvironmentStepper,
    *,
    max_rollout_turns: int,
    max_seq_len: int,
    greedy: bool = False,
) -> RolloutResult:
    """Roll out every conversation of `batch` (keys `message_log`, `extra_env_info`, `task_name`).

    The input batch is not modified; its message logs are copied (message dicts are shared
    until a turn is appended, never changed).
    """
    if max_rollout_turns < 1:
        raise ValueError(f"max_rollout_turns must be at least 1, got {max_rollout_turns}")
    for key in ("message_log", "extra_env_info", "task_name"):
        if key not in batch:
            raise KeyError(f"rollout batch has no '{key}' (keys: {sorted(batch.keys())})")
    size = batch.size
    logs: list[ChatLog] = [list(log) for log in batch["message_log"]]
    metadata: list[dict[str, Any]] = [dict(info or {}) for info in batch["extra_env_info"]]
    task_names: list[str] = list(batch["task_name"])
    pad_token_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)

    total_reward = torch.zeros(size, dtype=torch.float32)
    num_turns = torch.zeros(size, dtype=torch.long)
    response_length = torch.zeros(size, dtype=torch.long)
    truncated = torch.zeros(size, dtype=torch.bool)
    terminated = torch.zeros(size, dtype=torch.bool)
    answers: list[str | None] = [None] * size
    stop_strings: list[list[str] | None] = [None] * size
    metrics: dict[str, float] = {"generation_time_s": 0.0, "env_time_s": 0.0}

    active = []
    for i in range(size):
        # A prompt that fills the context leaves nothing to generate.
        if message_log_length(logs[i]) >= max_seq_len:
            truncated[i] = True
        else:
            active.append(i)

    for turn in range(max_rollout_turns):
        if not active:
            break
        start = time.perf_counter()
        outputs = generation.generate(
            _generation_input(logs, active, stop_strings, pad_token_id), greedy=greedy
        )
        metrics["generation_time_s"] += time.perf_counter() - start
        for row, i in enumerate(active):
            end = int(outputs["unpadded_sequence_lengths"][row])
            generated = int(outputs["generation_lengths"][row])
            append_generated_message(
                logs[i],
                tokenizer,
                outputs["output_ids"][row, end - generated : end],
                outputs["logprobs"][row, end - generated : end],
            )
            response_length[i] += generated
            num_turns[i] += 1
            if bool(outputs["truncated"][row]):
                truncated[i] = True

        start = time.perf_counter()
        result = environments.step(
            [cast(MessageLog, logs[i]) for i in active],
            [metadata[i] for i in active],
            [task_names[i] for i in active],
        )
        metrics["env_time_s"] += time.perf_counter() - start
        turn_rewards = result.rewards.to(torch.float32).reshape(-1)
        metrics[f"turn_{turn + 1}/active_samples"] = float(len(active))
        metrics[f"turn_{turn + 1}/mean_reward"] = float(turn_rewards.mean())

        still_active = []
        for row, i in enumerate(active):
            total_reward[i] += turn_rewards[row]
            answers[i] = result.answers[row]
            if bool(result.terminateds[row]):
                terminated[i] = True
                continue
            if truncated[i] or turn + 1 == max_rollout_turns:
                continue
            observation = append_observation(logs[i], tokenizer, result.observations[row])
            if message_log_length(logs[i]) >= max_seq_len:
                # No room to reply to this observation: the episode is cut by the length limit.
                logs[i].remove(observation)
                truncated[i] = True
                continue
            metadata[i] = result.metadata[row] or {}
            stop_strings[i] = result.next_stop_strings[row]
            still_active.append(i)
        active = still_active

    out = batch.copy()
    out["message_log"] = logs
    out["total_reward"] = total_reward
    out["num_turns"] = num_turns
    out["response_length"] = response_length
    out["truncated"] = truncated
    out["terminated"] = terminated
    out["answers"] = answers
    lengths = response_length.to(torch.float32)
    metrics.update(
        mean_turns=float(num_turns.to(torch.float32).mean()),
        terminated_fraction=float(terminated.to(torch.float32).mean()),
        truncated_fraction=float(truncated.to(torch.float32).mean()),
        mean_response_length=float(lengths.mean()),
        max_response_length=float(lengths.max()) if size else 0.0,
        generated_tokens=float(lengths.sum()),
    )
    return RolloutResult(out, metrics)


def _generation_input(
    logs: list[ChatLog], active: list[int], stop_strings: list[list[str] | None], pad_token_id: int
) -> BatchedDataDict[Any]:
    collated = collate_message_logs([logs[i] for i in active], pad_token_id)
    data: BatchedDataDict[Any] = BatchedDataDict(
        input_ids=collated["input_ids"], input_lengths=collated["input_lengths"]
    )
    if any(stop_strings[i] for i in active):
        data["stop_strings"] = [stop_strings[i] for i in active]
    return data
