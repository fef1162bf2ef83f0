"""msgpack transport of batch data: bit-exact tensors of every dtype, arrays, nested plain values."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch

from rl_core.data import BatchedDataDict, DynamicBatchingArgs, decode_msgpack, encode_msgpack

INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


def random_bits(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor whose elements are arbitrary bit patterns (NaN payloads, subnormals, -0.0 included)."""
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    item = torch.empty((), dtype=dtype).element_size()
    count = int(np.prod(shape)) if shape else 1
    raw = torch.randint(0, 256, (count * item,), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor's elements, comparable with torch.equal even for NaN."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (5,), (3, 4), (2, 3, 4), (0,), (0, 3)], ids=str)
def test_tensor_round_trip_is_bit_exact(dtype, shape):
    torch.manual_seed(0)
    tensor = random_bits(shape, dtype)
    decoded = decode_msgpack(encode_msgpack(tensor))
    assert decoded.dtype == dtype
    assert decoded.shape == tensor.shape
    assert torch.equal(bits(decoded), bits(tensor))


def test_bfloat16_special_values_round_trip():
    special = torch.tensor(
        [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, 3.3895e38], dtype=torch.bfloat16
    )
    # A NaN with a non-default payload, built from its bits.
    payload_nan = torch.tensor([0x7FC1], dtype=torch.int16).view(torch.bfloat16)
    tensor = torch.cat([special, payload_nan])
    decoded = decode_msgpack(encode_msgpack(tensor))
    assert torch.equal(decoded.view(torch.int16), tensor.view(torch.int16))


def test_non_contiguous_and_special_tensors():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    cases = {
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),
        "grad": torch.ones(2, 2, requires_grad=True) * 3,
        "conj": torch.tensor([1 + 2j, 3 - 4j]).conj(),
        "neg_view": torch.tensor([1 + 2j]).conj().imag,
    }
    decoded = decode_msgpack(encode_msgpack(cases))
    for name, tensor in cases.items():
        assert decoded[name].is_contiguous(), name
        assert not decoded[name].requires_grad, name
        assert torch.equal(decoded[name], tensor.detach().resolve_conj().resolve_neg()), name


@pytest.mark.parametrize(
    "array",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.array([1, -2, 3], dtype=np.int16),
        np.array([True, False]),
        np.zeros((0, 2), dtype=np.float64),
        np.array(["ab", "c"]),
        np.arange(6, dtype=np.int64).reshape(2, 3).T,
        np.array(2.5),
    ],
    ids=lambda a: f"{a.dtype}{list(a.shape)}",
)
def test_numpy_round_trip(array):
    decoded = decode_msgpack(encode_msgpack(array))
    assert isinstance(decoded, np.ndarray)
    assert decoded.dtype == array.dtype
    assert decoded.shape == array.shape
    np.testing.assert_array_equal(decoded, array)
    assert decoded.flags.writeable


def test_numpy_scalars_and_plain_values():
    value = {
        "np_scalar": np.float32(1.5),
        "np_int": np.int64(-3),
        "nested": [[{"role": "user", "content": "hi", "ids": [1, 2]}], [], [None, 1.25, True, "x"]],
        "big": 2**63 - 1,
        "float": 0.1,
        "bytes": b"\x00\xff",
        "int_keys": {1: "a", 2: "b"},
    }
    decoded = decode_msgpack(encode_msgpack(value))
    assert type(decoded["np_scalar"]) is np.float32 and decoded["np_scalar"] == np.float32(1.5)
    assert type(decoded["np_int"]) is np.int64 and decoded["np_int"] == -3
    for key in ("nested", "big", "float", "bytes", "int_keys"):
        assert decoded[key] == value[key], key


def test_unsupported_values_raise_naming_the_type():
    with pytest.raises(TypeError, match=r"cannot encode a value of type builtins\.set"):
        encode_msgpack({"a": {1, 2}})
    with pytest.raises(TypeError, match="object/structured arrays need pickle"):
        encode_msgpack(np.array([object()], dtype=object))
    with pytest.raises(TypeError, match=r"cannot encode a torch\.sparse_coo tensor"):
        encode_msgpack(torch.eye(2).to_sparse())


def test_decoder_rejects_unknown_dtype_and_ext():
    bad_tensor = msgpack.ExtType(1, msgpack.packb(["object", [1], b"\x00"], use_bin_type=True))
    with pytest.raises(ValueError, match="unsupported tensor dtype 'object'"):
        decode_msgpack(msgpack.packb(bad_tensor, use_bin_type=True))
    with pytest.raises(ValueError, match="unknown msgpack extension type 42"):
        decode_msgpack(msgpack.packb(msgpack.ExtType(42, b""), use_bin_type=True))


# ------------------------------------------------------------------------ BatchedDataDict


def make_batch() -> BatchedDataDict:
    torch.manual_seed(0)
    return BatchedDataDict(
        input_ids=torch.randint(0, 100, (4, 6)),
        input_lengths=torch.tensor([6, 2, 5, 1]),
        logprobs=torch.randn(4, 6).to(torch.bfloat16),
        token_mask=torch.rand(4, 6) > 0.3,
        rewards=np.array([0.5, 1.0, -1.0, 0.0]),
        message_log=[
            [
                {"role": "user", "content": f"q{i}", "token_ids": [i, i + 1]},
                {"role": "assistant", "content": None},
            ]
            for i in range(4)
        ],
        task_name=["math", "code", "math", "game"],
    )


def assert_batches_equal(a: BatchedDataDict, b: BatchedDataDict) -> None:
    assert list(a.keys()) == list(b.keys())
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype, key
            assert torch.equal(bits(a[key]), bits(b[key])), key
            assert a[key].shape == b[key].shape, key
        elif isinstance(a[key], np.ndarray):
            np.testing.assert_array_equal(a[key], b[key])
        else:
            assert a[key] == b[key], key


def test_batched_data_dict_round_trip():
    batch = make_batch()
    decoded = BatchedDataDict.from_msgpack(batch.to_msgpack())
    assert type(decoded) is BatchedDataDict
    assert decoded.microbatch_plan is None
    assert_batches_equal(decoded, batch)


def test_batched_data_dict_round_trip_keeps_microbatch_plan():
    shards, _ = make_batch().shard_by_batch_size(
        2, dynamic_batching_args=DynamicBatchingArgs(max_tokens_per_microbatch=8, sequence_length_round=2)
    )
    for shard in shards:
        decoded = BatchedDataDict.from_msgpack(shard.to_msgpack())
        assert decoded.microbatch_plan == shard.microbatch_plan
        assert decoded.microbatch_plan is not None
        assert_batches_equal(decoded, shard)


def test_batched_data_dict_round_trip_empty_tensors():
    batch = BatchedDataDict(x=torch.zeros(0, 5, dtype=torch.bfloat16), y=[])
    decoded = BatchedDataDict.from_msgpack(batch.to_msgpack())
    assert decoded["x"].shape == (0, 5) and decoded["x"].dtype == torch.bfloat16
    assert decoded["y"] == []
    assert decoded.size == 0


def test_to_msgpack_names_the_offending_key():
    batch = BatchedDataDict(ok=[1, 2], bad=[object(), object()])
    with pytest.raises(
        TypeError, match=r"cannot encode key 'bad': cannot encode a value of type builtins\.object"
    ):
        batch.to_msgpack()


def test_from_msgpack_rejects_other_payloads():
    with pytest.raises(ValueError, match="not a BatchedDataDict written by to_msgpack"):
        BatchedDataDict.from_msgpack(encode_msgpack({"input_ids": [1, 2]}))
    with pytest.raises(ValueError, match="unsupported payload version 99"):
        BatchedDataDict.from_msgpack(encode_msgpack({"format": "rl_core.BatchedDataDict", "version": 99}))
