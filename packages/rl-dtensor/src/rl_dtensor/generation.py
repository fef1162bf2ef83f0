"""`HFGenerationWorker` (Ray actor FQN `rl_dtensor.generation.HFGenerationWorker`).

An unsharded copy of the model per worker; workers are independent data-parallel replicas,
driven by `rl_core.policy.WorkerGroupGeneration`, and receive new weights through
`update_weights` as full tensors by name. Sampling is `rl_dtensor.sampling.generate_batch`, the
same code the policy worker uses for colocated generation.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from rl_core.data import BatchedDataDict
from rl_core.interfaces import WeightBucket
from rl_core.policy.config import HFGenerationConfig, SamplingConfig
from rl_dtensor.model_loading import choose_attn_implementation, load_causal_lm, load_tokenizer, move_module
from rl_dtensor.sampling import generate_batch
from rl_dtensor.weights import load_weights


class HFGenerationWorker:
    """One generation replica: a plain Hugging Face model on this process's device."""

    def __init__(self, config: HFGenerationConfig | Mapping[str, Any]) -> None:
        self.cfg = (
            config if isinstance(config, HFGenerationConfig) else HFGenerationConfig.model_validate(config)
        )
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        self.tokenizer = load_tokenizer(self.cfg.tokenizer_path)
        attn = choose_attn_implementation(self.cfg.attn_implementation, packing=False)
        self.model = load_causal_lm(self.cfg.model_name, self.cfg.torch_dtype, attn, self.device)
        self.model.eval()
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(self.cfg.seed + int(os.environ.get("RANK", "0")))

    def get_pad_token_id(self) -> int:
        return int(self.tokenizer.pad_token_id or 0)

    def generate(
        self,
        data: Mapping[str, Any],
        greedy: bool = False,
        sampling: SamplingConfig | Mapping[str, Any] | None = None,
    ) -> BatchedDataDict[Any]:

        batch = BatchedDataDict.ensure(data)
        out = generate_batch(
            self.model,
            self.tokenizer,
            batch["input_ids"].to(self.device),
            batch["input_lengths"].to(self.device),
            self.cfg.with_overrides(sampling),
            self.cfg.max_total_sequence_length,
            greedy=greedy,
            stop_strings=batch.get("stop_strings"),
            generator=self.generator,
        )
        return BatchedDataDict(out)

    def update_weights(self, weights: WeightBucket) -> bool:

        load_weights(self.model, {name: tensor.to(self.device) for name, tensor in weights.items()})
        return True

    def prepare_for_generation(self) -> bool:

        move_module(self.model, self.device)
        return True

    def finish_generation(self) -> bool:
        """Move the weights off the accelerator so a colocated trainer can use it."""

        if self.device.type == "cuda":
            move_module(self.model, "cpu")
            torch.cuda.empty_cache()
        return True

    def shutdown(self) -> bool:
        if hasattr(self, "model"):
            del self.model
        return True
