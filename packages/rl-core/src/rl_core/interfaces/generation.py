"""The rollout (generation backend) contract."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable
from typing import Any

from rl_core.interfaces.policy import WeightBucket


class GenerationInterface(ABC):
    """Batched text generation that returns the per-token log-probs of what it sampled.

    `data` has right-padded `input_ids` [B, T] and `input_lengths` [B] (optionally per-sample
    `stop_strings`). The result has `output_ids`, `logprobs`, `generation_lengths`,
    `unpadded_sequence_lengths` and `truncated` (see `rl_core.interfaces.specs`), in input order.
    """

    @abstractmethod
    def generate(self, data: Any, greedy: bool = False) -> Any:
        """Generate for the whole batch and return once every sample is done."""

    async def generate_async(self, data: Any, greedy: bool = False) -> AsyncIterator[tuple[int, Any]]:
        """Yield `(index_in_batch, single-sample output)` as samples finish.

        The default runs `generate` on the whole batch; engines with continuous batching
        override it so multi-turn and asynchronous RL do not wait for the slowest sample.
        """
        out = self.generate(data, greedy=greedy)
        for i in range(out.size):
            yield i, out.slice(i, i + 1)

    @abstractmethod
    def prepare_for_generation(self, **kwargs: Any) -> bool:
        """Wake the engine (load weights / KV cache onto the device). Idempotent."""

    @abstractmethod
    def finish_generation(self, **kwargs: Any) -> bool:
        """Release the device (e.g. sleep the engine) so training can use it."""

    @abstractmethod
    def update_weights(self, buckets: Iterable[WeightBucket]) -> bool:
        """Load new weights (full tensors, by parameter name) without restarting the engine."""

    def invalidate_kv_cache(self) -> bool:
        """Drop cached prefixes computed with old weights. Engines without a cache: no-op."""
        return True

    @abstractmethod
    def shutdown(self) -> bool:
        """Release workers and resources; idempotent."""
