"""Batch data: `BatchedDataDict`, micro-batch planning (dynamic batching, sequence packing), packing kernels' layout, msgpack transport."""

from rl_core.data.batched_data_dict import BatchedDataDict
from rl_core.data.microbatching import (
    DynamicBatchingArgs,
    MicroBatch,
    MicroBatchPlan,
    SequencePackingArgs,
)
from rl_core.data.msgpack_codec import decode_msgpack, encode_msgpack
from rl_core.data.packing import (
    PackedSequences,
    SequencePacker,
    available_packers,
    block_diagonal_attention_mask,
    get_packer,
    pack_sequences,
    unpack_sequences,
)

__all__ = [
    "BatchedDataDict",
    "DynamicBatchingArgs",
    "MicroBatch",
    "MicroBatchPlan",
    "PackedSequences",
    "SequencePacker",
    "SequencePackingArgs",
    "available_packers",
    "block_diagonal_attention_mask",
    "decode_msgpack",
    "encode_msgpack",
    "get_packer",
    "pack_sequences",
    "unpack_sequences",
]
