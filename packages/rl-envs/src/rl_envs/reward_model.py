"""RLHF-style rewards from a sequence-classification reward model (Hugging Face directory)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from pydantic import Field

from rl_core.interfaces import EnvironmentInterface, EnvironmentReturn, MessageLog
from rl_envs.base import (
    EnvConfig,
    batch_message_logs,
    batch_rewards,
    check_batch,
    make_return,
    mean,
    response_length,
    validate_config,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RewardModelEnvConfig(EnvConfig):
    model_path: str = Field(description="local Hugging Face directory with the model and its tokenizer")
    batch_size: int = Field(default=8, ge=1, description="conversations per forward pass")
    max_length: int = Field(default=4096, ge=8, description="longer conversations keep their last tokens")
    device: str = Field(
        default="auto", description="'auto' (cuda when available), 'cpu', 'cuda', 'cuda:1', ..."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    score_mean: float = Field(default=0.0, description="reward = (score - score_mean) / score_std")
    score_std: float = Field(default=1.0, gt=0)


class RewardModelEnvironment(EnvironmentInterface):
    """Reward = the model's scalar score of the whole conversation (prompt + response).

    Each conversation is rendered with the tokenizer's chat template (roles and contents), the
    batch is right-padded, and the score is the single logit at the last real token, exactly
    what `AutoModelForSequenceClassification` computes for one unpadded conversation.
    """

    config_class = RewardModelEnvConfig
    name = "reward_model"

    def __init__(self, config: RewardModelEnvConfig | Mapping[str, Any] | None = None) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.config = validate_config(RewardModelEnvConfig, config, "env.reward_model")
        cfg = self.config
        if not os.path.isdir(cfg.model_path):
            raise FileNotFoundError(f"env.reward_model.model_path: {cfg.model_path!r} is not a directory")
        self.device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
        )
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
        if self.tokenizer.chat_template is None:
            raise ValueError(
                f"env.reward_model.model_path: the tokenizer in {cfg.model_path!r} has no chat template"
            )
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "right"
        self.tokenizer.truncation_side = "left"
        self.model = AutoModelForSequenceClassification.from_pretrained(
            cfg.model_path, dtype=_DTYPES[cfg.dtype]
        )
        if self.model.config.num_labels != 1:
            raise ValueError(
                f"env.reward_model.model_path: {cfg.model_path!r} has num_labels={self.model.config.num_labels}; "
                "a reward model outputs one score (num_labels=1)"
            )
        # The classification head pools the last token that is not padding.
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(self.device).eval()

    def render(self, message_log: Sequence[Mapping[str, Any]]) -> str:
        messages = [{"role": str(m["role"]), "content": str(m.get("content") or "")} for m in message_log]
        return str(self.tokenizer.apply_chat_template(messages, tokenize=False))

    @torch.no_grad()
    def score(self, message_logs: Sequence[Sequence[Mapping[str, Any]]]) -> torch.Tensor:
        """Raw scores [B] (float32), computed ``batch_size`` conversations at a time."""
        texts = [self.render(log) for log in message_logs]
        scores = []
        for start in range(0, len(texts), self.config.batch_size):
            encoded = self.tokenizer(
                texts[start : start + self.config.batch_size],
                padding=True,
                truncation=True,
                max_length=self.config.max_length,
                add_special_tokens=False,
                return_tensors="pt",
            ).to(self.device)
            logits = self.model(
                input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"]
            ).logits
            scores.append(logits[:, 0].float().cpu())
        return torch.cat(scores) if scores else torch.zeros(0)

    def step(self, message_log_batch: list[MessageLog], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        check_batch(message_log_batch, metadata, self.name)
        raw = self.score(message_log_batch)
        rewards = (raw - self.config.score_mean) / self.config.score_std
        n = len(message_log_batch)
        return make_return(
            observations=[{"role": "environment", "content": ""} for _ in range(n)],
            metadata=[None] * n,
            next_stop_strings=[None] * n,
            rewards=rewards.tolist(),
            terminateds=[True] * n,
            answers=[None] * n,
        )

    def global_post_process_and_metrics(self, batch: Any) -> tuple[Any, dict[str, Any]]:
        """mean/std/min/max of the rewards; mean_response_length with ``message_log``."""
        rewards = batch_rewards(batch)
        metrics: dict[str, Any] = {}
        if rewards.numel():
            metrics = {
                "mean_reward": float(rewards.mean()),
                "std_reward": float(rewards.std(unbiased=False)),
                "min_reward": float(rewards.min()),
                "max_reward": float(rewards.max()),
            }
        logs = batch_message_logs(batch)
        if logs is not None:
            metrics["mean_response_length"] = mean([float(response_length(log)) for log in logs])
        return batch, metrics

    def shutdown(self) -> None:
        self.model.to("cpu")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
