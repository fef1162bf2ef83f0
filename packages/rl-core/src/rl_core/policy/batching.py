"""How the policy's batches are cut into micro-batches (shared by the driver and the workers)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import torch

from rl_core.data import BatchedDataDict, DynamicBatchingArgs, SequencePackingArgs
from rl_core.policy.config import PolicyConfig

Purpose = Literal["train", "logprob"]


def sharding_args(
    config: PolicyConfig, purpose: Purpose
) -> tuple[DynamicBatchingArgs | None, SequencePackingArgs | None]:
    """The `shard_by_batch_size` arguments for dynamic batching / sequence packing, if enabled."""
    if config.dynamic_batching.enabled:
        dyn = config.dynamic_batching
        budget = dyn.train_mb_tokens if purpose == "train" else dyn.logprob_mb_tokens
        return DynamicBatchingArgs(budget, _seq_multiple(config, dyn.sequence_length_round)), None
    if config.sequence_packing.enabled:
        pack = config.sequence_packing
        budget = pack.train_mb_tokens if purpose == "train" else pack.logprob_mb_tokens
        return None, SequencePackingArgs(budget, pack.algorithm, _seq_multiple(config, 1))
    return None, None


def _seq_multiple(config: PolicyConfig, base: int) -> int:
    # Sequence parallel splits the sequence dimension over the TP ranks.
    tp = config.dtensor.tp_size if config.dtensor.sequence_parallel else 1
    multiple = base
    while multiple % tp:
        multiple += base
    return multiple


def check_sequence_lengths(data: BatchedDataDict[Any], max_total_sequence_length: int) -> None:
    """A clear error for any sample longer than the configured maximum."""
    if "input_lengths" not in data:
        raise KeyError(f"the batch has no 'input_lengths' (keys: {sorted(data.keys())})")
    lengths = torch.as_tensor(data["input_lengths"])
    too_long = (lengths > max_total_sequence_length).nonzero()
    if too_long.numel():
        row = int(too_long[0, 0])
        raise ValueError(
            f"sample {row} has {int(lengths[row])} tokens, more than max_total_sequence_length="
            f"{max_total_sequence_length} ({too_long.numel()} sample(s) too long); raise "
            "policy.max_total_sequence_length or filter/truncate the data"
        )


def micro_batches(
    data: BatchedDataDict[Any], micro_batch_size: int, pad_token_id: int
) -> Iterator[BatchedDataDict[Any]]:
    """Micro-batches of a (step of a) shard: by the shard's plan if it has one, else fixed-size."""
    plan = data.microbatch_plan
    pads = {"input_ids": pad_token_id}
    if plan is None:
        return data.make_microbatch_iterator(micro_batch_size)
    if plan.kind == "dynamic_batching":
        return data.make_microbatch_iterator_with_dynamic_shapes(pads)
    return data.make_microbatch_iterator_for_packable_sequences(pads)
