"""What the spawned ranks of the DTensor worker tests run (see `dtensor_testing.run_ranks`).

Each scenario builds several real `DTensorPolicyWorker`s in one process group (spawning is the
expensive part) and returns the numbers the tests compare with single-process references.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from dtensor_testing import NLLLoss, full_params, policy_config

from rl_core.data import BatchedDataDict, DynamicBatchingArgs, SequencePackingArgs
from rl_dtensor.worker import DTensorPolicyWorker

PACKING = {"enabled": True, "train_mb_tokens": 40, "logprob_mb_tokens": 40, "algorithm": "ffd"}


def _rank() -> int:
    return int(os.environ["RANK"])


def _train_params(worker: DTensorPolicyWorker, data: BatchedDataDict[Any], **kwargs: Any) -> dict[str, Any]:
    metrics = worker.train(data, NLLLoss(), **kwargs)
    return {"metrics": metrics, "params": full_params(worker)}


def one_rank(
    model_dir: str, tied_model_dir: str, batch: BatchedDataDict[Any], work_dir: str
) -> dict[str, Any]:
    """Gradient accumulation, packing, dynamic batching, memory options, bf16 and tied
    embeddings on one rank; input errors."""
    out: dict[str, Any] = {}
    for mbs in (1, 8):
        worker = DTensorPolicyWorker(policy_config(model_dir, train_micro_batch_size=mbs))
        out[f"mbs{mbs}"] = _train_params(worker, batch, gbs=8, mbs=mbs)
        worker.shutdown()

    for name in ("activation_checkpointing", "cpu_offload"):
        worker = DTensorPolicyWorker(policy_config(model_dir, dtensor={name: True}))
        # The phase hooks around a refit must leave training intact.
        worker.offload_before_refit()
        worker.offload_after_refit()
        worker.prepare_for_training()
        out[name] = _train_params(worker, batch, gbs=8, mbs=3)
        worker.finish_training()
        worker.shutdown()

    bf16 = DTensorPolicyWorker(policy_config(model_dir, dtype="bfloat16"))
    out["bf16_logprobs"] = bf16.get_logprobs(batch)["logprobs"]
    out["bf16_refit_info"] = bf16.prepare_refit_info()
    out["bf16_loss"] = bf16.train(batch, NLLLoss(), gbs=8, mbs=4)["loss"]
    bf16.shutdown()

    tied = DTensorPolicyWorker(policy_config(tied_model_dir))
    out["tied"] = _train_params(tied, batch, gbs=8, mbs=2)
    tied.save_checkpoint(
        str(Path(work_dir) / "tied" / "weights"), tokenizer_path=str(Path(work_dir) / "tied" / "tokenizer")
    )
    tied.export_hf(str(Path(work_dir) / "tied_exported"))
    tied.shutdown()

    packed = DTensorPolicyWorker(policy_config(model_dir, sequence_packing=PACKING))
    (shard,), order = batch.shard_by_batch_size(1, None, sequence_packing_args=SequencePackingArgs(40, "ffd"))
    out["packed_logprobs"] = packed.get_logprobs(shard).reorder_data(order)["logprobs"]
    (train_shard,), _ = batch.shard_by_batch_size(1, 8, sequence_packing_args=SequencePackingArgs(40, "ffd"))
    out["packed_num_microbatches"] = train_shard.get_microbatch_iterator_for_packable_sequences_len()
    out["packed"] = _train_params(packed, train_shard, gbs=8)
    packed.shutdown()

    dynamic = DTensorPolicyWorker(policy_config(model_dir))
    (dyn_shard,), _ = batch.shard_by_batch_size(1, 8, dynamic_batching_args=DynamicBatchingArgs(48, 8))
    out["dynamic_num_microbatches"] = dyn_shard.get_microbatch_iterator_dynamic_shapes_len()
    out["dynamic"] = _train_params(dynamic, dyn_shard, gbs=8)

    too_long = BatchedDataDict(
        input_ids=torch.ones((2, 70), dtype=torch.long),
        input_lengths=torch.tensor([10, 70]),
        token_mask=torch.ones((2, 70), dtype=torch.long),
        sample_mask=torch.ones(2),
    )
    for method in ("get_logprobs", "train"):
        try:
            if method == "train":
                dynamic.train(too_long, NLLLoss(), gbs=2, mbs=1)
            else:
                dynamic.get_logprobs(too_long)
        except ValueError as exc:
            out[f"too_long_{method}"] = str(exc)
    dynamic.shutdown()
    return out


def _split_rows(batch: BatchedDataDict[Any]) -> BatchedDataDict[Any]:
    """This rank's rows of a plain dp=2 sharding (what the driver sends it)."""
    return batch.shard_by_batch_size(2, None, allow_uneven_shards=True)[_rank()]


def two_ranks(
    model_dir: str, batch: BatchedDataDict[Any], prompts: BatchedDataDict[Any], work_dir: str
) -> dict[str, Any]:
    """FSDP2 dp=2 and TP=2 (+SP): log-probs, one step, checkpoint/resume, export, generation."""
    rank = _rank()
    work = Path(work_dir)
    out: dict[str, Any] = {"rank": rank}

    # --- dp = 2: log-probs and the normalisation step (SGD, lr 1: the update is the gradient)
    dp2 = DTensorPolicyWorker(policy_config(model_dir))
    shard = batch.shard_by_batch_size(2, 8)[rank]
    out["dp2_logprobs"] = dp2.get_logprobs(shard)["logprobs"]
    # Uneven shards (3 rows over 2 ranks, micro-batches of 1): ranks run different numbers of
    # real forwards.
    out["uneven_logprobs"] = dp2.get_logprobs(_split_rows(batch.slice(0, 3)), micro_batch_size=1)["logprobs"]
    out["dp2_step"] = _train_params(dp2, shard, gbs=8, mbs=1)

    # Generation finishes at different steps on the two ranks (different max_new_tokens).
    generated = dp2.generate(_split_rows(prompts), sampling={"max_new_tokens": 6 + 4 * rank})
    out["generated"] = dict(generated)
    regenerated = BatchedDataDict(
        input_ids=generated["output_ids"], input_lengths=generated["unpadded_sequence_lengths"]
    )
    out["generated_train_logprobs"] = dp2.get_logprobs(regenerated)["logprobs"]
    out["reference_logprobs_after_step"] = dp2.get_reference_policy_logprobs(shard)["reference_logprobs"]
    buckets = list(dp2.stream_weights(20_000))
    out["bucket_bytes"] = [sum(t.numel() * t.element_size() for t in b.values()) for b in buckets]
    out["bucket_max_tensor_bytes"] = [max(t.numel() * t.element_size() for t in b.values()) for b in buckets]
    out["refit_info"] = dp2.prepare_refit_info()
    dp2.shutdown()

    # --- dp = 2 with planned, packed micro-batches (as the driver shards them)
    packed = DTensorPolicyWorker(policy_config(model_dir, sequence_packing=PACKING))
    args = SequencePackingArgs(40, "ffd")
    logprob_shards, logprob_order = batch.shard_by_batch_size(2, None, sequence_packing_args=args)
    out["dp2_packed_logprobs"] = packed.get_logprobs(logprob_shards[rank])["logprobs"]
    out["dp2_packed_logprob_order"] = logprob_order
    train_shards, _ = batch.shard_by_batch_size(2, 8, sequence_packing_args=args)
    out["dp2_packed_step"] = _train_params(packed, train_shards[rank], gbs=8)
    packed.shutdown()

    # --- checkpoint and resume (AdamW + warm-up/linear schedule + clipping: all stateful)
    stateful = policy_config(
        model_dir,
        optimizer={"name": "adamw", "kwargs": {"lr": 1e-2, "weight_decay": 0.01}},
        scheduler={"name": "linear", "warmup_steps": 1, "total_steps": 10},
        max_grad_norm=0.5,
    )
    two_steps = BatchedDataDict.from_batches([batch, batch])
    two_step_shard = two_steps.shard_by_batch_size(2, 8)[rank]
    first = DTensorPolicyWorker(stateful)
    first.train(shard, NLLLoss(), gbs=8)
    out["after_first_step"] = full_params(first)
    weights, optim, tokenizer = (str(work / "ckpt" / name) for name in ("weights", "optimizer", "tokenizer"))
    first.save_checkpoint(weights, optim, tokenizer)
    out["uninterrupted"] = _train_params(first, two_step_shard, gbs=8)
    out["export_logprobs"] = first.get_logprobs(shard)["logprobs"]
    out["export_topk"] = dict(first.get_topk_logits(shard, k=16))
    first.export_hf(str(work / "exported"))
    first.shutdown()
    resumed = DTensorPolicyWorker(stateful, weights_path=weights, optimizer_path=optim)
    out["resumed"] = _train_params(resumed, two_step_shard, gbs=8)
    resumed.shutdown()

    # --- TP = 2 with sequence parallel: both ranks hold the whole batch
    tp2 = DTensorPolicyWorker(
        policy_config(model_dir, dtensor={"tp_size": 2, "sequence_parallel": True}, max_grad_norm=0.05)
    )
    out["tp2_logprobs"] = tp2.get_logprobs(batch)["logprobs"]
    out["tp2_eval"] = tp2.train(batch, NLLLoss(), eval_mode=True, gbs=8, mbs=3)
    out["tp2_step"] = _train_params(tp2, batch, gbs=8, mbs=3)
    tp2.shutdown()

    tp2_packed = DTensorPolicyWorker(
        policy_config(model_dir, dtensor={"tp_size": 2, "sequence_parallel": True}, sequence_packing=PACKING)
    )
    out["tp2_packed_logprobs"] = tp2_packed.get_logprobs(batch)["logprobs"]
    out["tp2_packed_step"] = _train_params(tp2_packed, batch, gbs=8, mbs=3)
    tp2_packed.shutdown()
    return out
