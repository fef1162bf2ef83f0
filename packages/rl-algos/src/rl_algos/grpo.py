"""GRPO with the DAPO and GSPO knobs: config, setup, one step, and the run.

`grpo_step` is the algorithm of DESIGN.md §4, top to bottom. `setup` builds every component
from a validated `GRPOMasterConfig`; `grpo_train` runs the shared training loop (validation,
logging, checkpoints, resume) around `grpo_step`; `run_grpo` is what `rl grpo` runs.

- DAPO: asymmetric clipping and token-level loss (`loss_fn`), dynamic sampling and overlong
  filtering (`grpo.use_dynamic_sampling`, `grpo.overlong_filtering`), soft overlong
  punishment (`grpo.reward_shaping`).
- GSPO: sequence-level importance ratios (`loss_fn.sequence_level_importance_ratios`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import torch
from pydantic import Field, model_validator

from rl_algos.advantages import broadcast_to_tokens, compute_grpo_advantages
from rl_algos.batch_filters import group_rows, informative_groups, overlong_filtered_mask
from rl_algos.config import GenerationBackendConfig, PromptDataConfig, apply_backend_alias
from rl_algos.data.collate import collate_datums, collate_message_logs
from rl_algos.data.errors import DataError
from rl_algos.evaluation import evaluate, post_process_rewards, rollout_summary
from rl_algos.losses import ClippedPGLossConfig, ClippedPGLossFn
from rl_algos.rewards import RewardScalingConfig, RewardShapingConfig, scale_rewards, shape_rewards
from rl_algos.rollouts import run_multi_turn_rollout
from rl_algos.training import (
    BatchStream,
    LoopConfig,
    LoopResult,
    PolicyRun,
    PolicyRunConfig,
    WeightedMeans,
    mean_over_optimizer_steps,
    pad_to_multiple,
    restore_from_checkpoint,
    run_loop,
    shutdown_run,
)
from rl_core.data import BatchedDataDict

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rl_algos.backends import Policy
    from rl_algos.data.processors import DatumSpec, ProcessedDataset
    from rl_core.interfaces import GenerationInterface
    from rl_core.logging import Logger
    from rl_envs.router import EnvironmentRouter

PROMPT_COLUMNS = ("prompt", "answer")


# ------------------------------------------------------------------------------------ config


class GRPOConfig(LoopConfig):
    """The `grpo` section of a recipe (plus the loop settings every algorithm has)."""

    num_prompts_per_step: int = Field(ge=1)
    num_generations_per_prompt: int = Field(ge=1)
    normalize_rewards: bool = Field(default=True, description="divide advantages by the group's std")
    use_leave_one_out_baseline: bool = False
    max_val_samples: int | None = Field(default=None, ge=1)
    val_batch_size: int = Field(default=64, ge=1)
    max_rollout_turns: int = Field(default=1, ge=1)
    reward_scaling: RewardScalingConfig = Field(default_factory=RewardScalingConfig)
    reward_shaping: RewardShapingConfig = Field(default_factory=RewardShapingConfig)
    use_dynamic_sampling: bool = False
    dynamic_sampling_max_gen_batches: int = Field(default=10, ge=1)
    batch_multiplier: float = Field(
        default=1.0,
        ge=1.0,
        description="with dynamic sampling: prompts per generation batch / num_prompts_per_step",
    )
    overlong_filtering: bool = False

    @property
    def samples_per_step(self) -> int:
        return self.num_prompts_per_step * self.num_generations_per_prompt

    @property
    def prompts_per_generation_batch(self) -> int:
        if not self.use_dynamic_sampling:
            return self.num_prompts_per_step
        return math.ceil(self.num_prompts_per_step * self.batch_multiplier)


class GRPOMasterConfig(PolicyRunConfig):
    """A whole GRPO recipe: the policy sections every run has, plus GRPO's own."""

    grpo: GRPOConfig
    loss_fn: ClippedPGLossConfig = Field(default_factory=ClippedPGLossConfig)
    generation: GenerationBackendConfig = Field(default_factory=GenerationBackendConfig)
    data: PromptDataConfig
    env: dict[str, dict[str, Any] | None]

    _backend_alias = model_validator(mode="before")(apply_backend_alias)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        samples = self.grpo.samples_per_step
        gbs = self.policy.train_global_batch_size
        if samples % gbs:
            raise ValueError(
                f"policy.train_global_batch_size ({gbs}) must divide grpo.num_prompts_per_step x "
                f"grpo.num_generations_per_prompt ({samples})"
            )
        if self.data.task_name not in self.env:
            raise ValueError(
                f"data.task_name is {self.data.task_name!r} but the env section configures {sorted(self.env)}"
            )
        shaping = self.grpo.reward_shaping
        if (
            shaping.enabled
            and shaping.max_response_length is None
            and self.policy.generation.max_new_tokens is None
        ):
            raise ValueError(
                "grpo.reward_shaping needs max_response_length (or policy.generation.max_new_tokens)"
            )
        if self.loss_fn.reference_policy_kl_penalty > 0 and not self.policy.reference_model:
            raise ValueError("loss_fn.reference_policy_kl_penalty > 0 needs policy.reference_model: true")
        return self

    @property
    def max_response_length(self) -> int:
        return self.policy.generation.max_new_tokens or self.policy.max_total_sequence_length


# ------------------------------------------------------------------------------ components


@dataclass(kw_only=True)
class GRPORun(PolicyRun):
    """A GRPO run's parts: the policy loop's, plus rollouts, environments and the loss."""

    cfg: GRPOMasterConfig  # policy.model_name resolved to the model actually trained
    generation: GenerationInterface
    tokenizer: PreTrainedTokenizerBase
    environments: EnvironmentRouter
    loss_fn: ClippedPGLossFn
    validation: ProcessedDataset[DatumSpec] | None
    generation_weights_stale: bool

    @property
    def pad_token_id(self) -> int:
        return int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0)

    def shutdown_components(self) -> list[Callable[[], Any]]:
        return [self.generation.shutdown, self.environments.shutdown, *super().shutdown_components()]


class PhaseTimer:
    """Wall seconds per named phase of a step (repeated phases add up)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - start)

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds


# ----------------------------------------------------------------------------------- setup


def setup(cfg: GRPOMasterConfig) -> GRPORun:
    """Build every component, cheapest checks first: the datasets are read and checked before
    Ray starts; then the environments, the base model (when the recipe builds one), the
    policy (refusing a checkpoint of another model) and its rollout engine. Whatever was
    started is stopped again if a later part fails."""
    from transformers import AutoTokenizer

    from rl_algos.backends import make_generation
    from rl_algos.data.dataloader import StatefulDataLoader
    from rl_algos.data.loading import load_records
    from rl_algos.training import LoopState, start_policy
    from rl_core.logging import Logger
    from rl_envs.registry import create_environments
    from rl_envs.router import EnvironmentRouter

    train_records = load_records(cfg.data.train, PROMPT_COLUMNS)
    val_records = load_records(cfg.data.validation, PROMPT_COLUMNS) if cfg.data.validation else None
    torch.manual_seed(cfg.grpo.seed)

    start = start_policy(cfg, "policy", cfg.data.prompt)
    with ExitStack() as cleanup:
        cleanup.callback(start.clusters.shutdown)
        cleanup.callback(start.policy.shutdown)
        environments = EnvironmentRouter(create_environments(cfg.env))
        cleanup.callback(environments.shutdown)
        generation = make_generation(
            start.policy,
            start.policy_cfg,
            cfg.generation,
            lambda workers: start.clusters.make("generation", workers),
            start.clusters.env_vars,
        )
        cleanup.callback(generation.shutdown)

        tokenizer = AutoTokenizer.from_pretrained(start.policy_cfg.tokenizer_path)
        train_set = _prompt_dataset(train_records, tokenizer, cfg, "train")
        validation = _prompt_dataset(val_records, tokenizer, cfg, "validation") if val_records else None
        pad_token_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        loader: StatefulDataLoader[Any, BatchedDataDict[Any]] = StatefulDataLoader(
            train_set,
            cfg.grpo.prompts_per_generation_batch,
            partial(collate_datums, pad_token_id=pad_token_id),
            shuffle=cfg.data.shuffle,
            seed=cfg.grpo.seed,
        )
        logger = Logger(cfg.logger, total_steps=cfg.grpo.max_num_steps)
        cleanup.callback(logger.close)
        logger.log_hyperparams(start.config_to_save)
        run = GRPORun(
            name="grpo",
            loop=cfg.grpo,
            config_to_save=start.config_to_save,
            policy=start.policy,
            batches=BatchStream(loader, cfg.grpo.max_num_epochs, "training prompts"),
            logger=logger,
            checkpointer=start.checkpointer,
            state=LoopState(),
            clusters=start.clusters,
            validation_key="accuracy",
            cfg=cfg.model_copy(update={"policy": start.policy_cfg}),
            generation=generation,
            tokenizer=tokenizer,
            environments=environments,
            loss_fn=ClippedPGLossFn(cfg.loss_fn),
            validation=validation,
            generation_weights_stale=not cfg.generation.shares_policy_weights,
        )
        if start.resume is not None:
            restore_from_checkpoint(run, start.resume)
        cleanup.pop_all()  # the run owns everything now; `shutdown_run` stops it
    return run


def _prompt_dataset(
    records: list[dict[str, Any]], tokenizer: PreTrainedTokenizerBase, cfg: GRPOMasterConfig, split: str
) -> ProcessedDataset[DatumSpec]:
    from rl_algos.data.processors import PromptAnswerProcessor, process_records

    processor = PromptAnswerProcessor(tokenizer, cfg.data.prompt, task_name=cfg.data.task_name)
    dataset = process_records(records, processor)
    needed = cfg.grpo.prompts_per_generation_batch if split == "train" else 1
    if len(dataset) < needed:
        raise DataError(f"data.{split}: only {len(dataset)} usable prompts, fewer than one step's {needed}")
    return dataset


# ------------------------------------------------------------------------------------ step


def grpo_step(run: GRPORun, step: int) -> dict[str, Any]:
    """One GRPO step; returns its metrics (see the module docstring for the knobs)."""
    cfg = run.cfg.grpo
    group_size = cfg.num_generations_per_prompt
    timer = PhaseTimer()
    step_start = time.perf_counter()
    kept: list[BatchedDataDict[Any]] = []
    all_raw_rewards: list[torch.Tensor] = []
    rollout_metrics = WeightedMeans()
    generated_tokens = 0.0
    generation_rounds = groups_generated = groups_kept = 0
    while True:
        # 1. Prompts, each repeated num_generations_per_prompt times: one group per prompt.
        prompts = run.batches.next_batch()
        run.state.consumed_samples += prompts.size
        group = prompts.repeat_interleave(group_size)

        # 2. Bring the rollout engine's weights up to date (colocated HF generation shares them).
        if run.generation_weights_stale:
            with timer("refit"):
                refit_generation(run.policy, run.generation, run.cfg.policy.refit_bucket_size_bytes)
            run.generation_weights_stale = False

        # 3. Multi-turn rollout: generate, step the environments, append observations.
        with timer("rollout"):
            run.generation.prepare_for_generation()
            rollout = run_multi_turn_rollout(
                run.generation,
                group,
                run.tokenizer,
                run.environments,
                max_rollout_turns=cfg.max_rollout_turns,
                max_seq_len=run.cfg.policy.max_total_sequence_length,
            )
            run.generation.finish_generation()
        batch = rollout.batch
        timer.add("generation", rollout.metrics["generation_time_s"])
        timer.add("env_step", rollout.metrics["env_time_s"])
        with timer("env_post_process"):
            raw_rewards, env_metrics = post_process_rewards(run.environments, batch)

        # 4. Reward scaling and DAPO's soft overlong punishment.
        rewards = shape_rewards(
            scale_rewards(raw_rewards, cfg.reward_scaling),
            batch["response_length"],
            cfg.reward_shaping,
            run.cfg.max_response_length,
        )

        # 5. Group-relative advantages (zero for groups whose rewards are all equal).
        advantages = compute_grpo_advantages(
            rewards,
            num_generations_per_prompt=group_size,
            leave_one_out=cfg.use_leave_one_out_baseline,
            normalize_std=cfg.normalize_rewards,
        )
        batch["rewards"] = rewards
        batch["sequence_advantages"] = advantages
        all_raw_rewards.append(raw_rewards)
        rollout_metrics.add({**rollout_summary(rollout.metrics), **env_metrics}, prompts.size)
        generated_tokens += rollout.metrics["generated_tokens"]
        generation_rounds += 1
        groups_generated += prompts.size

        # 6. DAPO dynamic sampling: keep groups that carry signal; generate more until full.
        if cfg.use_dynamic_sampling:
            informative = informative_groups(rewards, group_size)
            groups_kept += int(informative.sum())
            batch = batch.select_indices(group_rows(informative, group_size))
        else:
            groups_kept += prompts.size
        kept.append(BatchedDataDict({key: batch[key] for key in _ROLLOUT_KEYS}))
        collected = sum(part.size for part in kept)
        if not cfg.use_dynamic_sampling or collected >= cfg.samples_per_step:
            break
        if generation_rounds >= cfg.dynamic_sampling_max_gen_batches:
            print(
                f"grpo step {step}: dynamic sampling found {collected // group_size} informative groups "
                f"in {generation_rounds} generation batches (wanted {cfg.num_prompts_per_step}); "
                "training on those",
                flush=True,
            )
            break
    batch = BatchedDataDict.from_batches(kept)
    batch = batch.slice(0, min(batch.size, cfg.samples_per_step))

    # 7. Overlong filtering: samples cut by the length limit are carried but not trained on.
    sample_mask = batch["sample_mask"]
    if cfg.overlong_filtering:
        sample_mask = overlong_filtered_mask(sample_mask, batch["truncated"])

    metrics: dict[str, Any] = {}
    if batch.size > 0:
        # 8. The training batch: generated tokens trained on, advantages on every one of them.
        train_data = build_training_batch(batch, sample_mask, run.pad_token_id)

        # 9. Log-probs of the policy before this update, and of the reference policy.
        with timer("logprobs"):
            run.policy.prepare_for_lp_inference()
            train_data["prev_logprobs"] = run.policy.get_logprobs(train_data)["logprobs"]
        if run.cfg.policy.reference_model:
            with timer("reference_logprobs"):
                reference = run.policy.get_reference_policy_logprobs(train_data)
                train_data["reference_policy_logprobs"] = reference["reference_logprobs"]

        # 10. Policy update with the clipped policy-gradient loss.
        with timer("train"):
            run.policy.prepare_for_training()
            train_metrics = run.policy.train(
                pad_to_multiple(train_data, run.cfg.policy.train_global_batch_size), run.loss_fn
            )
            run.policy.finish_training()
        run.generation_weights_stale = not run.cfg.generation.shares_policy_weights
        metrics.update(mean_over_optimizer_steps(train_metrics))
        metrics.update(_batch_metrics(batch, train_data, sample_mask))
    else:
        print(f"grpo step {step}: no informative group was generated; skipping the update", flush=True)

    # 11. Metrics: rewards, lengths, advantages, DAPO bookkeeping, throughput, timing.
    raw = torch.cat(all_raw_rewards)
    timer.seconds["total"] = time.perf_counter() - step_start
    metrics.update(
        reward=float(raw.mean()),
        reward_std=float(raw.std()) if raw.numel() > 1 else 0.0,
        num_prompts=float(groups_generated),
        generation_rounds=float(generation_rounds),
        informative_group_fraction=float(groups_kept / max(groups_generated, 1)),
        num_trained_samples=float(batch.size),
        **rollout_metrics.means(),
    )
    if cfg.reward_scaling.enabled or cfg.reward_shaping.enabled:
        metrics["shaped_reward"] = float(batch["rewards"].mean()) if batch.size else 0.0
    seconds = timer.seconds
    metrics["throughput/generation_tokens_per_s"] = generated_tokens / max(
        seconds.get("generation", 0.0), 1e-9
    )
    if "train" in seconds:
        metrics["throughput/train_tokens_per_s"] = float(batch_total_tokens(batch)) / max(
            seconds["train"], 1e-9
        )
    metrics["throughput/step_tokens_per_s"] = generated_tokens / max(seconds["total"], 1e-9)
    metrics.update({f"timing/{phase}": value for phase, value in seconds.items()})
    return metrics


# What a rollout batch carries from generation to training.
_ROLLOUT_KEYS = (
    "message_log",
    "task_name",
    "sample_mask",
    "truncated",
    "response_length",
    "num_turns",
    "rewards",
    "sequence_advantages",
)


def refit_generation(policy: Policy, generation: GenerationInterface, bucket_size_bytes: int) -> None:
    """Copy the policy's current weights into a rollout engine that holds its own copy."""
    policy.offload_before_refit()
    generation.prepare_for_generation()
    generation.update_weights(policy.stream_weights(bucket_size_bytes))
    generation.invalidate_kv_cache()
    policy.offload_after_refit()


def build_training_batch(
    batch: BatchedDataDict[Any], sample_mask: torch.Tensor, pad_token_id: int
) -> BatchedDataDict[Any]:
    """Right-padded `input_ids`, `input_lengths`, `token_mask` (generated tokens),
    `generation_logprobs`, `sample_mask` and per-token `advantages`."""
    train_data = collate_message_logs(batch["message_log"], pad_token_id)
    if "generation_logprobs" not in train_data:
        train_data["generation_logprobs"] = torch.zeros_like(train_data["token_mask"])
    train_data["sample_mask"] = sample_mask.to(torch.float32)
    train_data["advantages"] = broadcast_to_tokens(batch["sequence_advantages"], train_data["token_mask"])
    return train_data


def batch_total_tokens(batch: BatchedDataDict[Any]) -> int:
    return sum(int(m["token_ids"].numel()) for log in batch["message_log"] for m in log)


def _batch_metrics(
    batch: BatchedDataDict[Any], train_data: BatchedDataDict[Any], sample_mask: torch.Tensor
) -> dict[str, float]:
    advantages = batch["sequence_advantages"]
    lengths = train_data["input_lengths"].to(torch.float32)
    return {
        "advantage_mean": float(advantages.mean()),
        "advantage_std": float(advantages.std()) if advantages.numel() > 1 else 0.0,
        "advantage_abs_mean": float(advantages.abs().mean()),
        "zero_advantage_fraction": float((advantages == 0).to(torch.float32).mean()),
        "mean_sequence_length": float(lengths.mean()),
        "filtered_samples": float((sample_mask == 0).sum()),
    }


# ------------------------------------------------------------------------------ validation


def validate(run: GRPORun) -> dict[str, Any]:
    """Greedy rollouts over the validation prompts; `accuracy` is the mean reward."""
    if run.validation is None:
        return {}
    cfg = run.cfg.grpo
    return evaluate(
        run.generation,
        run.validation.datums[: cfg.max_val_samples],
        run.tokenizer,
        run.environments,
        batch_size=cfg.val_batch_size,
        max_rollout_turns=cfg.max_rollout_turns,
        max_seq_len=run.cfg.policy.max_total_sequence_length,
    )


# ------------------------------------------------------------------------------------ run


@dataclass
class GRPOResult(LoopResult):
    plot_path: Path | None = None


def grpo_train(run: GRPORun) -> GRPOResult:
    """GRPO steps from the run's state to `grpo.max_num_steps` (or the end of the data), with
    validation, checkpoints and the reward-curve plot."""
    result = run_loop(run, partial(grpo_step, run), partial(validate, run) if run.validation else None)
    return GRPOResult(**vars(result), plot_path=_plot_curves(run))


def _plot_curves(run: GRPORun) -> Path | None:
    keys = ["train/reward"]
    if run.state.validation_history:
        keys.append("validation/accuracy")
    try:
        return run.logger.log_plot(
            keys, name="reward_curve", title="GRPO: training reward and validation accuracy"
        )
    except (ValueError, ImportError) as exc:  # no step logged yet, or matplotlib missing
        print(f"grpo: no reward plot ({exc})", flush=True)
        return None


def summary(result: GRPOResult, logger: Logger) -> str:
    """End-of-run report: the validation accuracy curve, wall time, where the outputs are."""
    from rl_core.logging import format_duration

    lines = [f"GRPO finished at step {result.final_step} in {format_duration(result.wall_time_s)}"]
    history = result.validation_history
    if history:
        (first_step, first), (last_step, last) = history[0], history[-1]
        best_step, best = max(history, key=lambda entry: (entry[1], -entry[0]))
        lines.append(
            f"validation accuracy: {first:.3f} at step {first_step} -> {last:.3f} at step {last_step} "
            f"({100 * (last - first):+.1f} points); best {best:.3f} at step {best_step}"
        )
        lines.append("curve: " + ", ".join(f"{step}: {acc:.3f}" for step, acc in history))
    lines.append(f"metrics: {result.metrics_path}")
    if logger.tensorboard is not None:
        lines.append(f"tensorboard: {logger.log_dir / 'tensorboard'}")
    if result.plot_path is not None:
        lines.append(f"reward curve: {result.plot_path}")
    if result.export_path is not None:
        lines.append(f"model: {result.export_path}")
    return "\n".join(lines)


def run_grpo(cfg: GRPOMasterConfig) -> GRPOResult:
    """Set up, train, print the summary and shut down (what `rl grpo` runs)."""
    started = time.monotonic()
    run = setup(cfg)
    try:
        result = grpo_train(run)
        result.wall_time_s = time.monotonic() - started
        print(summary(result, run.logger), flush=True)
        return result
    finally:
        shutdown_run(run)


__all__ = [
    "GRPOConfig",
    "GRPOMasterConfig",
    "GRPOResult",
    "GRPORun",
    "build_training_batch",
    "grpo_step",
    "grpo_train",
    "refit_generation",
    "run_grpo",
    "setup",
    "validate",
]
