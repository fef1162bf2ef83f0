"""The policy (training backend) contract."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

import torch

from rl_core.interfaces.loss import LossFunction

WeightBucket = dict[str, torch.Tensor]
"""A size-bounded group of full (unsharded) parameters, name -> tensor, for refit."""


class PolicyInterface(ABC):
    """A trainable language model, possibly sharded over many workers.

    Inputs and outputs are `BatchedDataDict`s whose keys follow `rl_core.interfaces.specs`.
    Implementations shard batches across their data-parallel ranks themselves.
    """

    @abstractmethod
    def get_logprobs(self, data: Any, micro_batch_size: int | None = None) -> Any:
        """Per-token log-probs under the current policy: `{"logprobs": [B, T]}`.

        Logits are divided by the generation temperature first, so the numbers are comparable
        with the rollout engine's. Position 0 (no prediction) is 0.
        """

    @abstractmethod
    def get_reference_policy_logprobs(self, data: Any, micro_batch_size: int | None = None) -> Any:
        """Per-token log-probs under the frozen initial weights: `{"reference_logprobs": [B, T]}`."""

    @abstractmethod
    def get_topk_logits(self, data: Any, k: int, micro_batch_size: int | None = None) -> Any:
        """`{"topk_logits": [B, T, k], "topk_indices": [B, T, k]}` (for distillation)."""

    @abstractmethod
    def train(
        self,
        data: Any,
        loss_fn: LossFunction,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
    ) -> dict[str, Any]:
        """Run optimiser steps over `data` (one per `gbs` samples) and return reduced metrics.

        With `eval_mode` the loss is computed but no step is taken.
        """

    @abstractmethod
    def prepare_for_training(self) -> None:
        """Bring parameters and optimiser state onto the training device."""

    @abstractmethod
    def finish_training(self) -> None:
        """Training phase over (e.g. release gradients)."""

    def prepare_for_lp_inference(self) -> None:  # noqa: B027 - optional hook
        """Bring parameters onto the device for log-prob computation."""

    @abstractmethod
    def save_checkpoint(
        self,
        weights_path: str,
        optimizer_path: str | None = None,
        tokenizer_path: str | None = None,
    ) -> None:
        """Save model (and optimiser, scheduler, RNG) state; see `load_checkpoint`."""

    def offload_before_refit(self) -> None:  # noqa: B027 - optional hook
        """Move optimiser state off the accelerator before weights are exported."""

    def offload_after_refit(self) -> None:  # noqa: B027 - optional hook
        """Move parameters off the accelerator once the generation engine has them."""

    @abstractmethod
    def prepare_refit_info(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Name -> (full shape, dtype name) of every parameter the generation engine needs."""

    @abstractmethod
    def stream_weights(self, bucket_size_bytes: int) -> Iterator[WeightBucket]:
        """Yield the full (unsharded) weights in buckets of at most `bucket_size_bytes`."""

    @abstractmethod
    def shutdown(self) -> bool:
        """Release workers and resources; idempotent."""
