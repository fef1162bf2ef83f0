"""The loop shared by the two pairwise-preference algorithms, DPO and reward-model training.

Records are `prompt / chosen / rejected` (strings or message lists; local files, a Hugging Face
dataset or the arithmetic task with `format: preference`). A batch of P pairs is 2P rows, chosen
at even and rejected at odd rows (`collate_preference`); `policy.train_global_batch_size` and
`policy.train_micro_batch_size` count *pairs*. Pairs must stay together in every micro-batch
and data-parallel shard, so dynamic batching and sequence packing (which reorder rows) are
refused, and the pairs of a step must split evenly over the data-parallel ranks.

The algorithms differ only in the loss and in whether the batch carries the frozen reference
policy's log-probs (DPO) or not (RM): `PairwiseRun` holds both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Self

from pydantic import Field, model_validator

from rl_algos.backends import PolicyConfig
from rl_algos.config import DatasetSection
from rl_algos.data.arithmetic import ArithmeticDatasetSpec
from rl_algos.data.processors import PromptFormat
from rl_algos.training import (
    BatchStream,
    LoopConfig,
    LoopState,
    PolicyRun,
    PolicyRunConfig,
    chunks,
    eval_mode_metrics,
    load_tokenizer,
    mean_over_optimizer_steps,
    restore_from_checkpoint,
    start_policy,
    training_fields,
)
from rl_core.config import RLConfig
from rl_core.data import BatchedDataDict

if TYPE_CHECKING:
    from rl_algos.data.processors import PreferenceDatum, ProcessedDataset
    from rl_core.interfaces import LossFunction

PREFERENCE_COLUMNS = ("prompt", "chosen", "rejected")


class PreferenceDataConfig(RLConfig):
    train: DatasetSection
    validation: DatasetSection | None = None
    prompt: PromptFormat = Field(default_factory=PromptFormat)
    shuffle: bool = True

    @model_validator(mode="after")
    def _arithmetic_format(self) -> Self:
        for name, spec in (("train", self.train), ("validation", self.validation)):
            if isinstance(spec, ArithmeticDatasetSpec) and spec.format != "preference":
                raise ValueError(
                    f"data.{name}: preference training needs chosen/rejected pairs; set format: preference"
                )
        return self


class PairwiseLoopConfig(LoopConfig):
    """Loop settings of DPO and RM; a step trains on `policy.train_global_batch_size` pairs."""

    val_batch_size: int = Field(default=32, ge=1, description="validation pairs per forward pass")
    max_val_samples: int | None = Field(default=None, ge=1, description="validate on the first N pairs")


def check_pairwise_policy(policy: PolicyConfig) -> None:
    """Settings that would split chosen/rejected pairs (a ValueError naming the key)."""
    if policy.dynamic_batching.enabled or policy.sequence_packing.enabled:
        which = "dynamic_batching" if policy.dynamic_batching.enabled else "sequence_packing"
        raise ValueError(
            f"policy.{which}.enabled: preference training keeps each chosen/rejected pair together, which "
            f"{which} (it reorders rows by length) cannot; disable it"
        )
    if policy.train_global_batch_size % policy.train_micro_batch_size:
        raise ValueError(
            f"policy.train_global_batch_size ({policy.train_global_batch_size} pairs) must be a multiple of "
            f"policy.train_micro_batch_size ({policy.train_micro_batch_size} pairs)"
        )


@dataclass(kw_only=True)
class PairwiseRun(PolicyRun):
    loss_fn: LossFunction
    with_reference_logprobs: bool
    validation: ProcessedDataset[PreferenceDatum] | None
    val_batch_size: int
    max_val_samples: int | None
    pad_token_id: int
    pairs_per_step: int
    pairs_per_micro_batch: int


def load_preference_datasets(
    cfg: PreferenceDataConfig, tokenizer_path: str
) -> tuple[ProcessedDataset[PreferenceDatum], ProcessedDataset[PreferenceDatum] | None]:
    from rl_algos.data.loading import load_records
    from rl_algos.data.processors import PreferenceProcessor, process_records

    tokenizer = load_tokenizer(tokenizer_path, "policy.tokenizer_name")
    processor = PreferenceProcessor(tokenizer, cfg.prompt)
    train = process_records(load_records(cfg.train, PREFERENCE_COLUMNS), processor)
    validation = None
    if cfg.validation is not None:
        validation = process_records(load_records(cfg.validation, PREFERENCE_COLUMNS), processor)
    return train, validation


def setup_pairwise(
    cfg: PolicyRunConfig,
    name: str,
    loop: PairwiseLoopConfig,
    data: PreferenceDataConfig,
    loss_fn: LossFunction,
    with_reference_logprobs: bool,
    policy_cfg: PolicyConfig | None = None,
) -> PairwiseRun:
    """Records are read first (a bad file fails before Ray starts); then the policy, the tokenised
    pairs and the loader, and the latest checkpoint is restored when there is one."""
    from rl_algos.data.collate import collate_preference
    from rl_algos.data.dataloader import StatefulDataLoader
    from rl_algos.data.loading import load_records
    from rl_core.logging import Logger

    policy_cfg = policy_cfg or cfg.policy
    data_parallel = cfg.cluster.world_size // policy_cfg.dtensor.tp_size
    if policy_cfg.train_global_batch_size % data_parallel:
        raise ValueError(
            f"policy.train_global_batch_size ({policy_cfg.train_global_batch_size} pairs) must split evenly "
            f"over the {data_parallel} data-parallel workers"
        )
    load_records(data.train, PREFERENCE_COLUMNS)
    if data.validation is not None:
        load_records(data.validation, PREFERENCE_COLUMNS)
    start = start_policy(cfg, name, data.prompt, policy_cfg)
    try:
        train, validation = load_preference_datasets(data, start.policy_cfg.tokenizer_path)
        print(f"{name}: training pairs {train.summary()}", flush=True)
        pad_token_id = start.policy.pad_token_id
        loader = StatefulDataLoader(
            train,
            policy_cfg.train_global_batch_size,
            partial(collate_preference, pad_token_id=pad_token_id),
            shuffle=data.shuffle,
            seed=loop.seed,
        )
        logger = Logger(cfg.logger, total_steps=loop.max_num_steps)
        logger.log_hyperparams(start.config_to_save)
    except BaseException:
        start.policy.shutdown()
        start.clusters.shutdown()
        raise
    run = PairwiseRun(
        name=name,
        loop=loop,
        config_to_save=start.config_to_save,
        policy=start.policy,
        batches=BatchStream(loader, loop.max_num_epochs, "training pairs"),
        logger=logger,
        checkpointer=start.checkpointer,
        state=LoopState(),
        clusters=start.clusters,
        validation_key="accuracy",
        loss_fn=loss_fn,
        with_reference_logprobs=with_reference_logprobs,
        validation=validation,
        val_batch_size=loop.val_batch_size,
        max_val_samples=loop.max_val_samples,
        pad_token_id=pad_token_id,
        pairs_per_step=policy_cfg.train_global_batch_size,
        pairs_per_micro_batch=policy_cfg.train_micro_batch_size,
    )
    if start.resume is not None:
        restore_from_checkpoint(run, start.resume)
    return run


def pair_training_batch(run: PairwiseRun, pairs: BatchedDataDict[Any]) -> BatchedDataDict[Any]:
    """The tensors the loss needs: the pairs' tokens and masks, plus the reference policy's
    log-probs of the same tokens (computed by the same workers) when the loss uses them."""
    data = training_fields(pairs)
    if run.with_reference_logprobs:
        run.policy.prepare_for_lp_inference()
        data["reference_policy_logprobs"] = run.policy.get_reference_policy_logprobs(data)[
            "reference_logprobs"
        ]
    return data


def pairwise_step(run: PairwiseRun, step: int) -> dict[str, Any]:
    """One optimizer step on the next `pairs_per_step` pairs; its metrics."""
    pairs = run.batches.next_batch()
    run.state.consumed_samples += pairs.size // 2
    started = time.perf_counter()
    data = pair_training_batch(run, pairs)
    reference_seconds = time.perf_counter() - started
    run.policy.prepare_for_training()
    train_metrics = run.policy.train(
        data, run.loss_fn, gbs=2 * run.pairs_per_step, mbs=2 * run.pairs_per_micro_batch
    )
    run.policy.finish_training()
    metrics = mean_over_optimizer_steps(train_metrics)
    metrics["mean_sequence_length"] = float(pairs["input_lengths"].float().mean())
    metrics["timing/train"] = time.perf_counter() - started - reference_seconds
    if run.with_reference_logprobs:
        metrics["timing/reference_logprobs"] = reference_seconds
    return metrics


def validate_pairwise(run: PairwiseRun) -> dict[str, Any]:
    """The loss's metrics (accuracy, margin, rewards, ...) over the validation pairs."""
    if run.validation is None:
        return {}
    from rl_algos.data.collate import collate_preference

    started = time.perf_counter()
    datums = run.validation.datums[: run.max_val_samples]
    batches = (
        pair_training_batch(run, collate_preference(chunk, run.pad_token_id))
        for chunk in chunks(datums, run.val_batch_size)
    )
    metrics = eval_mode_metrics(
        run.policy, batches, run.loss_fn, micro_batch_size=2 * run.pairs_per_micro_batch, group_size=2
    )
    metrics["timing/validation"] = time.perf_counter() - started
    return metrics
