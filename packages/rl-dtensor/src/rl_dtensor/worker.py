"""`DTensorPolicyWorker`: one rank of a policy held as a Hugging Face model sharded with FSDP2 (+TP).

A plain class: `RayWorkerGroup` turns it into a Ray actor (FQN
`rl_dtensor.worker.DTensorPolicyWorker`) with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT
set; tests may also run it directly in processes they spawn. Every method that touches the
model is collective: all ranks of the group call it together, each with its own data shard
(the driver, `rl_core.policy.Policy`, shards over `dp` and replicates over `tp`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from rl_core.data import BatchedDataDict
from rl_core.interfaces import LossFunction, WeightBucket
from rl_core.ops import token_logprobs
from rl_core.policy.batching import check_sequence_lengths, micro_batches
from rl_core.policy.config import PolicyConfig, SamplingConfig
from rl_core.policy.optim import build_optimizer, build_scheduler
from rl_core.policy.refit import RefitInfo, refit_info
from rl_dtensor.checkpoint import load_sharded_checkpoint, save_sharded_checkpoint
from rl_dtensor.distributed_env import init_distributed
from rl_dtensor.forward import ForwardLayout, causal_lm_logits, sequence_scores, zero_beyond_lengths
from rl_dtensor.grad_norm import clip_grad_norm
from rl_dtensor.model_loading import (
    choose_attn_implementation,
    load_causal_lm,
    load_sequence_classifier,
    load_tokenizer,
    move_module,
)
from rl_dtensor.parallelize import ParallelDims, build_device_mesh, parallelize_model
from rl_dtensor.sampling import generate_batch
from rl_dtensor.weights import (
    ReferenceWeights,
    full_state_dict,
    gather_weights,
    save_hf_directory,
    stream_weights,
)

TRAIN_KEYS = ("input_ids", "input_lengths", "token_mask", "sample_mask")
SAMPLING_GENERATOR_KEY = "sampling_generator"



def _to_number(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().sum())
    return float(value)


class DTensorPolicyWorker:
    """One rank of the DTensor policy. See the module docstring."""

    def __init__(
        self,
        config: PolicyConfig | Mapping[str, Any],
        weights_path: str | None = None,
        optimizer_path: str | None = None,
        init_optimizer: bool = True,
    ) -> None:
        self.cfg = (
            config if isinstance(config, PolicyConfig) else PolicyConfig.model_validate(config)
        )
        cfg = self.cfg
        env = init_distributed()
        self.rank, self.world_size, self.device = env.rank, env.world_size, env.device
        self.dims = ParallelDims.from_world(env.world_size, cfg.dtensor.tp_size)
        self.mesh = build_device_mesh(self.dims, self.device.type)
        self.dp_group = self.mesh["dp"].get_group()
        self.dp_rank = self.mesh.get_local_rank("dp")
        torch.manual_seed(cfg.seed)

        self.tokenizer = load_tokenizer(cfg.tokenizer_path)
        attn = choose_attn_implementation(cfg.attn_implementation, packing=cfg.sequence_packing.enabled)
        # Master weights in float32; FSDP mixed precision computes in cfg.dtype.
        if cfg.model_class == "sequence_classification":
            pad_id = int(self.tokenizer.pad_token_id or 0)
            self.model = load_sequence_classifier(cfg.model_name, torch.float32, cfg.num_labels, pad_id, attn)
        else:
            self.model = load_causal_lm(cfg.model_name, torch.float32, attn, device="cpu")
        self.hf_config = self.model.config
        # Exports and checkpoints describe the model as loaded (a causal LM loaded with a
        # classification head is saved as the classifier).
        self.hf_config.architectures = [type(self.model).__name__]
        parallelize_model(
            self.model,
            self.mesh,
            compute_dtype=cfg.torch_dtype,
            sequence_parallel=cfg.dtensor.sequence_parallel,
            activation_checkpointing=cfg.dtensor.activation_checkpointing,
            cpu_offload=cfg.dtensor.cpu_offload,
        )
        self._fsdp_modules = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        # Gradients are summed over dp ranks: each rank's loss is already divided by the global
        # token/sequence count, so the sum is the gradient of the whole global batch.
        # A plain SUM (not NCCL's PREMUL_SUM, which gloo lacks) is all a factor of 1 needs.
        for module in self._fsdp_modules:
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
        self.pad_token_id = int(self.tokenizer.pad_token_id or 0)
        self.layout = ForwardLayout(
            packed=cfg.sequence_packing.enabled,
            seq_multiple=self.dims.tp if cfg.dtensor.sequence_parallel else 1,
            varlen_attention=attn == "flash_attention_2",
            pad_token_id=self.pad_token_id,
            compute_dtype=cfg.torch_dtype,
        )
        self.reference = ReferenceWeights(self.model) if cfg.reference_model else None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        if init_optimizer:
            self.optimizer = build_optimizer(
                cfg.optimizer.name, self.model.parameters(), dict(cfg.optimizer.kwargs)
            )
            sched = cfg.scheduler
            self.scheduler = build_scheduler(
                self.optimizer, sched.name, sched.warmup_steps, sched.total_steps, sched.min_lr_ratio
            )
        self.generator = torch.Generator(device=self.device)
        # TP ranks of one replica see the same data and must sample the same tokens.
        self.generator.manual_seed(cfg.seed + self.dp_rank)
        if weights_path is not None:
            self.load_checkpoint(weights_path, optimizer_path)

    def get_pad_token_id(self) -> int:
        return self.pad_token_id

    @property
    def _is_classifier(self) -> bool:
        return self.cfg.model_class == "sequence_classification"

    def _require_causal_lm(self, what: str) -> None:
        if self._is_classifier:
            raise RuntimeError(
                f"{what} needs a causal LM, but this policy has model_class='sequence_classification' "
                "(it outputs one score per sequence, not token distributions)"
            )

    def _train_outputs(self, mb: BatchedDataDict[Any]) -> torch.Tensor:
        """What the loss sees: per-token logits [B, T, V] (temperature-scaled like the log-probs
        of generation), or for a sequence classifier the head's output [B, num_labels] at each
        sequence's last token."""
        if self._is_classifier:
            head = self.model.get_submodule("score")
            return sequence_scores(self.model, head, mb["input_ids"], mb["input_lengths"], self.layout)
        logits = causal_lm_logits(self.model, mb["input_ids"], mb["input_lengths"], self.layout)
        temperature = self.cfg.generation.temperature
        return logits / temperature if temperature != 1.0 else logits

    def _reshard(self) -> None:
        """Return every FSDP module to its sharded state.

        After a forward outside training, the root keeps its parameters gathered (FSDP's default
        for the root), and `named_parameters()` then yields those compute-dtype copies instead of
        the sharded float32 masters. Anything that reads or writes the parameters by name
        (weight export, checkpoints, the reference swap) calls this first.
        """
        for module in self._fsdp_modules:
            module.reshard()

    # ------------------------------------------------------------------------------ inference

    def _inference_forward(
        self,
        data: Mapping[str, Any],
        micro_batch_size: int | None,
        per_micro_batch: Callable[[torch.Tensor, BatchedDataDict[Any]], dict[str, torch.Tensor]],
    ) -> BatchedDataDict[Any]:
        """Run `per_micro_batch(logits, micro_batch)` over the shard; outputs `[b, t, ...]` are
        concatenated in the shard's row order and right-padded with 0 to its width."""
        self._require_causal_lm("token log-probs / top-k logits")
        batch = BatchedDataDict.ensure(data)
        check_sequence_lengths(batch, self.cfg.max_total_sequence_length)
        self.model.eval()
        mbs = list(micro_batches(batch, micro_batch_size or self.cfg.logprob_batch_size, self.pad_token_id))
        # FSDP forwards are collective: a rank with fewer micro-batches (uneven shards) runs
        # throw-away forwards on a 1-token batch until every rank is done.
        num_forwards = self._max_over_dp(len(mbs))
        outputs: list[BatchedDataDict[Any]] = []
        with torch.no_grad():
            for index in range(num_forwards):
                if index < len(mbs):
                    mb = mbs[index].to(self.device)
                    logits = causal_lm_logits(self.model, mb["input_ids"], mb["input_lengths"], self.layout)
                    outputs.append(
                        BatchedDataDict({k: v.cpu() for k, v in per_micro_batch(logits, mb).items()})
                    )
                else:
                    idle = torch.full((1, 1), self.pad_token_id, dtype=torch.long, device=self.device)
                    one = torch.ones(1, dtype=torch.long, device=self.device)
                    causal_lm_logits(self.model, idle, one, self.layout)
        # A zero-row output of the shard's full width: from_batches pads every micro-batch's
        # outputs to it, and an empty shard still yields correctly shaped (empty) outputs.
        self._reshard()
        width = batch["input_ids"].shape[1]
        template_logits = torch.zeros((0, width, self.hf_config.vocab_size))
        outputs.append(BatchedDataDict(per_micro_batch(template_logits, batch.slice(0, 0))))
        result = BatchedDataDict.from_batches(outputs)
        return result.truncate_tensors(1, width)

    def _max_over_dp(self, value: int) -> int:
        if self.dims.dp == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.dp_group)
        return int(tensor.item())

    def _logprobs(
        self, data: Mapping[str, Any], micro_batch_size: int | None, key: str
    ) -> BatchedDataDict[Any]:
        temperature = self.cfg.generation.temperature

        def per_mb(logits: torch.Tensor, mb: BatchedDataDict[Any]) -> dict[str, torch.Tensor]:
            lp = token_logprobs(logits, mb["input_ids"], temperature)
            return {key: zero_beyond_lengths(lp, mb["input_lengths"])}

        return self._inference_forward(data, micro_batch_size, per_mb)

    def get_logprobs(
        self, data: Mapping[str, Any], micro_batch_size: int | None = None
    ) -> BatchedDataDict[Any]:
        """`{"logprobs": [B, T]}` of this rank's shard (see `PolicyInterface.get_logprobs`)."""
        return self._logprobs(data, micro_batch_size, "logprobs")

    def get_reference_policy_logprobs(
        self, data: Mapping[str, Any], micro_batch_size: int | None = None
    ) -> BatchedDataDict[Any]:
        """`{"reference_logprobs": [B, T]}` under the frozen initial weights."""
        if self.reference is None:
            raise RuntimeError(
                "this policy was built with reference_model=False; it has no reference weights"
            )
        self._reshard()
        with self.reference.swapped_in(self.model):
            return self._logprobs(data, micro_batch_size, "reference_logprobs")

    def get_topk_logits(
        self, data: Mapping[str, Any], k: int, micro_batch_size: int | None = None
    ) -> BatchedDataDict[Any]:
        """Top-k of the temperature-scaled logits at every position (0 / index 0 past the length)."""
        if k < 1 or k > self.hf_config.vocab_size:
            raise ValueError(f"k={k} must be in [1, vocab_size={self.hf_config.vocab_size}]")
        temperature = self.cfg.generation.temperature

        def per_mb(logits: torch.Tensor, mb: BatchedDataDict[Any]) -> dict[str, torch.Tensor]:
            values, indices = torch.topk(logits.float() / temperature, k, dim=-1)
            return {
                "topk_logits": zero_beyond_lengths(values, mb["input_lengths"]),
                "topk_indices": zero_beyond_lengths(indices, mb["input_lengths"]),
            }

        return self._inference_forward(data, micro_batch_size, per_mb)

    # -------------------------------------------------------------------------------- training

    def _all_reduce_sum(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.dp_group)
        return [float(v) for v in tensor.tolist()]

    def _global_counts(self, step_batch: BatchedDataDict[Any]) -> tuple[float, float]:
        """(valid sequences, valid tokens) of the whole global batch of this optimiser step."""
        sample_mask = step_batch["sample_mask"].float()
        token_mask = step_batch["token_mask"][:, 1:].float()
        local_toks = float((token_mask * sample_mask[:, None]).sum())
        local_seqs = float(sample_mask.sum())
        seqs, toks = self._all_reduce_sum([local_seqs, local_toks])
        return seqs, toks

    def _num_steps(self, batch: BatchedDataDict[Any], gbs: int) -> tuple[int, int | None]:
        plan = batch.microbatch_plan
        if plan is not None:
            return len(plan.steps), None
        if gbs % self.dims.dp != 0:
            raise ValueError(
                f"global batch size {gbs} is not divisible by the data-parallel size {self.dims.dp}"
            )
        local_gbs = gbs // self.dims.dp
        if batch.size % local_gbs != 0:
            raise ValueError(
                f"this rank's shard has {batch.size} samples, not a multiple of the per-rank batch "
                f"{local_gbs} (global batch size {gbs} / dp {self.dims.dp})"
            )
        return batch.size // local_gbs, local_gbs

    def train(
        self,
        data: Mapping[str, Any],
        loss_fn: LossFunction,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
    ) -> dict[str, Any]:
        """One optimiser step per global batch of this rank's shard; metrics reduced over dp.

        Returns plain Python values: per step `loss` (the global batch's loss), `grad_norm`,
        `lr`, `global_valid_seqs`, `global_valid_toks`, and every metric of the loss function
        summed over micro-batches and ranks; plus `num_steps`.
        """
        batch = BatchedDataDict.ensure(data)
        missing = [key for key in TRAIN_KEYS if key not in batch]
        if missing:
            raise KeyError(f"train: the batch lacks {missing} (has {sorted(batch.keys())})")
        check_sequence_lengths(batch, self.cfg.max_total_sequence_length)
        if not eval_mode and self.optimizer is None:
            raise RuntimeError("train: this worker was built with init_optimizer=False")
        gbs = gbs or self.cfg.train_global_batch_size
        mbs = mbs or self.cfg.train_micro_batch_size
        num_steps, local_gbs = self._num_steps(batch, gbs)
        self.model.train(not eval_mode)
        history: dict[str, list[float]] = {}
        for step in range(num_steps):
            step_batch = batch.get_batch(step, local_gbs)
            global_seqs, global_toks = self._global_counts(step_batch)
            # A step without valid tokens contributes a zero loss instead of 0/0.
            seqs_divisor = torch.tensor(max(global_seqs, 1.0), device=self.device)
            toks_divisor = torch.tensor(max(global_toks, 1.0), device=self.device)
            if not eval_mode:
                assert self.optimizer is not None
                self.optimizer.zero_grad(set_to_none=True)
            loss_sum = 0.0
            metric_sums: dict[str, float] = {}
            with torch.set_grad_enabled(not eval_mode):
                for mb in micro_batches(step_batch, mbs, self.pad_token_id):
                    mb = mb.to(self.device)
                    loss, metrics = loss_fn(self._train_outputs(mb), mb, seqs_divisor, toks_divisor)
                    if not eval_mode:
                        loss.backward()
                    loss_sum += float(loss.detach())
                    for key, value in metrics.items():
                        metric_sums[key] = metric_sums.get(key, 0.0) + _to_number(value)
            keys = sorted(metric_sums)
            reduced = self._all_reduce_sum([loss_sum, *(metric_sums[k] for k in keys)])
            record = {"loss": reduced[0], **dict(zip(keys, reduced[1:]))}
            record["global_valid_seqs"] = global_seqs
            record["global_valid_toks"] = global_toks
            if not eval_mode:
                assert self.optimizer is not None and self.scheduler is not None
                record["grad_norm"] = float(clip_grad_norm(self.model.parameters(), self.cfg.max_grad_norm))
                record["lr"] = float(self.scheduler.get_last_lr()[0])
                self.optimizer.step()
                self.scheduler.step()
            for key, value in record.items():
                history.setdefault(key, []).append(value)
        if not eval_mode:
            assert self.optimizer is not None
            self.optimizer.zero_grad(set_to_none=True)
        self._reshard()
        return {"num_steps": num_steps, **history}

    # ------------------------------------------------------------------------------ generation

    @contextmanager
    def _params_gathered(self) -> Iterator[None]:
        """Keep FSDP parameters unsharded across forwards (one all-gather per generate call).

        The root module keeps its parameters after forward anyway (FSDP's default for the root);
        the decoder layers normally reshard and are switched for the duration.
        """
        layers = [module for module in self._fsdp_modules if module is not self.model]
        for module in layers:
            module.set_reshard_after_forward(False, recurse=False)
        try:
            yield
        finally:
            for module in layers:
                module.set_reshard_after_forward(True, recurse=False)
            for module in self._fsdp_modules:
                module.reshard()

    def _all_ranks_done(self, local_done: bool) -> bool:
        flag = torch.tensor([1 if local_done else 0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def generate(
        self,
        data: Mapping[str, Any],
        greedy: bool = False,
        sampling: SamplingConfig | Mapping[str, Any] | None = None,
    ) -> BatchedDataDict[Any]:
        """Generate with the policy's own model (colocated rollouts; no weight transfer).

        `sampling` overrides the configured `generation` settings for this call.
        """
        self._require_causal_lm("generate")
        batch = BatchedDataDict.ensure(data)
        params = self.cfg.generation.with_overrides(sampling)
        self.model.eval()
        with self._params_gathered():
            out = generate_batch(
                self.model,
                self.tokenizer,
                batch["input_ids"].to(self.device),
                batch["input_lengths"].to(self.device),
                params,
                self.cfg.max_total_sequence_length,
                greedy=greedy,
                stop_strings=batch.get("stop_strings"),
                generator=self.generator,
                all_done=self._all_ranks_done if self.world_size > 1 else None,
            )
        return BatchedDataDict(out)

    # --------------------------------------------------------------------- memory / phases

    def _move_optimizer_state(self, device: torch.device | str) -> None:
        if self.optimizer is None:
            return
        for state in self.optimizer.state.values():
            for key, value in state.items():
                # Adam keeps its step counter on the CPU unless `capturable`; leave it there.
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(device)

    def _move_model(self, device: torch.device | str) -> None:
        # With FSDP CPU offload the sharded parameters live on the CPU by design.
        if not self.cfg.dtensor.cpu_offload:
            move_module(self.model, device)

    def prepare_for_training(self) -> None:
        self._move_model(self.device)
        self._move_optimizer_state(self.device)
        self.model.train()

    def prepare_for_lp_inference(self) -> None:
        self._move_model(self.device)
        self.model.eval()

    def finish_training(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def offload_before_refit(self) -> None:
        """Optimiser state to CPU, making room for the full weights being gathered."""
        self._move_optimizer_state("cpu")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def offload_after_refit(self) -> None:
        """Parameters and optimiser state to CPU once the generation engine has the weights."""
        self._move_model("cpu")
        self._move_optimizer_state("cpu")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------------- weights out

    def prepare_refit_info(self) -> RefitInfo:
        self._reshard()
        return refit_info(self.model)

    def stream_weights(self, bucket_size_bytes: int | None = None) -> Iterator[WeightBucket]:
        """Full weights in size-bounded buckets of plain CPU tensors (collective: all ranks iterate)."""
        self._reshard()
        return stream_weights(self.model, bucket_size_bytes or self.cfg.refit_bucket_size_bytes)

    def gather_weights(self, names: list[str]) -> WeightBucket | None:
        """Full copies of the named parameters; returned by rank 0 only (collective)."""
        self._reshard()
        bucket = gather_weights(self.model, names)
        return bucket if self.rank == 0 else None

    # ---------------------------------------------------------------------------- checkpoints

    def save_checkpoint(
        self, weights_path: str, optimizer_path: str | None = None, tokenizer_path: str | None = None
    ) -> None:
        self._reshard()
        save_sharded_checkpoint(
            self.model,
            weights_path,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            optimizer_path=optimizer_path,
            hf_config=self.hf_config,
            # A resumed run samples the same tokens an uninterrupted one would have.
            extra_state={SAMPLING_GENERATOR_KEY: self.generator.get_state()},
        )
        if tokenizer_path is not None and self.rank == 0:
            self.tokenizer.save_pretrained(tokenizer_path)

    def load_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        self._reshard()
        extra = load_sharded_checkpoint(
            self.model,
            weights_path,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            optimizer_path=optimizer_path,
        )
        if SAMPLING_GENERATOR_KEY in extra:
            self.generator.set_state(extra[SAMPLING_GENERATOR_KEY])

    def export_hf(self, out_dir: str) -> str | None:
        """Write a consolidated Hugging Face directory (rank 0 writes; collective gather)."""
        self._reshard()
        state = full_state_dict(self.model)
        if self.rank == 0:
            save_hf_directory(self.hf_config, state, out_dir, self.tokenizer)
        if dist.is_initialized():
            dist.barrier()
        return str(Path(out_dir)) if self.rank == 0 else None

    # ------------------------------------------------------------------------------- lifecycle

    def shutdown(self) -> bool:
        """Drop the model and optimiser (the process group belongs to the process and stays)."""
        for attr in ("model", "optimizer", "scheduler", "reference"):
            if hasattr(self, attr):
                delattr(self, attr)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return True
