"""BatchedDataDict.shard_by_batch_size: per-step data-parallel sharding, dynamic batching, packing.

The property tests check the invariants training relies on against values recomputed here
from the shards' own data (never from the plan's bookkeeping alone): equal micro-batch counts
per rank and step, every micro-batch within the token budget, every row placed exactly once,
and the original order restored by `reorder_data(sorted_indices)`.
"""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_core.data import (
    BatchedDataDict,
    DynamicBatchingArgs,
    SequencePackingArgs,
    block_diagonal_attention_mask,
    pack_sequences,
    unpack_sequences,
)

PAD_ID = -1


def round_up(value: int, multiple: int) -> int:
    return math.ceil(value / multiple) * multiple


def planning_kwargs(args: DynamicBatchingArgs | SequencePackingArgs) -> dict:
    if isinstance(args, DynamicBatchingArgs):
        return {"dynamic_batching_args": args}
    return {"sequence_packing_args": args}


def make_batch(lengths: list[int], extra_cols: int = 0) -> BatchedDataDict:
    n, seq_len = len(lengths), max(max(lengths), 1) + extra_cols
    positions = torch.arange(seq_len)[None, :]
    valid = positions < torch.tensor(lengths)[:, None]
    tokens = (torch.arange(n)[:, None] + 1) * 1000 + positions
    return BatchedDataDict(
        input_ids=torch.where(valid, tokens, PAD_ID),
        input_lengths=torch.tensor(lengths),
        token_mask=valid,
        logprobs=torch.where(valid, tokens.double() / 7, 0.0),
        idx=torch.arange(n),
        prompt=[f"prompt {i}" for i in range(n)],
    )


def assert_same_batch(actual: BatchedDataDict, expected: BatchedDataDict) -> None:
    assert set(actual) == set(expected)
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(actual[key], value), key
        else:
            assert actual[key] == value, key


def micro_batch_tokens(kind: str, lengths: list[int], round_to: int) -> int:
    """What a micro-batch costs, from its rows' lengths (independent of the plan's num_tokens)."""
    if kind == "dynamic_batching":
        return len(lengths) * round_up(max(lengths, default=0), round_to)
    return sum(round_up(length, round_to) for length in lengths)


def check_planned_shards(
    batch: BatchedDataDict,
    shards: list[BatchedDataDict],
    sorted_indices: list[int],
    num_shards: int,
    batch_size: int,
    kind: str,
    round_to: int,
    budget: int,
    even: bool,
) -> None:
    total = batch.size
    num_steps = total // batch_size
    assert len(shards) == num_shards

    # Every row exactly once; sorted_indices describes the concatenated shards; order restorable.
    assert sorted(sorted_indices) == list(range(total))
    assert torch.cat([shard["idx"] for shard in shards]).tolist() == sorted_indices
    assert_same_batch(BatchedDataDict.from_batches(shards).reorder_data(sorted_indices), batch)

    counts_per_step: list[set[int]] = [set() for _ in range(num_steps)]
    for shard in shards:
        plan = shard.microbatch_plan
        assert plan is not None and plan.kind == kind and len(plan.steps) == num_steps
        assert shard.micro_batch_indices is not None and shard.micro_batch_lengths is not None
        position = 0
        for step, (ranges, seq_lens) in enumerate(zip(shard.micro_batch_indices, shard.micro_batch_lengths)):
            counts_per_step[step].add(len(ranges))
            step_rows = 0
            for (start, end), seq_len in zip(ranges, seq_lens):
                assert start == position and end > start, "micro-batches tile the shard, none empty"
                position = end
                step_rows += end - start
                # rows of step s come from step s of the original batch
                assert {int(i) // batch_size for i in shard["idx"][start:end]} == {step}
                lengths = shard["input_lengths"][start:end].tolist()
                assert micro_batch_tokens(kind, lengths, round_to) <= budget
                assert seq_len == round_up(max(lengths), round_to)
            if even:
                assert step_rows == batch_size // num_shards
        assert position == shard.size
    # The invariant FSDP/Megatron need: same number of micro-batches on every rank, every step.
    assert all(len(counts) == 1 for counts in counts_per_step), counts_per_step

    for shard in shards:
        check_microbatch_iterators(batch, shard, kind)


def check_microbatch_iterators(batch: BatchedDataDict, shard: BatchedDataDict, kind: str) -> None:
    """Iterate the plan step by step, as a worker does, and compare each micro-batch with the original rows."""
    plan = shard.microbatch_plan
    assert plan is not None
    seq_dim = batch["input_ids"].shape[1]
    if kind == "dynamic_batching":
        whole = list(shard.make_microbatch_iterator_with_dynamic_shapes())
        assert len(whole) == shard.get_microbatch_iterator_dynamic_shapes_len()
    else:
        whole = list(shard.make_microbatch_iterator_for_packable_sequences())
        assert len(whole) == shard.get_microbatch_iterator_for_packable_sequences_len()
    seen = []
    for step in range(len(plan.steps)):
        step_batch = shard.get_batch(step)
        start, end = plan.step_rows(step)
        assert shard.get_batch(step, batch_size=end - start)["idx"].tolist() == step_batch["idx"].tolist()
        if kind == "dynamic_batching":
            micro_batches = list(
                step_batch.make_microbatch_iterator_with_dynamic_shapes({"input_ids": PAD_ID})
            )
        else:
            micro_batches = list(
                step_batch.make_microbatch_iterator_for_packable_sequences({"input_ids": PAD_ID})
            )
        assert step_batch.micro_batch_lengths is not None
        assert len(micro_batches) == len(step_batch.micro_batch_lengths[0])
        for mb, seq_len in zip(micro_batches, step_batch.micro_batch_lengths[0]):
            assert mb.microbatch_plan is None
            for key in ("input_ids", "token_mask", "logprobs"):
                assert mb[key].shape[1] == seq_len, key  # truncated or padded to the planned length
            keep = min(seq_len, seq_dim)
            original = batch.select_indices(mb["idx"].tolist())
            for key in ("input_ids", "token_mask", "logprobs"):
                assert torch.equal(mb[key][:, :keep], original[key][:, :keep]), key
            assert bool((mb["input_ids"][:, keep:] == PAD_ID).all())
            assert mb["prompt"] == original["prompt"]
            seen.extend(mb["idx"].tolist())
    assert seen == shard["idx"].tolist()
    assert [mb["idx"].tolist() for mb in whole] == [
        shard["idx"][s:e].tolist() for step in shard.micro_batch_indices or [] for s, e in step
    ]


# -------------------------------------------------------------------------------- plain sharding


@pytest.mark.parametrize(
    "total,batch_size,shards,uneven",
    [(12, 6, 3, False), (12, None, 4, False), (10, 5, 2, True), (7, 7, 3, True)],
)
def test_plain_sharding_matches_loop_reference(total, batch_size, shards, uneven):
    batch = make_batch([3] * total)
    result = batch.shard_by_batch_size(shards, batch_size=batch_size, allow_uneven_shards=uneven)
    assert isinstance(result, list)
    step = total if batch_size is None else batch_size
    for rank, shard in enumerate(result):
        expected = []
        for s in range(total // step):
            # rank r of step s: consecutive rows, lower ranks one larger when uneven
            base, extra = divmod(step, shards)
            start = rank * base + min(rank, extra)
            size = base + (1 if rank < extra else 0)
            expected += list(range(s * step + start, s * step + start + size))
        assert shard["idx"].tolist() == expected
        assert shard["prompt"] == [f"prompt {i}" for i in expected]
        assert shard.microbatch_plan is None
        if not uneven:
            assert shard.get_batch(0, step // shards)["idx"].tolist() == expected[: step // shards]


def test_sharding_argument_errors():
    batch = make_batch([3] * 10)
    with pytest.raises(ValueError, match="batch of 10 rows is not a positive multiple of batch_size=4"):
        batch.shard_by_batch_size(2, batch_size=4)
    with pytest.raises(
        ValueError, match="batch_size=5 is not divisible by shards=2; pass allow_uneven_shards=True"
    ):
        batch.shard_by_batch_size(2, batch_size=5)
    with pytest.raises(ValueError, match="shards must be a positive int, got 0"):
        batch.shard_by_batch_size(0)
    with pytest.raises(ValueError, match="not both"):
        batch.shard_by_batch_size(
            2,
            dynamic_batching_args=DynamicBatchingArgs(16, 1),
            sequence_packing_args=SequencePackingArgs(16, "ffd"),
        )
    no_lengths = BatchedDataDict(input_ids=torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(KeyError, match="the batch has no key 'input_lengths'"):
        no_lengths.shard_by_batch_size(1, dynamic_batching_args=DynamicBatchingArgs(16, 1))
    too_long = BatchedDataDict(
        input_ids=torch.zeros(2, 3, dtype=torch.long), input_lengths=torch.tensor([3, 4])
    )
    with pytest.raises(ValueError, match=r"'input_lengths' of row 1 is 4, outside \[0, 3\]"):
        too_long.shard_by_batch_size(1, sequence_packing_args=SequencePackingArgs(16, "mffd"))


def test_args_validation():
    with pytest.raises(
        ValueError, match=r"DynamicBatchingArgs\.max_tokens_per_microbatch must be a positive int"
    ):
        DynamicBatchingArgs(0, 1)
    with pytest.raises(
        ValueError, match=r"SequencePackingArgs\.sequence_length_pad_multiple must be a positive int"
    ):
        SequencePackingArgs(8, "ffd", sequence_length_pad_multiple=0)
    with pytest.raises(ValueError, match="unknown sequence packing algorithm 'nfd'"):
        SequencePackingArgs(8, "nfd")  # type: ignore[arg-type]
    assert SequencePackingArgs(8, "mffd").algorithm == "modified_first_fit_decreasing"


@pytest.mark.parametrize(
    "args",
    [DynamicBatchingArgs(20, 8), SequencePackingArgs(20, "mffd", sequence_length_pad_multiple=8)],
    ids=["dynamic", "packing"],
)
def test_sequence_longer_than_budget_is_named(args):
    batch = make_batch([3, 5, 17, 2])
    with pytest.raises(
        ValueError,
        match="sequence at index 2 has length 17 \\(24 tokens after rounding to a multiple of 8\\)",
    ):
        batch.shard_by_batch_size(2, **planning_kwargs(args))


def test_get_batch_with_plan_rejects_wrong_batch_size():
    batch = make_batch([5, 4, 3, 2])
    shards, _ = batch.shard_by_batch_size(2, batch_size=2, dynamic_batching_args=DynamicBatchingArgs(100, 1))
    with pytest.raises(
        ValueError, match="step 1 of this shard has 1 rows under its micro-batch plan, but batch_size=2"
    ):
        shards[0].get_batch(1, batch_size=2)
    with pytest.raises(IndexError, match="step 2 is out of range; the plan has 2 steps"):
        shards[0].get_batch(2)


# ----------------------------------------------------------------------- properties: even shards


@st.composite
def even_case(draw):
    shards = draw(st.integers(1, 4))
    per_rank = draw(st.integers(1, 4))
    steps = draw(st.integers(1, 3))
    max_len = draw(st.integers(1, 24))
    lengths = draw(
        st.lists(
            st.integers(0, max_len), min_size=shards * per_rank * steps, max_size=shards * per_rank * steps
        )
    )
    round_to = draw(st.integers(1, 8))
    smallest_budget = max(round_up(max(lengths), round_to), 1)
    budget = draw(st.integers(smallest_budget, 4 * smallest_budget))
    extra_cols = draw(st.integers(0, 3))
    return shards, shards * per_rank, lengths, round_to, budget, extra_cols


@settings(max_examples=60, deadline=None)
@given(case=even_case())
def test_dynamic_batching_invariants(case):
    shards, batch_size, lengths, round_to, budget, extra_cols = case
    batch = make_batch(lengths, extra_cols)
    args = DynamicBatchingArgs(max_tokens_per_microbatch=budget, sequence_length_round=round_to)
    result, sorted_indices = batch.shard_by_batch_size(shards, batch_size, dynamic_batching_args=args)
    check_planned_shards(
        batch, result, sorted_indices, shards, batch_size, "dynamic_batching", round_to, budget, True
    )


@settings(max_examples=60, deadline=None)
@given(case=even_case(), algorithm=st.sampled_from(["ffd", "mffd", "first_fit_shuffle"]))
def test_sequence_packing_invariants(case, algorithm):
    shards, batch_size, lengths, pad_multiple, budget, extra_cols = case
    batch = make_batch(lengths, extra_cols)
    args = SequencePackingArgs(budget, algorithm, sequence_length_pad_multiple=pad_multiple)
    result, sorted_indices = batch.shard_by_batch_size(shards, batch_size, sequence_packing_args=args)
    check_planned_shards(
        batch, result, sorted_indices, shards, batch_size, "sequence_packing", pad_multiple, budget, True
    )


# --------------------------------------------------------------------- properties: uneven shards


def min_feasible_groups(lengths: list[int], fits) -> int:
    """Fewest groups covering all items with every group satisfying `fits` (exact, subset DP)."""
    n = len(lengths)
    full = (1 << n) - 1
    feasible = [fits([lengths[i] for i in range(n) if mask >> i & 1]) for mask in range(full + 1)]
    best = [0] + [n + 1] * full
    for mask in range(1, full + 1):
        low = mask & -mask
        sub = mask
        while sub:
            if sub & low and feasible[sub]:
                best[mask] = min(best[mask], best[mask ^ sub] + 1)
            sub = (sub - 1) & mask
    return best[full]


@st.composite
def uneven_case(draw):
    shards = draw(st.integers(2, 4))
    # Mostly batch_size > shards: with fewer rows than ranks every plan is trivially impossible.
    batch_size = draw(st.integers(shards - 1, 9).filter(lambda bs: bs % shards != 0))
    steps = draw(st.integers(1, 2))
    max_len = draw(st.integers(1, 16))
    lengths = draw(
        st.lists(st.integers(0, max_len), min_size=batch_size * steps, max_size=batch_size * steps)
    )
    round_to = draw(st.integers(1, 4))
    smallest_budget = max(round_up(max(lengths), round_to), 1)
    budget = draw(st.integers(smallest_budget, 3 * smallest_budget))
    return shards, batch_size, lengths, round_to, budget


@settings(max_examples=60, deadline=None)
@given(case=uneven_case(), packing=st.booleans())
def test_uneven_shards_equal_counts_or_proven_impossible(case, packing):
    shards, batch_size, lengths, round_to, budget = case
    batch = make_batch(lengths)
    kind = "sequence_packing" if packing else "dynamic_batching"
    try:
        if packing:
            result, sorted_indices = batch.shard_by_batch_size(
                shards,
                batch_size,
                allow_uneven_shards=True,
                sequence_packing_args=SequencePackingArgs(
                    budget, "ffd", sequence_length_pad_multiple=round_to
                ),
            )
        else:
            result, sorted_indices = batch.shard_by_batch_size(
                shards,
                batch_size,
                allow_uneven_shards=True,
                dynamic_batching_args=DynamicBatchingArgs(budget, round_to),
            )
    except ValueError as error:
        assert "cannot give all" in str(error)
        if not packing:
            # Dynamic batching groups optimally, so a refusal must be a true impossibility: some
            # step cannot be cut into a multiple of `shards` non-empty micro-batches within budget.
            def fits(group):
                return micro_batch_tokens(kind, group, round_to) <= budget

            steps = [lengths[s : s + batch_size] for s in range(0, len(lengths), batch_size)]
            assert any(
                math.ceil(min_feasible_groups(step, fits) / shards) * shards > len(step) for step in steps
            )
        return
    check_planned_shards(batch, result, sorted_indices, shards, batch_size, kind, round_to, budget, False)


@pytest.mark.parametrize(
    "args",
    [DynamicBatchingArgs(12, 1), SequencePackingArgs(12, "ffd")],
    ids=["dynamic", "packing"],
)
def test_uneven_shards_move_rows_between_ranks_when_needed(args):
    # 3 rows on 2 ranks: rank 0 is dealt 7 and 6 (13 tokens, two micro-batches), rank 1 only the
    # other 6 (one row, so it cannot split into two). Regrouping the step gives [7] and [6, 6].
    batch = make_batch([6, 7, 6])
    result, sorted_indices = batch.shard_by_batch_size(2, allow_uneven_shards=True, **planning_kwargs(args))
    assert [len(shard.micro_batch_indices[0]) for shard in result] == [1, 1]
    assert sorted(sorted(shard["input_lengths"].tolist()) for shard in result) == [[6, 6], [7]]
    assert_same_batch(BatchedDataDict.from_batches(result).reorder_data(sorted_indices), batch)


def test_uneven_shards_impossible_is_explained():
    # Three sequences that pairwise exceed the budget cannot make an even number of micro-batches.
    batch = make_batch([7, 7, 7])
    with pytest.raises(ValueError, match="step 0: cannot give all 2 ranks the same number of micro-batches"):
        batch.shard_by_batch_size(
            2, allow_uneven_shards=True, sequence_packing_args=SequencePackingArgs(12, "ffd")
        )


# ----------------------------------------------------------------- end to end: packed forward


def test_packed_microbatches_reproduce_unpacked_attention():
    """A worker's packed path (shard, pack each bin, attend, unpack, gather, reorder) equals plain per-row attention."""
    torch.manual_seed(0)
    lengths = [9, 3, 12, 1, 7, 7, 2, 11, 5, 4, 10, 6]
    batch = make_batch(lengths, extra_cols=2)
    vocab_table = torch.randn(13000, 4, dtype=torch.float64)

    def attention(ids: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        x = vocab_table[ids.clamp(min=0)][None]  # [1, L, D]
        return F.scaled_dot_product_attention(x, x, x, attn_mask=mask, is_causal=causal)[0].sum(-1)

    args = SequencePackingArgs(24, "mffd", sequence_length_pad_multiple=4)
    shards, sorted_indices = batch.shard_by_batch_size(2, batch_size=6, sequence_packing_args=args)
    outputs = []
    for shard in shards:
        rows = []
        for mb in shard.make_microbatch_iterator_for_packable_sequences():
            packed = pack_sequences(mb["input_ids"], mb["input_lengths"], pad_multiple=4, pad_token_id=0)
            assert packed.total_len <= 24
            mask = block_diagonal_attention_mask(packed.cu_seqlens, packed.total_len)
            per_token = attention(packed.input_ids[0], mask, causal=False)[None]
            rows.append(
                BatchedDataDict(out=unpack_sequences(per_token, packed, max_len=batch["input_ids"].shape[1]))
            )
        outputs.append(BatchedDataDict.from_batches(rows))
    gathered = BatchedDataDict.from_batches(outputs).reorder_data(sorted_indices)

    for row, length in enumerate(lengths):
        expected = attention(batch["input_ids"][row, :length], None, causal=True)
        torch.testing.assert_close(gathered["out"][row, :length], expected, atol=1e-6, rtol=0)
        assert bool((gathered["out"][row, length:] == 0).all())


def test_dynamic_microbatches_reproduce_full_batch_sums():
    """Per-row results computed micro-batch by micro-batch, gathered and reordered, equal the full batch's."""
    lengths = [5, 16, 2, 9, 9, 1, 14, 3]
    batch = make_batch(lengths)
    expected = (batch["logprobs"] * batch["token_mask"]).sum(-1)
    shards, sorted_indices = batch.shard_by_batch_size(
        2, batch_size=4, dynamic_batching_args=DynamicBatchingArgs(32, 4)
    )
    per_shard = []
    for shard in shards:
        sums = [
            (mb["logprobs"] * mb["token_mask"]).sum(-1)
            for mb in shard.make_microbatch_iterator_with_dynamic_shapes()
        ]
        per_shard.append(BatchedDataDict(row_sum=torch.cat(sums)))
    gathered = BatchedDataDict.from_batches(per_shard).reorder_data(sorted_indices)
    assert torch.equal(gathered["row_sum"], expected)
    for a, b in pairwise(shard.micro_batch_indices or [] for shard in shards):
        assert [len(step) for step in a] == [len(step) for step in b]
