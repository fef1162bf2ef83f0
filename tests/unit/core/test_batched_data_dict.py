"""BatchedDataDict row operations, concatenation and fixed-size micro-batching."""

from __future__ import annotations

import pickle
from typing import TypedDict

import numpy as np
import pytest
import torch

from rl_core.data import BatchedDataDict, DynamicBatchingArgs


def make_batch(n: int = 5) -> BatchedDataDict:
    return BatchedDataDict(
        input_ids=torch.arange(n * 3).reshape(n, 3),
        rewards=torch.arange(n, dtype=torch.float32) / 2,
        scores=np.arange(n, dtype=np.int32) * 10,
        message_log=[[{"role": "user", "content": f"m{i}"}] for i in range(n)],
    )


def rows(batch: BatchedDataDict) -> list[tuple]:
    """One comparable tuple per row, built independently of BatchedDataDict's own indexing."""
    return [
        (
            tuple(batch["input_ids"][i].tolist()),
            float(batch["rewards"][i]),
            int(batch["scores"][i]),
            batch["message_log"][i][0]["content"],
        )
        for i in range(len(batch["message_log"]))
    ]


# --------------------------------------------------------------------------------- from_batches


def test_from_batches_pads_dim1_with_per_key_values():
    a = BatchedDataDict(
        input_ids=torch.tensor([[1, 2]]),
        token_mask=torch.tensor([[True, True]]),
        logprobs=torch.tensor([[0.1, 0.2]]),
        ids_np=np.array([[7, 8]]),
        text=["a"],
        extra=torch.tensor([[[1.0, 2.0]]]),  # [B, T, 2]
    )
    b = BatchedDataDict(
        input_ids=torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]]),
        token_mask=torch.tensor([[True, False, True, True], [True, True, True, True]]),
        logprobs=torch.tensor([[0.3, 0.4, 0.5, 0.6], [0.7, 0.8, 0.9, 1.0]]),
        ids_np=np.array([[1, 2, 3], [4, 5, 6]]),
        text=["b", "c"],
        extra=torch.tensor([[[3.0, 4.0], [5.0, 6.0]], [[7.0, 8.0], [9.0, 9.5]]]),
    )
    out = BatchedDataDict.from_batches(
        [a, b], pad_value_dict={"input_ids": -100, "logprobs": -1.5, "extra": 9}
    )
    assert isinstance(out, BatchedDataDict)
    assert out["input_ids"].tolist() == [[1, 2, -100, -100], [3, 4, 5, 6], [7, 8, 9, 10]]
    assert out["token_mask"].tolist() == [
        [True, True, False, False],
        [True, False, True, True],
        [True, True, True, True],
    ]  # default pad 0 -> False
    assert torch.equal(
        out["logprobs"], torch.tensor([[0.1, 0.2, -1.5, -1.5], [0.3, 0.4, 0.5, 0.6], [0.7, 0.8, 0.9, 1.0]])
    )
    assert out["ids_np"].tolist() == [[7, 8, 0], [1, 2, 3], [4, 5, 6]]
    assert out["text"] == ["a", "b", "c"]
    assert out["extra"].shape == (3, 2, 2)
    assert out["extra"][0].tolist() == [[1.0, 2.0], [9.0, 9.0]]
    assert out.size == 3


def test_from_batches_key_mismatch_names_keys():
    with pytest.raises(
        KeyError, match=r"batch 1 has different keys than batch 0: missing \['b'\], extra \['c'\]"
    ):
        BatchedDataDict.from_batches([{"a": [1], "b": [2]}, {"a": [3], "c": [4]}])


def test_from_batches_type_and_shape_errors_name_key():
    with pytest.raises(TypeError, match="key 'x' mixes value types across batches"):
        BatchedDataDict.from_batches([{"x": [1]}, {"x": torch.tensor([1])}])
    with pytest.raises(
        TypeError, match=r"key 'x' has different dtypes across batches: \['torch.float32', 'torch.int64'\]"
    ):
        BatchedDataDict.from_batches([{"x": torch.tensor([1])}, {"x": torch.tensor([1.0])}])
    with pytest.raises(ValueError, match="key 'x' differs across batches beyond dim 1"):
        BatchedDataDict.from_batches([{"x": torch.zeros(1, 2, 3)}, {"x": torch.zeros(1, 2, 4)}])
    with pytest.raises(ValueError, match="key 'x' has incompatible shapes"):
        BatchedDataDict.from_batches([{"x": torch.zeros(1, 2)}, {"x": torch.zeros(1)}])
    with pytest.raises(ValueError, match="got no batches"):
        BatchedDataDict.from_batches([])


# ---------------------------------------------------------------------------------------- size


def test_size_and_errors():
    assert make_batch(5).size == 5
    assert BatchedDataDict().size == 0
    with pytest.raises(ValueError, match="key 'input_ids' has 2 rows but key 'labels' has 3"):
        _ = BatchedDataDict(input_ids=torch.zeros(2, 4), labels=[1, 2, 3]).size
    with pytest.raises(ValueError, match="key 'loss' holds a 0-d Tensor"):
        _ = BatchedDataDict(loss=torch.tensor(1.0)).size
    with pytest.raises(TypeError, match="key 'name' holds a str"):
        _ = BatchedDataDict(name="abc").size


# ------------------------------------------------------------------------------- row selection


def test_slice_matches_python_slicing():
    batch = make_batch(6)
    assert rows(batch.slice(2, 5)) == rows(batch)[2:5]
    assert rows(batch.slice(3, 3)) == []
    with pytest.raises(IndexError, match=r"slice\(4, 7\) is out of range for a batch of 6 rows"):
        batch.slice(4, 7)


def test_select_indices_with_repeats_and_tensor_indices():
    batch = make_batch(5)
    expected = [rows(batch)[i] for i in [4, 0, 0, 2]]
    assert rows(batch.select_indices([4, 0, 0, 2])) == expected
    assert rows(batch.select_indices(torch.tensor([4, 0, 0, 2]))) == expected
    with pytest.raises(IndexError, match=r"index 5 \(position 1\) is out of range for a batch of 5 rows"):
        batch.select_indices([1, 5])
    with pytest.raises(IndexError, match="index -1"):
        batch.select_indices([-1])


@pytest.mark.parametrize("n,chunks", [(6, 3), (7, 3), (2, 4), (5, 1)])
def test_chunk_partitions_in_order(n, chunks):
    batch = make_batch(n)
    pieces = [batch.chunk(rank, chunks) for rank in range(chunks)]
    assert [row for piece in pieces for row in rows(piece)] == rows(batch)
    sizes = [piece.size for piece in pieces]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    with pytest.raises(IndexError, match=f"chunk\\(rank={chunks}, chunks={chunks}\\)"):
        batch.chunk(chunks, chunks)


def test_repeat_interleave_repeats_each_row_in_place():
    batch = make_batch(3)
    out = batch.repeat_interleave(2)
    original = rows(batch)
    assert rows(out) == [original[0], original[0], original[1], original[1], original[2], original[2]]
    assert torch.equal(out["input_ids"], torch.repeat_interleave(batch["input_ids"], 2, dim=0))
    # Repeated list items are independent copies: appending to one message log leaves the others alone.
    out["message_log"][0].append({"role": "assistant", "content": "x"})
    assert len(out["message_log"][1]) == 1
    assert len(batch["message_log"][0]) == 1
    with pytest.raises(ValueError, match="num_repeats must be a positive int, got 0"):
        batch.repeat_interleave(0)


def test_reorder_data_inverts_select_indices():
    batch = make_batch(6)
    permutation = [3, 0, 5, 1, 4, 2]
    shuffled = batch.select_indices(permutation)
    assert rows(shuffled.reorder_data(permutation)) == rows(batch)
    assert rows(shuffled.reorder_data(torch.tensor(permutation))) == rows(batch)
    # out[idx[j]] = self[j]
    out = batch.reorder_data(permutation)
    for j, target in enumerate(permutation):
        assert rows(out)[target] == rows(batch)[j]
    with pytest.raises(ValueError, match=r"must be a permutation of range\(6\)"):
        batch.reorder_data([0, 0, 1, 2, 3, 4])


def test_get_batch_without_plan():
    batch = make_batch(6)
    assert rows(batch.get_batch(1, 2)) == rows(batch)[2:4]
    with pytest.raises(IndexError, match=r"get_batch\(3, 2\) is out of range for a batch of 6 rows"):
        batch.get_batch(3, 2)
    with pytest.raises(ValueError, match="need a positive batch_size without a micro-batch plan"):
        batch.get_batch(0)


# ---------------------------------------------------------------------------- value transforms


def test_copy_is_shallow_and_independent_dict():
    batch = make_batch(3)
    dup = batch.copy()
    assert type(dup) is BatchedDataDict
    dup["new"] = [1, 2, 3]
    assert "new" not in batch
    assert dup["input_ids"] is batch["input_ids"]


def test_to_moves_tensors_in_place():
    batch = make_batch(3)
    message_log = batch["message_log"]
    assert batch.to("meta") is batch
    assert batch["input_ids"].device.type == "meta"
    assert batch["rewards"].device.type == "meta"
    assert batch["message_log"] is message_log
    assert isinstance(batch["scores"], np.ndarray)


def test_truncate_tensors():
    batch = BatchedDataDict(
        a=torch.arange(12).reshape(2, 6), b=torch.arange(2), c=torch.zeros(2, 6, 3), d=[1, 2]
    )
    out = batch.truncate_tensors(dim=1, truncated_len=4)
    assert out["a"].tolist() == [[0, 1, 2, 3], [6, 7, 8, 9]]
    assert out["b"].tolist() == [0, 1]
    assert out["c"].shape == (2, 4, 3)
    assert out["d"] == [1, 2]
    assert batch["a"].shape == (2, 6)
    only_a = batch.truncate_tensors(dim=1, truncated_len=2, keys=["a"])
    assert only_a["a"].shape == (2, 2) and only_a["c"].shape == (2, 6, 3)
    with pytest.raises(KeyError, match=r"no such keys \['zz'\]"):
        batch.truncate_tensors(dim=1, truncated_len=2, keys=["zz"])


# ----------------------------------------------------------------------- fixed-size micro-batches


@pytest.mark.parametrize("n,mbs", [(6, 2), (7, 3), (2, 5)])
def test_make_microbatch_iterator(n, mbs):
    batch = make_batch(n)
    pieces = list(batch.make_microbatch_iterator(mbs))
    assert len(pieces) == batch.get_microbatch_iterator_len(mbs)
    assert [piece.size for piece in pieces[:-1]] == [mbs] * (len(pieces) - 1)
    assert [row for piece in pieces for row in rows(piece)] == rows(batch)


def test_planned_iterators_require_a_matching_plan():
    batch = make_batch(4)
    with pytest.raises(ValueError, match="has no micro-batch plan"):
        list(batch.make_microbatch_iterator_with_dynamic_shapes())
    with pytest.raises(ValueError, match="has no micro-batch plan"):
        batch.get_microbatch_iterator_for_packable_sequences_len()
    dyn = BatchedDataDict(
        input_ids=torch.zeros(4, 8, dtype=torch.long), input_lengths=torch.tensor([8, 2, 3, 4])
    )
    shards, _ = dyn.shard_by_batch_size(2, dynamic_batching_args=DynamicBatchingArgs(16, 1))
    with pytest.raises(ValueError, match="planned for dynamic_batching, not sequence_packing"):
        list(shards[0].make_microbatch_iterator_for_packable_sequences())


# ----------------------------------------------------------------------------- typing, pickling


class TrainingBatch(TypedDict):
    input_ids: torch.Tensor
    input_lengths: torch.Tensor


def test_generic_parameterisation_and_pickle_keep_plan():
    typed: BatchedDataDict[TrainingBatch] = BatchedDataDict[TrainingBatch](
        input_ids=torch.zeros(4, 8, dtype=torch.long), input_lengths=torch.tensor([8, 2, 3, 4])
    )
    assert type(typed) is BatchedDataDict
    shards, _ = typed.shard_by_batch_size(2, dynamic_batching_args=DynamicBatchingArgs(16, 1))
    restored = pickle.loads(pickle.dumps(shards[1]))
    assert type(restored) is BatchedDataDict
    assert restored.microbatch_plan == shards[1].microbatch_plan is not None
    assert torch.equal(restored["input_ids"], shards[1]["input_ids"])
    # Row-changing operations drop the plan; copy keeps it.
    assert shards[1].copy().microbatch_plan == shards[1].microbatch_plan
    assert shards[1].select_indices([0]).microbatch_plan is None
    assert "plan=dynamic_batching" in repr(shards[1])
