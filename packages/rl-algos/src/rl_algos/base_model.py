"""A base model built by the project itself: tokenizer, tiny causal LM, supervised warm start.

No model hub is reachable from a fresh CPU machine, so the default recipe names a
`base_model` section instead of a hub model: a byte-level BPE tokenizer trained on the
arithmetic task's text, a randomly initialised Qwen2/Llama model of the given size, and a
short supervised warm start on an SFT dataset (by default the task's worked solutions)
through the same policy workers and `NLLLossFn` as any SFT run. The result is an ordinary
Hugging Face directory, cached under `<cache_dir>/<name>-<hash>` where the hash covers
everything that determines it, so a second run (or a resumed one) reuses it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Self

from pydantic import Field, model_validator

from rl_algos.config import DatasetSection
from rl_algos.data.arithmetic import LEVELS, ArithmeticDatasetSpec
from rl_algos.data.processors import PromptFormat, SFTFormat
from rl_core.config import RLConfig, to_plain

if TYPE_CHECKING:
    from rl_algos.backends import PolicyConfig
    from rl_core.distributed import RayVirtualCluster
    from rl_core.logging import LoggerConfig

# Bump when the build procedure changes, so cached models built the old way are not reused.
BUILD_VERSION = 2
BASE_MODEL_MARKER = "base_model"
COMPLETE_MARKER = "BUILD_COMPLETE.json"


class TinyModelConfig(RLConfig):
    """Tokenizer and architecture of the locally built model."""

    architecture: Literal["qwen2", "llama"] = "qwen2"
    vocab_size: int = Field(default=384, ge=261)
    split_digits: bool = Field(default=True, description="one token per digit")
    tokenizer_corpus_levels: list[int] = Field(default_factory=lambda: sorted(LEVELS))
    tokenizer_corpus_size: int = Field(default=2000, ge=1)
    hidden_size: int = Field(default=128, ge=8)
    num_layers: int = Field(default=2, ge=1)
    num_heads: int = Field(default=4, ge=1)
    num_kv_heads: int = Field(default=2, ge=1)
    intermediate_size: int = Field(default=384, ge=1)
    max_position_embeddings: int = Field(default=256, ge=8)
    tie_word_embeddings: bool = False
    seed: int = 0


class WarmStartConfig(RLConfig):
    """Supervised fine-tuning of the fresh model (NLL on the assistant turns)."""

    enabled: bool = True
    data: DatasetSection = Field(
        default_factory=lambda: ArithmeticDatasetSpec(format="sft", num_samples=8192, levels=[2])
    )
    num_steps: int = Field(default=300, ge=1)
    batch_size: int = Field(default=64, ge=1)
    micro_batch_size: int = Field(default=64, ge=1)
    learning_rate: float = Field(default=3e-3, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    warmup_steps: int = Field(default=20, ge=0)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    log_every: int = Field(default=25, ge=1, description="optimizer steps per progress line")
    seed: int = 0

    @model_validator(mode="after")
    def _sft_data(self) -> Self:
        if isinstance(self.data, ArithmeticDatasetSpec) and self.data.format != "sft":
            raise ValueError(
                f"warm_start.data: set format: sft for the warm start (got {self.data.format!r})"
            )
        if self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of micro_batch_size ({self.micro_batch_size})"
            )
        return self


class BaseModelConfig(RLConfig):
    name: str = "tiny-arithmetic"
    model: TinyModelConfig = Field(default_factory=TinyModelConfig)
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig)
    # None: $RL_CACHE_DIR/models, else ~/.cache/rl/models.
    cache_dir: str | None = None


def default_cache_root() -> Path:
    root = os.environ.get("RL_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "rl"


def base_model_dir(cfg: BaseModelConfig, prompt: PromptFormat, policy: PolicyConfig) -> Path:
    """Where the model `cfg` builds is cached: `<cache>/<name>-<hash of what determines it>`."""
    identity = {
        "version": BUILD_VERSION,
        "model": to_plain(cfg.model),
        "warm_start": to_plain(cfg.warm_start),
        "prompt": to_plain(prompt),
        # The warm start trains through the policy workers in this precision and length limit.
        "dtype": policy.dtype,
        "max_total_sequence_length": policy.max_total_sequence_length,
    }
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_root() / "models"
    return root.expanduser() / f"{cfg.name}-{digest}"


@contextlib.contextmanager
def _build_lock(target: Path) -> Iterator[None]:
    """One builder per cache entry at a time (concurrent runs wait for the first one)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def prepare_base_model(
    cfg: BaseModelConfig,
    prompt: PromptFormat,
    policy: PolicyConfig,
    cluster: RayVirtualCluster,
    logger_cfg: LoggerConfig,
    policy_env_vars: dict[str, str] | None = None,
) -> Path:
    """The cached model directory for `cfg`, building it first when it is not there yet."""
    target = base_model_dir(cfg, prompt, policy)
    if (target / COMPLETE_MARKER).is_file():
        print(f"base model: using the cached {target}", flush=True)
        return target
    with _build_lock(target):
        if (target / COMPLETE_MARKER).is_file():
            return target
        started = time.monotonic()
        print(f"base model: building {target} (once; later runs reuse it)", flush=True)
        work = target.with_name(f"tmp-{target.name}")
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        initial = _build_initial_model(cfg.model, work)
        result: dict[str, Any] = {}
        if cfg.warm_start.enabled:
            result = _warm_start(
                cfg.warm_start, initial, work / "model", prompt, policy, cluster, logger_cfg, policy_env_vars
            )
            shutil.rmtree(initial)
        else:
            initial.rename(work / "model")
        result["build_seconds"] = round(time.monotonic() - started, 1)
        (work / "model" / COMPLETE_MARKER).write_text(json.dumps(result, indent=2) + "\n")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(work / "model", target)
        shutil.rmtree(work, ignore_errors=True)
        print(f"base model: ready in {result['build_seconds']:.0f} s", flush=True)
    return target


def _build_initial_model(cfg: TinyModelConfig, work: Path) -> Path:
    from rl_algos.data.arithmetic import arithmetic_corpus
    from rl_algos.models.tiny import build_tiny_causal_lm, build_tokenizer

    build_tokenizer(
        arithmetic_corpus(cfg.tokenizer_corpus_size, levels=cfg.tokenizer_corpus_levels, seed=cfg.seed),
        cfg.vocab_size,
        work / "tokenizer",
        split_digits=cfg.split_digits,
    )
    return build_tiny_causal_lm(
        work / "tokenizer",
        work / "initial",
        arch=cfg.architecture,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        seed=cfg.seed,
    )


def _warm_start(
    cfg: WarmStartConfig,
    initial: Path,
    out_dir: Path,
    prompt: PromptFormat,
    policy_cfg: PolicyConfig,
    cluster: RayVirtualCluster,
    logger_cfg: LoggerConfig,
    policy_env_vars: dict[str, str] | None,
) -> dict[str, Any]:
    """SFT the initial model for `cfg.num_steps` optimizer steps and export it to `out_dir`."""
    from transformers import AutoTokenizer

    from rl_algos.backends import make_policy
    from rl_algos.data.collate import collate_datums
    from rl_algos.data.dataloader import StatefulDataLoader
    from rl_algos.data.loading import load_records
    from rl_algos.data.processors import SFTProcessor, process_records
    from rl_algos.losses import NLLLossFn
    from rl_core.data import BatchedDataDict
    from rl_core.logging import Logger

    tokenizer = AutoTokenizer.from_pretrained(str(initial))
    fmt = SFTFormat(**prompt.model_dump())
    dataset = process_records(load_records(cfg.data), SFTProcessor(tokenizer, fmt, task_name="warm_start"))
    pad_token_id = int(tokenizer.pad_token_id or 0)
    loader = StatefulDataLoader(
        dataset, cfg.batch_size, partial(collate_datums, pad_token_id=pad_token_id), seed=cfg.seed
    )
    sft_policy_cfg = policy_cfg.model_copy(
        update={
            "model_name": str(initial),
            "tokenizer_name": None,
            "train_global_batch_size": cfg.batch_size,
            "train_micro_batch_size": cfg.micro_batch_size,
            "optimizer": policy_cfg.optimizer.model_copy(
                update={"kwargs": {"lr": cfg.learning_rate, "weight_decay": cfg.weight_decay}}
            ),
            "scheduler": policy_cfg.scheduler.model_copy(
                update={
                    "name": "cosine",
                    "warmup_steps": cfg.warmup_steps,
                    "total_steps": cfg.num_steps,
                    "min_lr_ratio": cfg.min_lr_ratio,
                }
            ),
            "reference_model": False,
            "seed": cfg.seed,
        }
    )
    log_cfg = logger_cfg.model_copy(
        update={"log_dir": str(Path(logger_cfg.log_dir) / "warm_start"), "console_metrics": ["loss", "lr"]}
    )
    policy = make_policy(cluster, sft_policy_cfg, name_prefix="warm-start", env_vars=policy_env_vars)
    loss_fn = NLLLossFn()
    batches = _endless(loader)
    losses: list[float] = []
    try:
        with Logger(log_cfg, total_steps=cfg.num_steps) as logger:
            done = 0
            while done < cfg.num_steps:
                # Several optimizer steps per call: one round trip to the workers per progress line.
                count = min(cfg.log_every, cfg.num_steps - done)
                chunk = BatchedDataDict.from_batches(
                    [_training_fields(next(batches)) for _ in range(count)],
                    pad_value_dict={"input_ids": pad_token_id},
                )
                metrics = policy.train(chunk, loss_fn, gbs=cfg.batch_size, mbs=cfg.micro_batch_size)
                losses += [float(v) for v in metrics["loss"]]
                done += count
                logger.log_metrics(
                    {
                        "loss": metrics["loss"][-1],
                        "lr": metrics["lr"][-1],
                        "grad_norm": metrics["grad_norm"][-1],
                    },
                    done,
                    prefix="warm_start",
                )
        policy.export_hf(str(out_dir))
    finally:
        policy.shutdown()
    return {"warm_start_steps": cfg.num_steps, "first_loss": losses[0], "final_loss": losses[-1]}


def _training_fields(batch: Any) -> Any:
    return batch.__class__(
        {key: batch[key] for key in ("input_ids", "input_lengths", "token_mask", "sample_mask")}
    )


def _endless(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader
