"""Supervised fine-tuning: negative log-likelihood of the assistant turns.

Records are prompt/completion pairs or OpenAI-format conversations (tool calls included),
from local JSONL/JSON/Parquet files, a Hugging Face dataset or the built-in arithmetic task
(`format: sft`). Only assistant tokens are trained on (`SFTFormat.train_on` picks all assistant
turns or the last one); system, user and tool turns and the template's headers are masked.
Sequence packing and dynamic batching are the policy's (`policy.sequence_packing`,
`policy.dynamic_batching`). Validation reports the token-level loss on the validation set.

`setup` builds the run from a validated `SFTMasterConfig`; `sft_step` / `validate` are one step
and one validation pass; `run_sft` is what `rl sft` runs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Self

from pydantic import Field, model_validator

from rl_algos.config import DatasetSection
from rl_algos.data.arithmetic import ArithmeticDatasetSpec
from rl_algos.data.processors import SFTFormat
from rl_algos.losses import NLLLossFn
from rl_algos.training import (
    BatchStream,
    LoopConfig,
    LoopResult,
    LoopState,
    PolicyRun,
    PolicyRunConfig,
    chunks,
    eval_mode_metrics,
    execute,
    load_tokenizer,
    mean_over_optimizer_steps,
    restore_from_checkpoint,
    start_policy,
    training_fields,
)
from rl_core.config import RLConfig

if TYPE_CHECKING:
    from rl_algos.data.processors import DatumSpec, ProcessedDataset


class SFTConfig(LoopConfig):
    """The `sft` section. A step trains on `policy.train_global_batch_size` samples."""

    val_batch_size: int = Field(default=64, ge=1, description="validation samples per forward pass")
    max_val_samples: int | None = Field(default=None, ge=1)


class SFTDataConfig(RLConfig):
    train: DatasetSection
    validation: DatasetSection | None = None
    format: SFTFormat = Field(default_factory=SFTFormat)
    shuffle: bool = True

    @model_validator(mode="after")
    def _arithmetic_format(self) -> Self:
        for name, spec in (("train", self.train), ("validation", self.validation)):
            if isinstance(spec, ArithmeticDatasetSpec) and spec.format != "sft":
                raise ValueError(f"data.{name}: SFT needs the task's worked solutions; set format: sft")
        return self


class SFTMasterConfig(PolicyRunConfig):
    """A whole SFT recipe."""

    sft: SFTConfig
    data: SFTDataConfig


@dataclass(kw_only=True)
class SFTRun(PolicyRun):
    loss_fn: NLLLossFn
    validation: ProcessedDataset[DatumSpec] | None
    val_batch_size: int
    max_val_samples: int | None
    pad_token_id: int


def load_sft_datasets(
    cfg: SFTDataConfig, tokenizer_path: str
) -> tuple[ProcessedDataset[DatumSpec], ProcessedDataset[DatumSpec] | None]:
    """Read and tokenise the train (and validation) records; a bad record stops here."""
    from rl_algos.data.loading import load_records
    from rl_algos.data.processors import SFTProcessor, process_records

    tokenizer = load_tokenizer(tokenizer_path, "policy.tokenizer_name")
    processor = SFTProcessor(tokenizer, cfg.format)
    train = process_records(load_records(cfg.train), processor)
    validation = process_records(load_records(cfg.validation), processor) if cfg.validation else None
    return train, validation


def setup(cfg: SFTMasterConfig) -> SFTRun:
    """Records are read first (a missing file or bad line fails before Ray starts); then the
    policy (resuming from the latest checkpoint), the tokenised datasets and the loader."""
    from rl_algos.data.collate import collate_datums
    from rl_algos.data.dataloader import StatefulDataLoader
    from rl_algos.data.loading import load_records
    from rl_core.logging import Logger

    load_records(cfg.data.train)
    if cfg.data.validation is not None:
        load_records(cfg.data.validation)
    start = start_policy(cfg, "sft", cfg.data.format)
    try:
        train, validation = load_sft_datasets(cfg.data, start.policy_cfg.tokenizer_path)
        print(f"sft: training data {train.summary()}", flush=True)
        pad_token_id = start.policy.pad_token_id
        loader = StatefulDataLoader(
            train,
            cfg.policy.train_global_batch_size,
            partial(collate_datums, pad_token_id=pad_token_id),
            shuffle=cfg.data.shuffle,
            seed=cfg.sft.seed,
        )
        logger = Logger(cfg.logger, total_steps=cfg.sft.max_num_steps)
        logger.log_hyperparams(start.config_to_save)
    except BaseException:
        start.policy.shutdown()
        start.clusters.shutdown()
        raise
    run = SFTRun(
        name="sft",
        loop=cfg.sft,
        config_to_save=start.config_to_save,
        policy=start.policy,
        batches=BatchStream(loader, cfg.sft.max_num_epochs),
        logger=logger,
        checkpointer=start.checkpointer,
        state=LoopState(),
        clusters=start.clusters,
        validation_key="loss",
        loss_fn=NLLLossFn(),
        validation=validation,
        val_batch_size=cfg.sft.val_batch_size,
        max_val_samples=cfg.sft.max_val_samples,
        pad_token_id=pad_token_id,
    )
    if start.resume is not None:
        restore_from_checkpoint(run, start.resume)
    return run


def sft_step(run: SFTRun, step: int) -> dict[str, Any]:
    """One optimizer step on the next batch; its metrics."""
    batch = run.batches.next_batch()
    run.state.consumed_samples += batch.size
    started = time.perf_counter()
    run.policy.prepare_for_training()
    train_metrics = run.policy.train(training_fields(batch), run.loss_fn)
    run.policy.finish_training()
    seconds = time.perf_counter() - started
    metrics = mean_over_optimizer_steps(train_metrics)
    total_tokens = float(batch["input_lengths"].sum())
    metrics.update(
        mean_sequence_length=total_tokens / batch.size,
        num_trained_tokens=float(sum(train_metrics["global_valid_toks"])),
        **{"throughput/train_tokens_per_s": total_tokens / max(seconds, 1e-9), "timing/train": seconds},
    )
    return metrics


def validate(run: SFTRun) -> dict[str, Any]:
    """Token-level NLL over the validation set (`loss`; `perplexity` = exp(loss))."""
    if run.validation is None:
        return {}
    from rl_algos.data.collate import collate_datums

    started = time.perf_counter()
    datums = run.validation.datums[: run.max_val_samples]
    batches = (
        training_fields(collate_datums(chunk, run.pad_token_id))
        for chunk in chunks(datums, run.val_batch_size)
    )
    metrics = eval_mode_metrics(run.policy, batches, run.loss_fn)
    metrics["perplexity"] = math.exp(min(metrics["loss"], 50.0))
    metrics["timing/validation"] = time.perf_counter() - started
    return metrics


def run_sft(cfg: SFTMasterConfig) -> LoopResult:
    """Set up, train, print the summary and shut down (what `rl sft` runs)."""
    run = setup(cfg)
    return execute(
        run, partial(sft_step, run), partial(validate, run) if run.validation is not None else None
    )


__all__ = [
    "SFTConfig",
    "SFTDataConfig",
    "SFTMasterConfig",
    "SFTRun",
    "load_sft_datasets",
    "run_sft",
    "setup",
    "sft_step",
    "validate",
]
