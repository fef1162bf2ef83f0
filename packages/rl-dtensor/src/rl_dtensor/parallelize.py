"""Sharding a Hugging Face decoder LM: device mesh, tensor/sequence parallel, FSDP2, checkpointing.

Order matters and follows the usual recipe: tensor parallel first (turns the layer weights
into DTensors over the `tp` mesh dimension), then activation checkpointing, then FSDP2 per
decoder layer and at the root over the `dp` dimension (FSDP shards the TP DTensors further).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from transformers import PreTrainedModel


@dataclass(frozen=True)
class ParallelDims:
    """World = dp x tp, ranks laid out row-major (the tp ranks of one dp replica are adjacent)."""

    dp: int
    tp: int

    @classmethod
    def from_world(cls, world_size: int, tp_size: int) -> ParallelDims:
        if world_size % tp_size != 0:
            raise ValueError(f"world size {world_size} is not divisible by dtensor.tp_size={tp_size}")
        return cls(dp=world_size // tp_size, tp=tp_size)


def build_device_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    return init_device_mesh(device_type, (dims.dp, dims.tp), mesh_dim_names=("dp", "tp"))


def decoder_layers(model: PreTrainedModel) -> list[nn.Module]:
    """The model's transformer blocks: modules whose class the model lists as not to be split."""
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in block_names]
    if not layers:
        raise ValueError(
            f"cannot find the decoder layers of {type(model).__name__}: it declares no _no_split_modules"
        )
    return layers


# Megatron-style sharding of a Llama/Qwen2 block: column-parallel projections into the heads /
# the MLP's hidden dimension, row-parallel projections back out, so each block needs a single
# reduction in the attention and one in the MLP.
_COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def _check_tp_divisibility(model: PreTrainedModel, tp: int) -> None:
    config = model.config
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", config.num_attention_heads),
        "intermediate_size": config.intermediate_size,
    }
    for key, value in sizes.items():
        if value % tp != 0:
            raise ValueError(f"dtensor.tp_size={tp} must divide the model's {key}={value}")


def _has_submodule(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def _layer_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    # With sequence parallel the residual stream stays sharded over the sequence (Shard(1))
    # between blocks; the norms run on their shard, and attention / MLP inputs are gathered.
    # The block's residual additions then see DTensors on both sides.
    row_out = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {name: ColwiseParallel() for name in _COLWISE}
    plan.update(
        {
            name: RowwiseParallel(output_layouts=row_out, use_local_output=not sequence_parallel)
            for name in _ROWWISE
        }
    )
    if sequence_parallel:
        plan["input_layernorm"] = SequenceParallel()
        plan["post_attention_layernorm"] = SequenceParallel()
        plan["self_attn"] = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
        )
        plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan


def apply_tensor_parallel(model: PreTrainedModel, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Shard every decoder layer over `tp_mesh`; embeddings and the LM head stay replicated.

    Keeping the LM head replicated means every TP rank sees the full logits, so log-probs,
    losses and sampling need no vocab-parallel variants.
    """
    _check_tp_divisibility(model, tp_mesh.size())
    plan = _layer_plan(sequence_parallel)
    for layer in decoder_layers(model):
        missing = [name for name in plan if not _has_submodule(layer, name)]
        if missing:
            raise ValueError(
                f"tensor parallel supports Llama/Qwen2-style decoder layers; {type(layer).__name__} "
                f"has no submodule(s) {missing}"
            )
        parallelize_module(layer, tp_mesh, plan)
    if sequence_parallel:
        base = model.get_decoder()
        # Embeddings are computed replicated and split over the sequence for the first block;
        # the final norm gathers the sequence back so the LM head sees a plain full tensor.
        parallelize_module(
            base.embed_tokens,
            tp_mesh,
            PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False
            ),
        )
        parallelize_module(
            base.norm,
            tp_mesh,
            PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            ),
        )


def apply_activation_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each decoder layer's activations in backward (non-reentrant, FSDP-safe)."""
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers < 5.20 names it after gradients
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def apply_fsdp(
    model: PreTrainedModel,
    dp_mesh: DeviceMesh,
    compute_dtype: torch.dtype,
    cpu_offload: bool,
) -> None:
    """FSDP2: one all-gather group per decoder layer, the rest (embeddings, head) at the root.

    Master weights stay in the loaded dtype (float32); `compute_dtype` is what forward and
    backward run in; gradients are reduced in float32.
    """
    mp_policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    # Pinned host memory (for fast async copies) needs an accelerator; CPU runs keep plain memory.
    offload: OffloadPolicy = (
        CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    )
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp_policy, offload_policy=offload)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy, offload_policy=offload)


def parallelize_model(
    model: PreTrainedModel,
    mesh: DeviceMesh,
    compute_dtype: torch.dtype,
    sequence_parallel: bool,
    activation_checkpointing: bool,
    cpu_offload: bool,
) -> None:
    """Shard `model` in place over `mesh` (dims `dp`, `tp`)."""
    tp_mesh = mesh["tp"]
    if tp_mesh.size() > 1:
        apply_tensor_parallel(model, tp_mesh, sequence_parallel)
    elif sequence_parallel:
        raise ValueError("dtensor.sequence_parallel needs dtensor.tp_size > 1")
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    apply_fsdp(model, mesh["dp"], compute_dtype, cpu_offload)
