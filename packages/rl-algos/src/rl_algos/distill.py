"""On-policy distillation: the student generates, the teacher scores, the student matches the teacher.

Per step: `num_prompts_per_step` prompts, each answered `num_generations_per_prompt` times by
the student (its own rollout engine, `generation`); a teacher policy (its own workers, no
optimizer) returns the top-k of its logits at every position of those sequences
(`get_topk_logits`); the student takes one optimizer step of `DistillationLossFn` over the
generated tokens: forward, reverse or mixed KL between the two distributions on the teacher's
top-k (`loss_fn`). Validation generates from held-out prompts (greedy by default) and reports
the same KL (`loss`) and the student's probability mass on the teacher's top-k.

Top-k ids are only meaningful if both models use one vocabulary: setup compares the two
tokenizers' vocabularies and refuses a teacher whose logits are wider than the student's.
Both models' logits are scaled by `policy.generation.temperature` (the teacher is given the
student's sampling settings), then by `loss_fn.temperature`. `run_distill` is what
`rl distill` runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, Self

import torch
from pydantic import Field, model_validator

from rl_algos.backends import PolicyConfig
from rl_algos.base_model import BASE_MODEL_MARKER
from rl_algos.config import DatasetSection, GenerationBackendConfig, apply_backend_alias
from rl_algos.data.processors import PromptFormat
from rl_algos.losses import DistillationLossConfig, DistillationLossFn
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
)
from rl_core.config import ConfigError, RLConfig
from rl_core.data import BatchedDataDict
from rl_core.policy.config import DTypeName, ParallelConfig

if TYPE_CHECKING:
    from collections.abc import Callable

    from rl_algos.backends import Policy
    from rl_algos.data.processors import DatumSpec, ProcessedDataset
    from rl_core.interfaces import GenerationInterface


class DistillConfig(LoopConfig):
    """The `distill` section."""

    num_prompts_per_step: int = Field(ge=1)
    num_generations_per_prompt: int = Field(default=1, ge=1)
    topk_logits_k: int = Field(default=64, ge=1, description="teacher logits kept per position")
    val_batch_size: int = Field(default=64, ge=1, description="validation prompts per generate call")
    max_val_samples: int | None = Field(default=None, ge=1)
    val_greedy: bool = Field(default=True, description="validation answers by greedy decoding")

    @property
    def samples_per_step(self) -> int:
        return self.num_prompts_per_step * self.num_generations_per_prompt


class TeacherConfig(RLConfig):
    """The teacher: a model directory (or hub id) served by its own workers, inference only."""

    model_name: str
    tokenizer_name: str | None = None
    dtype: DTypeName = "float32"
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] | None = None
    logprob_batch_size: int = Field(default=8, ge=1)
    dtensor: ParallelConfig = Field(default_factory=ParallelConfig)
    workers_per_node: int = Field(default=1, ge=1)
    num_nodes: int = Field(default=1, ge=1)

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer_name or self.model_name

    def policy_config(self, student: PolicyConfig) -> PolicyConfig:
        """The teacher as an inference-only policy with the student's length limit and sampling
        settings (the temperature scales both models' logits alike)."""
        return PolicyConfig.model_validate(
            {
                "model_name": self.model_name,
                "tokenizer_name": self.tokenizer_name,
                "dtype": self.dtype,
                "attn_implementation": self.attn_implementation,
                "max_total_sequence_length": student.max_total_sequence_length,
                "train_global_batch_size": 1,
                "train_micro_batch_size": 1,
                "logprob_batch_size": self.logprob_batch_size,
                "generation": student.generation.model_dump(),
                "dtensor": self.dtensor.model_dump(),
                "reference_model": False,
                "seed": student.seed,
            }
        )


class DistillDataConfig(RLConfig):
    """Prompts the student answers (a `prompt` column; other columns are ignored)."""

    train: DatasetSection
    validation: DatasetSection | None = None
    prompt: PromptFormat = Field(default_factory=PromptFormat)
    shuffle: bool = True


class DistillMasterConfig(PolicyRunConfig):
    """A whole on-policy distillation recipe; `policy` is the student."""

    distill: DistillConfig
    loss_fn: DistillationLossConfig = Field(default_factory=DistillationLossConfig)
    teacher: TeacherConfig
    generation: GenerationBackendConfig = Field(default_factory=GenerationBackendConfig)
    data: DistillDataConfig

    _backend_alias = model_validator(mode="before")(apply_backend_alias)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.policy.model_class != "causal_lm":
            raise ValueError(
                f"policy.model_class: the student is a causal LM, got {self.policy.model_class!r}"
            )
        if self.teacher.model_name == BASE_MODEL_MARKER:
            raise ValueError(f"teacher.model_name: '{BASE_MODEL_MARKER}' names the student's base model only")
        samples, gbs = self.distill.samples_per_step, self.policy.train_global_batch_size
        if samples % gbs:
            raise ValueError(
                f"policy.train_global_batch_size ({gbs}) must divide distill.num_prompts_per_step x "
                f"distill.num_generations_per_prompt ({samples})"
            )
        return self


# ------------------------------------------------------------------------------ vocabulary


def check_shared_vocabulary(student_model: str, student_tokenizer: str, teacher: TeacherConfig) -> None:
    """Refuse a teacher whose token ids mean something else than the student's (a ConfigError
    naming both models and a token that differs), or whose logits are wider than the student's."""
    from transformers import AutoConfig

    def vocab_width(key: str, name: str) -> int:
        try:
            return int(AutoConfig.from_pretrained(name).vocab_size)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{key}: cannot load the model config of {name!r}: {exc}") from None

    student_vocab: dict[str, int] = load_tokenizer(student_tokenizer, "policy.model_name").get_vocab()
    teacher_vocab: dict[str, int] = load_tokenizer(teacher.tokenizer_path, "teacher.model_name").get_vocab()
    if student_vocab != teacher_vocab:
        differing = sorted(
            token
            for token in student_vocab.keys() | teacher_vocab.keys()
            if student_vocab.get(token) != teacher_vocab.get(token)
        )
        example = differing[0]
        raise ConfigError(
            f"teacher.model_name: the teacher's tokenizer ({teacher.tokenizer_path}, {len(teacher_vocab)} tokens) "
            f"and the student's ({student_tokenizer}, {len(student_vocab)} tokens) differ in {len(differing)} "
            f"token(s), e.g. {example!r} is {student_vocab.get(example)} for the student and "
            f"{teacher_vocab.get(example)} for the teacher; distilling top-k logits needs one shared vocabulary"
        )
    student_width = vocab_width("policy.model_name", student_model)
    teacher_width = vocab_width("teacher.model_name", teacher.model_name)
    if teacher_width > student_width:
        raise ConfigError(
            f"teacher.model_name: the teacher has {teacher_width} logits per position but the student "
            f"({student_model}) only {student_width}; its top-k ids could fall outside the student's vocabulary"
        )


# -------------------------------------------------------------------------------------- run


@dataclass(kw_only=True)
class DistillRun(PolicyRun):
    teacher: Policy
    generation: GenerationInterface
    loss_fn: DistillationLossFn
    validation: ProcessedDataset[DatumSpec] | None
    settings: DistillConfig
    pad_token_id: int
    # A rollout engine with its own copy of the weights needs them after every update (and at
    # the start, when the student was restored from a checkpoint).
    generation_shares_weights: bool
    generation_weights_stale: bool

    def shutdown_components(self) -> list[Callable[[], Any]]:
        return [self.generation.shutdown, self.teacher.shutdown, *super().shutdown_components()]


def setup(cfg: DistillMasterConfig) -> DistillRun:
    """Prompts are read first; then the student (resuming from the latest checkpoint), the
    vocabulary check, the teacher's workers and the student's rollout engine."""
    from rl_algos.backends import make_generation, make_policy
    from rl_algos.data.collate import collate_datums
    from rl_algos.data.dataloader import StatefulDataLoader
    from rl_algos.data.loading import load_records
    from rl_algos.data.processors import PromptProcessor, process_records
    from rl_core.logging import Logger

    train_records = load_records(cfg.data.train, ("prompt",))
    val_records = load_records(cfg.data.validation, ("prompt",)) if cfg.data.validation else None
    if cfg.base_model is None:
        check_shared_vocabulary(cfg.policy.model_name, cfg.policy.tokenizer_path, cfg.teacher)
    start = start_policy(cfg, "distill", cfg.data.prompt)
    teacher: Policy | None = None
    generation: GenerationInterface | None = None
    try:
        student_cfg = start.policy_cfg
        if cfg.base_model is not None:
            check_shared_vocabulary(student_cfg.model_name, student_cfg.tokenizer_path, cfg.teacher)
        teacher_cluster = start.clusters.make("teacher", cfg.teacher.workers_per_node, cfg.teacher.num_nodes)
        teacher = make_policy(
            teacher_cluster,
            cfg.teacher.policy_config(student_cfg),
            init_optimizer=False,
            name_prefix="teacher",
            env_vars=start.clusters.env_vars,
        )
        generation = make_generation(
            start.policy,
            student_cfg,
            cfg.generation,
            lambda workers: start.clusters.make("generation", workers),
            start.clusters.env_vars,
        )
        tokenizer = load_tokenizer(student_cfg.tokenizer_path, "policy.tokenizer_name")
        processor = PromptProcessor(tokenizer, cfg.data.prompt)
        train = process_records(train_records, processor)
        validation = process_records(val_records, processor) if val_records is not None else None
        pad_token_id = start.policy.pad_token_id
        loader = StatefulDataLoader(
            train,
            cfg.distill.num_prompts_per_step,
            partial(collate_datums, pad_token_id=pad_token_id),
            shuffle=cfg.data.shuffle,
            seed=cfg.distill.seed,
        )
        logger = Logger(cfg.logger, total_steps=cfg.distill.max_num_steps)
        logger.log_hyperparams(start.config_to_save)
    except BaseException:
        for component in (generation, teacher, start.policy):
            if component is not None:
                component.shutdown()
        start.clusters.shutdown()
        raise
    run = DistillRun(
        name="distill",
        loop=cfg.distill,
        config_to_save=start.config_to_save,
        policy=start.policy,
        batches=BatchStream(loader, cfg.distill.max_num_epochs, "training prompts"),
        logger=logger,
        checkpointer=start.checkpointer,
        state=LoopState(),
        clusters=start.clusters,
        validation_key="loss",
        teacher=teacher,
        generation=generation,
        loss_fn=DistillationLossFn(cfg.loss_fn),
        validation=validation,
        settings=cfg.distill,
        pad_token_id=pad_token_id,
        generation_shares_weights=cfg.generation.shares_policy_weights,
        generation_weights_stale=not cfg.generation.shares_policy_weights,
    )
    if start.resume is not None:
        restore_from_checkpoint(run, start.resume)
    return run


def student_sequences(run: DistillRun, prompts: BatchedDataDict[Any], greedy: bool) -> BatchedDataDict[Any]:
    """The student's answers as a training batch: prompt + answer tokens, with only the answer's
    tokens in `token_mask`."""
    from rl_algos.grpo import refit_generation

    generation = run.generation
    if run.generation_weights_stale:
        refit_generation(run.policy, generation, run.policy.cfg.refit_bucket_size_bytes)
        run.generation_weights_stale = False
    generation.prepare_for_generation()
    out = generation.generate(
        BatchedDataDict(input_ids=prompts["input_ids"], input_lengths=prompts["input_lengths"]), greedy=greedy
    )
    generation.finish_generation()
    total = out["unpadded_sequence_lengths"]
    first_generated = total - out["generation_lengths"]
    positions = torch.arange(out["output_ids"].shape[1])[None, :]
    generated = (positions >= first_generated[:, None]) & (positions < total[:, None])
    return BatchedDataDict(
        input_ids=out["output_ids"],
        input_lengths=total,
        token_mask=generated.to(torch.float32),
        sample_mask=torch.ones(total.shape[0], dtype=torch.float32),
        generation_lengths=out["generation_lengths"],
    )


def with_teacher_topk(run: DistillRun, data: BatchedDataDict[Any]) -> BatchedDataDict[Any]:
    """`data` plus the teacher's top-k logits and ids at every position (the loss's inputs)."""
    topk = run.teacher.get_topk_logits(
        BatchedDataDict({key: data[key] for key in ("input_ids", "input_lengths")}),
        run.settings.topk_logits_k,
    )
    out = BatchedDataDict(
        {key: data[key] for key in ("input_ids", "input_lengths", "token_mask", "sample_mask")}
    )
    out["teacher_topk_logits"] = topk["topk_logits"]
    out["teacher_topk_indices"] = topk["topk_indices"]
    return out


def distill_step(run: DistillRun, step: int) -> dict[str, Any]:
    """Generate with the student, score with the teacher, one optimizer step of the KL."""
    prompts = run.batches.next_batch()
    run.state.consumed_samples += prompts.size
    timings: dict[str, float] = {}
    started = time.perf_counter()
    sequences = student_sequences(
        run, prompts.repeat_interleave(run.settings.num_generations_per_prompt), greedy=False
    )
    timings["generation"] = time.perf_counter() - started
    started = time.perf_counter()
    data = with_teacher_topk(run, sequences)
    timings["teacher_topk"] = time.perf_counter() - started
    started = time.perf_counter()
    run.policy.prepare_for_training()
    train_metrics = run.policy.train(data, run.loss_fn)
    run.policy.finish_training()
    timings["train"] = time.perf_counter() - started
    run.generation_weights_stale = not run.generation_shares_weights
    metrics = mean_over_optimizer_steps(train_metrics)
    lengths = sequences["generation_lengths"].to(torch.float32)
    metrics["mean_generation_length"] = float(lengths.mean())
    metrics.update({f"timing/{phase}": seconds for phase, seconds in timings.items()})
    return metrics


def validate(run: DistillRun) -> dict[str, Any]:
    """The KL to the teacher (`loss`) and `student_topk_mass` on the student's answers to the
    validation prompts."""
    if run.validation is None:
        return {}
    from rl_algos.data.collate import collate_datums

    started = time.perf_counter()
    datums = run.validation.datums[: run.settings.max_val_samples]
    batches = (
        with_teacher_topk(
            run, student_sequences(run, collate_datums(chunk, run.pad_token_id), run.settings.val_greedy)
        )
        for chunk in chunks(datums, run.settings.val_batch_size)
    )
    metrics = eval_mode_metrics(run.policy, batches, run.loss_fn)
    metrics["timing/validation"] = time.perf_counter() - started
    return metrics


def run_distill(cfg: DistillMasterConfig) -> LoopResult:
    """Set up, train, print the summary and shut down (what `rl distill` runs)."""
    run = setup(cfg)
    return execute(
        run, partial(distill_step, run), partial(validate, run) if run.validation is not None else None
    )


__all__ = [
    "DistillConfig",
    "DistillDataConfig",
    "DistillMasterConfig",
    "DistillRun",
    "TeacherConfig",
    "check_shared_vocabulary",
    "distill_step",
    "run_distill",
    "setup",
    "student_sequences",
    "validate",
    "with_teacher_topk",
]
