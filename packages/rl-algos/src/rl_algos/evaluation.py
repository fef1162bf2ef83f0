"""Scoring a policy on prompts: rollouts (greedy by default), environment rewards, accuracy.

Used for GRPO's validation and for the warm start's stopping rule; `accuracy` is the mean
reward, which for 0/1 verifiers (math) is the fraction of problems solved.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from rl_algos.data.collate import collate_datums
from rl_algos.rollouts import EnvironmentStepper, run_multi_turn_rollout
from rl_algos.training import WeightedMeans, is_number
from rl_core.data import BatchedDataDict

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rl_algos.data.processors import DatumSpec
    from rl_core.interfaces import GenerationInterface


class ScoringEnvironments(EnvironmentStepper, Protocol):
    """The environment router: stepping plus each environment's batch post-processing."""

    def global_post_process_and_metrics(
        self, batch: Mapping[str, Any], task_names: Sequence[str]
    ) -> tuple[dict[str, Any], dict[str, Any]]: ...


def post_process_rewards(
    environments: ScoringEnvironments, batch: BatchedDataDict[Any]
) -> tuple[torch.Tensor, dict[str, float]]:
    """Each environment's batch-level post-processing of its samples' rewards, and its metrics
    (prefixed `env/<task>/`)."""
    scored, metrics = environments.global_post_process_and_metrics(
        {"rewards": batch["total_reward"], "message_log": batch["message_log"]}, batch["task_name"]
    )
    rewards = torch.as_tensor(scored["rewards"], dtype=torch.float32).reshape(-1)
    return rewards, {f"env/{key}": float(value) for key, value in metrics.items() if is_number(value)}


def rollout_summary(metrics: Mapping[str, float]) -> dict[str, float]:
    """Rollout metrics that are averaged over batches (times and token counts are summed instead)."""
    skip = ("generation_time_s", "env_time_s", "generated_tokens")
    return {key: value for key, value in metrics.items() if key not in skip}


def evaluate(
    generation: GenerationInterface,
    datums: Sequence[DatumSpec],
    tokenizer: PreTrainedTokenizerBase,
    environments: ScoringEnvironments,
    *,
    batch_size: int,
    max_rollout_turns: int,
    max_seq_len: int,
    greedy: bool = True,
    num_examples: int = 2,
) -> dict[str, Any]:
    """Roll out every datum once; `accuracy` (mean reward), `num_samples`, averaged rollout and
    environment metrics, `timing/evaluation` and a few `examples` (conversation texts)."""
    if not datums:
        raise ValueError("nothing to evaluate: no prompts")
    start = time.perf_counter()
    pad_token_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    rewards: list[torch.Tensor] = []
    means = WeightedMeans()
    examples: list[str] = []
    generation.prepare_for_generation()
    for first in range(0, len(datums), batch_size):
        chunk = list(datums[first : first + batch_size])
        rollout = run_multi_turn_rollout(
            generation,
            collate_datums(chunk, pad_token_id),
            tokenizer,
            environments,
            max_rollout_turns=max_rollout_turns,
            max_seq_len=max_seq_len,
            greedy=greedy,
        )
        batch_rewards, env_metrics = post_process_rewards(environments, rollout.batch)
        rewards.append(batch_rewards)
        per_turn = {k: v for k, v in rollout_summary(rollout.metrics).items() if not k.startswith("turn_")}
        means.add({**per_turn, **env_metrics}, len(chunk))
        if len(examples) < num_examples:
            logs = rollout.batch["message_log"][: num_examples - len(examples)]
            examples += [conversation_text(log) for log in logs]
    generation.finish_generation()
    all_rewards = torch.cat(rewards)
    return {
        "accuracy": float(all_rewards.mean()),
        "num_samples": float(all_rewards.numel()),
        **means.means(),
        "timing/evaluation": time.perf_counter() - start,
        "examples": examples,
    }


def conversation_text(log: Sequence[Mapping[str, Any]]) -> str:
    return "".join(f"[{m['role']}] {m['content']}\n" for m in log)
