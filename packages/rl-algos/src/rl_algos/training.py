"""Machinery shared by the training loops.

- `ClusterSet`: Ray and the virtual clusters a run starts (shut down together), and the
  environment of CPU workers.
- `BatchStream`: batches of a resumable loader across epochs, up to a number of epochs.
- Metric reductions: per-optimizer-step lists to means (`mean_over_optimizer_steps`), means
  over batches (`WeightedMeans`), a loss's metrics over a whole dataset without updating the
  model (`eval_mode_metrics`).
- Checkpoints: the one to resume from (`find_resume_point`), the policy and data position
  (`write_policy_checkpoint`).
- `PolicyRunConfig`, `LoopConfig`, `PolicyRun` and `run_loop`: the common recipe sections and
  the step / validate / checkpoint loop of SFT, DPO, reward-model training and distillation;
  each algorithm supplies its step and validation functions.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Self, TypeVar

import torch
from pydantic import Field, model_validator

from rl_algos.backends import PolicyConfig
from rl_algos.base_model import BASE_MODEL_MARKER, BaseModelConfig
from rl_algos.config import ClusterConfig
from rl_algos.data.dataloader import StatefulDataLoader
from rl_core.checkpoint import CheckpointConfig, CheckpointManager
from rl_core.config import ConfigError, RLConfig
from rl_core.data import BatchedDataDict
from rl_core.interfaces import LossFunction, LossType
from rl_core.logging import Logger, LoggerConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rl_algos.backends import Policy
    from rl_algos.data.processors import PromptFormat
    from rl_core.distributed import RayVirtualCluster

BatchT = TypeVar("BatchT")

TRAINING_KEYS = ("input_ids", "input_lengths", "token_mask", "sample_mask")


# --------------------------------------------------------------------------------- clusters


def worker_env_vars(cluster: ClusterConfig) -> dict[str, str] | None:
    if cluster.use_gpus:
        return None
    # Ray starts CPU actors with one OpenMP thread; a CPU worker may use its whole bundle.
    return {"OMP_NUM_THREADS": str(max(1, int(cluster.cpus_per_worker)))}


class ClusterSet:
    """Starts (or joins) Ray as the `cluster` section says and keeps the virtual clusters the
    run creates, so they are shut down together."""

    def __init__(self, cfg: ClusterConfig) -> None:
        from rl_core.distributed import init_ray
        from rl_core.venvs import ENV_SINGLE_VENV

        if cfg.single_venv:
            os.environ[ENV_SINGLE_VENV] = "1"
        init_ray(num_cpus=cfg.num_cpus, num_gpus=None if cfg.use_gpus else 0)
        self.cfg = cfg
        self.clusters: list[RayVirtualCluster] = []

    @property
    def env_vars(self) -> dict[str, str] | None:
        return worker_env_vars(self.cfg)

    def make(self, name: str, workers_per_node: int, num_nodes: int = 1) -> RayVirtualCluster:
        from rl_core.distributed import RayVirtualCluster

        cluster = RayVirtualCluster(
            [workers_per_node] * num_nodes,
            use_gpus=self.cfg.use_gpus,
            num_gpus_per_node=max(workers_per_node, 1),
            num_cpus_per_bundle=self.cfg.cpus_per_worker,
            name=name,
        )
        self.clusters.append(cluster)
        return cluster

    def make_policy_cluster(self, name: str = "policy") -> RayVirtualCluster:
        return self.make(name, self.cfg.workers_per_node, self.cfg.num_nodes)

    def shutdown(self) -> None:
        for cluster in self.clusters:
            cluster.shutdown()
        self.clusters.clear()


# ------------------------------------------------------------------------------------- data


def load_tokenizer(name: str, key: str) -> PreTrainedTokenizerBase:
    """The tokenizer of a model directory (or hub id), with its pad token defaulting to eos as the
    workers do; one that cannot be loaded is a ConfigError naming the recipe key."""
    from transformers import AutoTokenizer

    path = Path(name).expanduser()
    # A hub id is `name` or `org/name`; anything else that does not exist is a missing directory.
    if not path.exists() and (path.is_absolute() or name.startswith(".") or len(path.parts) > 2):
        raise ConfigError(f"{key}: {name!r} is not a directory (nor a Hugging Face hub id)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{key}: cannot load a tokenizer from {name!r}: {exc}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


class DataExhaustedError(RuntimeError):
    """`max_num_epochs` passes over the training data are done."""


class BatchStream(Generic[BatchT]):
    """Batches across epochs, up to `max_num_epochs` passes; resumable through the loader."""

    def __init__(
        self, loader: StatefulDataLoader[Any, BatchT], max_num_epochs: int, what: str = "training data"
    ) -> None:
        self.loader = loader
        self.max_num_epochs = max_num_epochs
        self.what = what
        self._batches: Iterator[BatchT] | None = None

    def next_batch(self) -> BatchT:
        while True:
            if self._batches is None:
                if self.loader.epoch >= self.max_num_epochs:
                    raise DataExhaustedError(f"finished {self.max_num_epochs} epoch(s) of {self.what}")
                self._batches = iter(self.loader)
            batch = next(self._batches, None)
            if batch is not None:
                return batch
            self._batches = None

    def load(self, checkpoint_dir: Path) -> None:
        self.loader.load(checkpoint_dir)
        self._batches = None


def training_fields(batch: BatchedDataDict[Any], *extra: str) -> BatchedDataDict[Any]:
    """Only the tensors the workers train on (no message logs or other per-sample lists)."""
    return BatchedDataDict({key: batch[key] for key in (*TRAINING_KEYS, *extra)})


def pad_to_multiple(data: BatchedDataDict[Any], multiple: int, group_size: int = 1) -> BatchedDataDict[Any]:
    """`data` plus copies of its first `group_size` rows with `sample_mask` 0, up to a multiple of
    `multiple` rows: whole optimizer steps (or data-parallel shards) from a short batch, while the
    padding counts for nothing in a globally normalised loss. `group_size` keeps groups whole
    (2 for chosen/rejected pairs); `multiple` must be a multiple of it."""
    if multiple % group_size or data.size % group_size:
        raise ValueError(
            f"pad_to_multiple: {data.size} rows and multiple {multiple} must both be multiples of the "
            f"group size {group_size}"
        )
    missing = -data.size % multiple
    if missing == 0:
        return data
    filler = data.select_indices([i % group_size for i in range(missing)])
    filler["sample_mask"] = torch.zeros_like(filler["sample_mask"])
    return BatchedDataDict.from_batches([data, filler])


# ---------------------------------------------------------------------------------- metrics


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class WeightedMeans:
    """Means of per-batch metrics over several batches, weighted (e.g. by batch size)."""

    def __init__(self) -> None:
        self._sums: dict[str, float] = {}
        self._weights: dict[str, float] = {}

    def add(self, metrics: Mapping[str, float], weight: float) -> None:
        for key, value in metrics.items():
            self._sums[key] = self._sums.get(key, 0.0) + float(value) * weight
            self._weights[key] = self._weights.get(key, 0.0) + weight

    def means(self) -> dict[str, float]:
        return {key: total / self._weights[key] for key, total in self._sums.items() if self._weights[key]}


def mean_over_optimizer_steps(train_metrics: Mapping[str, Any]) -> dict[str, float]:
    """`Policy.train`'s per-step lists as their means; `num_steps` becomes `optimizer_steps`."""
    out: dict[str, float] = {}
    for key, value in train_metrics.items():
        if isinstance(value, list | tuple) and value:
            out[key] = float(sum(float(v) for v in value) / len(value))
        elif is_number(value):
            out[key] = float(value)
    out["optimizer_steps"] = out.pop("num_steps", 0.0)
    return out


# Per-step metrics of `Policy.train` that are bookkeeping, not means of the loss.
_STEP_BOOKKEEPING = ("global_valid_seqs", "global_valid_toks", "grad_norm", "lr")


def eval_mode_metrics(
    policy: Policy,
    batches: Iterable[BatchedDataDict[Any]],
    loss_fn: LossFunction,
    *,
    micro_batch_size: int | None = None,
    group_size: int = 1,
) -> dict[str, float]:
    """A loss's metrics over several batches without updating the model.

    Each batch is one eval-mode step (padded to whole data-parallel shards with rows that count
    for nothing). A step's metrics are means over its valid tokens (token-level loss) or valid
    sequences (sequence-level); they are combined with those counts as weights, so the result is
    the mean over the whole data. Counts (`num_*`) are summed.
    """
    means = WeightedMeans()
    counts: dict[str, float] = {}
    weight_key = "global_valid_toks" if loss_fn.loss_type is LossType.TOKEN_LEVEL else "global_valid_seqs"
    for batch in batches:
        padded = pad_to_multiple(batch, policy.dp_size * group_size, group_size)
        result = policy.train(padded, loss_fn, eval_mode=True, gbs=padded.size, mbs=micro_batch_size)
        for step in range(int(result["num_steps"])):
            weight = float(result[weight_key][step])
            if weight == 0:
                continue  # a step of padding rows only: nothing to average
            for key, values in result.items():
                if key == "num_steps" or key in _STEP_BOOKKEEPING:
                    continue
                if key.startswith("num_"):
                    counts[key] = counts.get(key, 0.0) + float(values[step])
                else:
                    means.add({key: float(values[step])}, weight)
    return {**means.means(), **counts}


def chunks(items: list[Any], size: int) -> list[list[Any]]:
    return [items[start : start + size] for start in range(0, len(items), size)]


# ------------------------------------------------------------------------------ checkpoints


@dataclass(frozen=True)
class ResumePoint:
    """The latest checkpoint of a run, with its training_info."""

    path: Path
    info: dict[str, Any]

    @property
    def weights_path(self) -> str:
        return str(self.path / "policy" / "weights")

    @property
    def optimizer_path(self) -> str:
        return str(self.path / "policy" / "optimizer")


def find_resume_point(checkpointer: CheckpointManager, identity: Mapping[str, Any]) -> ResumePoint | None:
    """The latest checkpoint, after checking it was written for the same `identity` (dotted config
    keys such as `policy.model_name`); None when checkpointing is off or there is none yet."""
    if not checkpointer.cfg.enabled:
        return None
    latest = checkpointer.get_latest_checkpoint_path()
    if latest is None:
        return None
    CheckpointManager.check_compatible(latest, identity)
    return ResumePoint(latest, CheckpointManager.load_training_info(latest))


def policy_identity(policy: PolicyConfig) -> dict[str, Any]:
    """What a checkpoint must have been written with to be resumed by a run of `policy`."""
    return {
        "policy.model_name": policy.model_name,
        "policy.tokenizer_name": policy.tokenizer_name,
        "policy.model_class": policy.model_class,
    }


def write_policy_checkpoint(directory: Path, policy: Policy, loader: StatefulDataLoader[Any, Any]) -> None:
    """`directory/policy/{weights,optimizer,tokenizer}` and `directory/dataloader.pt`."""
    policy_dir = directory / "policy"
    policy_dir.mkdir()
    policy.save_checkpoint(
        str(policy_dir / "weights"), str(policy_dir / "optimizer"), str(policy_dir / "tokenizer")
    )
    loader.save(directory)


# ------------------------------------------------------------------------- recipe sections


def check_base_model_marker(model_name: str, base_model: BaseModelConfig | None, key: str) -> None:
    if (model_name == BASE_MODEL_MARKER) != (base_model is not None):
        raise ValueError(
            f"{key}: '{BASE_MODEL_MARKER}' means 'the model the base_model section builds'; give both or neither"
        )


class PolicyRunConfig(RLConfig):
    """The sections of every recipe that trains one policy (the algorithm adds its own)."""

    policy: PolicyConfig
    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    checkpointing: CheckpointConfig = Field(default_factory=CheckpointConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    base_model: BaseModelConfig | None = None

    @model_validator(mode="after")
    def _base_model_marker(self) -> Self:
        check_base_model_marker(self.policy.model_name, self.base_model, "policy.model_name")
        return self


class LoopConfig(RLConfig):
    """Length, validation and export settings shared by the algorithm sections."""

    max_num_steps: int = Field(ge=1)
    max_num_epochs: int = Field(default=1_000_000, ge=1)
    val_period: int = Field(default=10, ge=0, description="validate every N steps; 0: never")
    val_at_start: bool = True
    val_at_end: bool = True
    seed: int = 42
    export_hf_dir: str | None = Field(
        default=None, description="write the final model here as a Hugging Face directory"
    )


@dataclass
class LoopState:
    """What a checkpoint's training_info records besides metrics."""

    step: int = 0
    consumed_samples: int = 0
    validation_history: list[tuple[int, float]] = field(default_factory=list)
    resumed_from: str | None = None

    def to_info(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "consumed_samples": self.consumed_samples,
            "validation_history": [list(entry) for entry in self.validation_history],
        }

    @classmethod
    def from_resume_point(cls, resume: ResumePoint | None) -> LoopState:
        if resume is None:
            return cls()
        info = resume.info
        history = [(int(step), float(value)) for step, value in info.get("validation_history", [])]
        return cls(int(info["step"]), int(info.get("consumed_samples", 0)), history, str(resume.path))


# ------------------------------------------------------------------------------------ setup


@dataclass
class PolicyStart:
    """A started policy and what the loop around it needs from setup."""

    clusters: ClusterSet
    policy_cfg: PolicyConfig  # model_name resolved (base_model built)
    policy: Policy
    config_to_save: dict[str, Any]
    checkpointer: CheckpointManager
    resume: ResumePoint | None


def start_policy(
    cfg: PolicyRunConfig,
    name: str,
    prompt: PromptFormat,
    policy_cfg: PolicyConfig | None = None,
) -> PolicyStart:
    """Start Ray, build the base model when the recipe asks for one, find the checkpoint to resume
    from and start the policy workers. `policy_cfg` overrides `cfg.policy`. The caller restores the
    checkpoint with `restore_from_checkpoint` once its loop parts exist."""
    from rl_algos.backends import make_policy
    from rl_algos.base_model import prepare_base_model

    policy_cfg = policy_cfg or cfg.policy
    if cfg.base_model is None:
        load_tokenizer(policy_cfg.tokenizer_path, "policy.model_name")  # a bad path fails before Ray starts
    clusters = ClusterSet(cfg.cluster)
    try:
        policy_cluster = clusters.make_policy_cluster(name)
        if cfg.base_model is not None:
            model_dir = prepare_base_model(
                cfg.base_model, prompt, policy_cfg, policy_cluster, cfg.logger, clusters.env_vars
            )
            policy_cfg = policy_cfg.model_copy(update={"model_name": str(model_dir), "tokenizer_name": None})
        config_to_save = cfg.to_dict()
        config_to_save["policy"] = policy_cfg.to_dict()
        checkpointer = CheckpointManager(cfg.checkpointing)
        resume = find_resume_point(checkpointer, policy_identity(policy_cfg))
        policy = make_policy(policy_cluster, policy_cfg, name_prefix=name, env_vars=clusters.env_vars)
    except BaseException:
        clusters.shutdown()
        raise
    return PolicyStart(clusters, policy_cfg, policy, config_to_save, checkpointer, resume)


# ------------------------------------------------------------------------------------- loop


@dataclass(kw_only=True)
class PolicyRun:
    """The parts every policy-training loop holds; algorithms subclass it with their own."""

    name: str
    loop: LoopConfig
    config_to_save: dict[str, Any]
    policy: Policy
    batches: BatchStream[BatchedDataDict[Any]]
    logger: Logger
    checkpointer: CheckpointManager
    state: LoopState
    clusters: ClusterSet
    # The validation metric recorded in the history and the end-of-run summary.
    validation_key: str = "loss"

    def shutdown_components(self) -> list[Callable[[], Any]]:
        """Everything to stop at the end, in order (subclasses add their own first)."""
        return [self.policy.shutdown, self.logger.close]


def restore_from_checkpoint(run: PolicyRun, resume: ResumePoint) -> None:
    """Continue where the checkpoint left off: the policy's weights, optimizer, LR schedule and RNG
    states (sampling included), the data position and the loop state. The reference weights stay
    those the policy was started with (the initial model)."""
    print(f"{run.name}: resuming from {resume.path} (step {resume.info['step']})", flush=True)
    run.policy.load_checkpoint(resume.weights_path, resume.optimizer_path)
    run.batches.load(resume.path)
    run.state = LoopState.from_resume_point(resume)


@dataclass
class LoopResult:
    final_step: int
    validation_history: list[tuple[int, float]]
    last_metrics: dict[str, Any]
    wall_time_s: float
    metrics_path: Path
    export_path: Path | None = None


StepFn = Callable[[int], dict[str, Any]]
ValidateFn = Callable[[], dict[str, Any]]


def run_loop(run: PolicyRun, step_fn: StepFn, validate_fn: ValidateFn | None) -> LoopResult:
    """Steps from the current state to `max_num_steps` (or the end of `max_num_epochs`), with
    validation every `val_period` steps and at the end, checkpoints every `save_period` steps and
    at the end, and the final model exported when `export_hf_dir` is set."""
    cfg = run.loop
    started = time.monotonic()
    if validate_fn is not None and cfg.val_at_start and run.state.step == 0:
        _validate_and_log(run, validate_fn, 0)
    last_metrics: dict[str, Any] = {}
    step = run.state.step
    saved_at = validated_at = -1
    while step < cfg.max_num_steps:
        try:
            metrics = step_fn(step + 1)
        except DataExhaustedError as done:
            print(f"{run.name}: {done}; stopping at step {step}", flush=True)
            break
        step += 1
        run.state.step = step
        last_metrics = metrics
        run.logger.log_metrics(metrics, step, prefix="train")
        is_last = step == cfg.max_num_steps
        if validate_fn is not None and (
            (cfg.val_period and step % cfg.val_period == 0) or (is_last and cfg.val_at_end)
        ):
            last_metrics.update(
                {f"validation/{k}": v for k, v in _validate_and_log(run, validate_fn, step).items()}
            )
            validated_at = step
        if run.checkpointer.should_save(step, is_last_step=is_last):
            save_run_checkpoint(run, step, last_metrics)
            saved_at = step
    if step > 0 and step < cfg.max_num_steps:
        # The data ran out: the last step gets the end-of-run validation and checkpoint too.
        if validate_fn is not None and cfg.val_at_end and validated_at != step:
            last_metrics.update(
                {f"validation/{k}": v for k, v in _validate_and_log(run, validate_fn, step).items()}
            )
        if run.checkpointer.cfg.enabled and saved_at != step and step > _latest_saved_step(run):
            save_run_checkpoint(run, step, last_metrics)
    export_path = None
    if cfg.export_hf_dir is not None:
        export_path = Path(run.policy.export_hf(cfg.export_hf_dir))
        print(f"{run.name}: exported the final model to {export_path}", flush=True)
    return LoopResult(
        step,
        list(run.state.validation_history),
        last_metrics,
        time.monotonic() - started,
        run.logger.metrics_path,
        export_path,
    )


def _latest_saved_step(run: PolicyRun) -> int:
    checkpoints = run.checkpointer.list_checkpoints()
    return checkpoints[-1][0] if checkpoints else -1


def _validate_and_log(run: PolicyRun, validate_fn: ValidateFn, step: int) -> dict[str, Any]:
    metrics = validate_fn()
    if metrics:
        run.logger.log_metrics(metrics, step, prefix="validation")
        if run.validation_key in metrics:
            history = [(s, v) for s, v in run.state.validation_history if s != step]
            run.state.validation_history = [*history, (step, float(metrics[run.validation_key]))]
    return metrics


def save_run_checkpoint(run: PolicyRun, step: int, metrics: Mapping[str, Any]) -> Path:
    """`step_N/{training_info.json, config.yaml, policy/{weights,optimizer,tokenizer}, dataloader.pt}`."""
    info = {**run.state.to_info(), **{key: value for key, value in metrics.items() if is_number(value)}}
    with run.checkpointer.save(step, info, run.config_to_save) as tmp:
        write_policy_checkpoint(tmp, run.policy, run.batches.loader)
    return run.checkpointer.checkpoint_dir / f"step_{step}"


def shutdown_run(run: PolicyRun) -> None:
    """Stop workers and the logger (each even if another fails), then the clusters."""
    for close in run.shutdown_components():
        try:
            close()
        except Exception as exc:  # shutting down the rest matters more than this one error
            print(f"{run.name}: shutdown: {exc}", flush=True)
    run.clusters.shutdown()


def summary(run: PolicyRun, result: LoopResult) -> str:
    """Human-readable end-of-run report: the validation curve, wall time, where the outputs are."""
    from rl_core.logging import format_duration

    lines = [f"{run.name} finished at step {result.final_step} in {format_duration(result.wall_time_s)}"]
    history = result.validation_history
    if history:
        key = run.validation_key
        (first_step, first), (last_step, last) = history[0], history[-1]
        lines.append(f"validation {key}: {first:.4f} at step {first_step} -> {last:.4f} at step {last_step}")
        lines.append("curve: " + ", ".join(f"{step}: {value:.4f}" for step, value in history))
    lines.append(f"metrics: {result.metrics_path}")
    if result.export_path is not None:
        lines.append(f"model: {result.export_path}")
    return "\n".join(lines)


def execute(run: PolicyRun, step_fn: StepFn, validate_fn: ValidateFn | None) -> LoopResult:
    """Train, print the summary and shut everything down (what the `rl` subcommands run)."""
    started = time.monotonic()
    try:
        result = run_loop(run, step_fn, validate_fn)
        result.wall_time_s = time.monotonic() - started
        print(summary(run, result), flush=True)
        return result
    finally:
        shutdown_run(run)
