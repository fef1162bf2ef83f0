"""Bin packers and the packed-row layout (rl_core.data.packing)."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_core.data.packing import (
    PACKER_ALIASES,
    available_packers,
    block_diagonal_attention_mask,
    get_packer,
    pack_sequences,
    resolve_packer_name,
    unpack_sequences,
)

ALL_PACKERS = ["first_fit_decreasing", "modified_first_fit_decreasing", "first_fit_shuffle"]


def optimal_bin_count(sizes: list[int], capacity: int) -> int:
    """Exact minimum number of bins by branch and bound (small instances only)."""
    items = sorted(sizes, reverse=True)
    best = len(items)

    def search(i: int, loads: list[int]) -> None:
        nonlocal best
        if len(loads) >= best:
            return
        if i == len(items):
            best = len(loads)
            return
        tried = set()
        for b, load in enumerate(loads):
            if load + items[i] <= capacity and load not in tried:
                tried.add(load)
                loads[b] += items[i]
                search(i + 1, loads)
                loads[b] -= items[i]
        loads.append(items[i])
        search(i + 1, loads)
        loads.pop()

    search(0, [])
    return best


def reference_first_fit_decreasing(sizes: list[int], capacity: int) -> list[list[int]]:
    """Plain quadratic first fit decreasing (ties by index)."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for item in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        for b in range(len(bins)):
            if loads[b] + sizes[item] <= capacity:
                bins[b].append(item)
                loads[b] += sizes[item]
                break
        else:
            bins.append([item])
            loads.append(sizes[item])
    return bins


def assert_valid_packing(bins: list[list[int]], sizes: list[int], capacity: int) -> None:
    placed = sorted(i for b in bins for i in b)
    assert placed == list(range(len(sizes))), "every item exactly once"
    for b in bins:
        assert b, "no empty bins"
        assert sum(sizes[i] for i in b) <= capacity


# ---------------------------------------------------------------------------------- registry


def test_registry_names_and_aliases():
    assert available_packers() == sorted(ALL_PACKERS)
    assert resolve_packer_name("ffd") == "first_fit_decreasing"
    assert resolve_packer_name("mffd") == "modified_first_fit_decreasing"
    for alias, full in PACKER_ALIASES.items():
        assert get_packer(alias, 10).name == full


def test_unknown_packer_lists_valid_names():
    with pytest.raises(ValueError, match="unknown sequence packing algorithm 'best_fit'") as info:
        get_packer("best_fit", 10)
    for name in ALL_PACKERS:
        assert name in str(info.value)
    assert "mffd" in str(info.value)


@pytest.mark.parametrize("name", ALL_PACKERS)
def test_item_larger_than_capacity_is_named(name):
    with pytest.raises(ValueError, match="index 2 has length 11, more than the bin capacity 10"):
        get_packer(name, 10).pack([3, 4, 11])
    with pytest.raises(ValueError, match="index 1 has negative length -1"):
        get_packer(name, 10).pack([3, -1])
    with pytest.raises(ValueError, match="capacity must be a positive int"):
        get_packer(name, 0)


@pytest.mark.parametrize("name", ALL_PACKERS)
def test_empty_and_zero_lengths(name):
    packer = get_packer(name, 8)
    assert packer.pack([]) == []
    bins = packer.pack([0, 8, 0])
    assert_valid_packing(bins, [0, 8, 0], 8)


# ---------------------------------------------------------------------------------- packers


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(1, 64),
    data=st.data(),
    name=st.sampled_from(ALL_PACKERS),
)
def test_packers_place_every_item_once_within_capacity(capacity, data, name):
    sizes = data.draw(st.lists(st.integers(0, capacity), max_size=80))
    assert_valid_packing(get_packer(name, capacity).pack(sizes), sizes, capacity)


@settings(max_examples=60, deadline=None)
@given(capacity=st.integers(1, 50), data=st.data())
def test_ffd_matches_plain_reference(capacity, data):
    sizes = data.draw(st.lists(st.integers(0, capacity), max_size=60))
    assert get_packer("ffd", capacity).pack(sizes) == reference_first_fit_decreasing(sizes, capacity)


@settings(max_examples=80, deadline=None)
@given(capacity=st.integers(6, 60), data=st.data())
def test_ffd_and_mffd_within_worst_case_bounds_of_optimum(capacity, data):
    sizes = data.draw(st.lists(st.integers(1, capacity), min_size=1, max_size=9))
    opt = optimal_bin_count(sizes, capacity)
    ffd = len(get_packer("ffd", capacity).pack(sizes))
    mffd = len(get_packer("mffd", capacity).pack(sizes))
    assert opt <= ffd <= 11 / 9 * opt + 6 / 9
    assert opt <= mffd <= 71 / 60 * opt + 1


def test_mffd_beats_ffd_on_known_instance():
    # Capacity 20: FFD puts 6 with 12 and strands three 4s -> 4 bins; MFFD pairs the small
    # items 4+4 with 12 (phase 3) and 4 with 16 (phase 4), leaving 10+6+4 -> 3 bins = optimum.
    sizes = [16, 12, 10, 6, 4, 4, 4, 4]
    capacity = 20
    ffd = get_packer("ffd", capacity).pack(sizes)
    mffd = get_packer("mffd", capacity).pack(sizes)
    assert_valid_packing(ffd, sizes, capacity)
    assert_valid_packing(mffd, sizes, capacity)
    opt = optimal_bin_count(sizes, capacity)
    assert opt == 3
    assert len(ffd) == opt + 1
    assert len(mffd) == opt


def test_first_fit_shuffle_is_seeded():
    sizes = list(range(1, 30))
    assert get_packer("ffs", 40).pack(sizes) == get_packer("ffs", 40).pack(sizes)


# ---------------------------------------------------------------------------- packed layout


def reference_pack(input_ids: torch.Tensor, lengths: list[int], multiple: int, pad: int):
    ids, pos, cu = [], [], [0]
    for row, length in enumerate(lengths):
        padded = math.ceil(length / multiple) * multiple
        ids += input_ids[row, :length].tolist() + [pad] * (padded - length)
        pos += list(range(padded))
        cu.append(cu[-1] + padded)
    return ids, pos, cu


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=6),
    multiple=st.integers(1, 5),
    extra_cols=st.integers(0, 3),
)
def test_pack_matches_reference_and_unpack_round_trips(lengths, multiple, extra_cols):
    batch, seq_len = len(lengths), max(lengths) + extra_cols
    input_ids = torch.randint(1, 100, (batch, seq_len))
    packed = pack_sequences(input_ids, torch.tensor(lengths), pad_multiple=multiple, pad_token_id=-7)

    ids, pos, cu = reference_pack(input_ids, lengths, multiple, -7)
    assert packed.input_ids.tolist() == [ids]
    assert packed.position_ids.tolist() == [pos]
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.cu_seqlens.tolist() == cu
    assert packed.seq_lens.tolist() == lengths
    assert packed.padded_seq_lens.tolist() == [b - a for a, b in pairwise(cu)]
    assert packed.max_seqlen == max(b - a for a, b in pairwise(cu))

    unpacked = unpack_sequences(packed.input_ids, packed, max_len=seq_len, pad_value=0)
    mask = torch.arange(seq_len)[None, :] < torch.tensor(lengths)[:, None]
    assert torch.equal(unpacked, torch.where(mask, input_ids, 0))


def test_unpack_keeps_trailing_dims_and_gradients():
    lengths = torch.tensor([3, 1, 4])
    input_ids = torch.randint(0, 9, (3, 5))
    packed = pack_sequences(input_ids, lengths, pad_multiple=2)
    values = torch.randn(1, packed.total_len + 2, 7, requires_grad=True)  # extra row padding allowed
    out = unpack_sequences(values, packed, max_len=6, pad_value=-1.0)
    assert out.shape == (3, 6, 7)
    starts = packed.cu_seqlens.tolist()
    for row, length in enumerate(lengths.tolist()):
        assert torch.equal(out[row, :length], values[0, starts[row] : starts[row] + length])
        assert bool((out[row, length:] == -1.0).all())
    out.sum().backward()
    assert values.grad is not None
    used = torch.zeros(packed.total_len + 2)
    for row, length in enumerate(lengths.tolist()):
        used[starts[row] : starts[row] + length] = 1
    assert torch.equal(values.grad[0], used[:, None].expand(-1, 7))


def test_pack_errors_name_the_problem():
    with pytest.raises(ValueError, match="index 1 has length 9, outside \\[0, 4\\]"):
        pack_sequences(torch.zeros(2, 4, dtype=torch.long), torch.tensor([2, 9]))
    with pytest.raises(ValueError, match="lengths must have shape \\[2\\]"):
        pack_sequences(torch.zeros(2, 4, dtype=torch.long), torch.tensor([2, 3, 1]))
    with pytest.raises(ValueError, match="pad_multiple must be a positive int"):
        pack_sequences(torch.zeros(2, 4, dtype=torch.long), torch.tensor([2, 3]), pad_multiple=0)
    packed = pack_sequences(torch.zeros(2, 4, dtype=torch.long), torch.tensor([2, 3]))
    with pytest.raises(ValueError, match="max_len=2 is shorter than the longest sequence \\(3\\)"):
        unpack_sequences(packed.input_ids, packed, max_len=2)
    with pytest.raises(ValueError, match="has 4 positions, the packing needs 5"):
        unpack_sequences(packed.input_ids[:, :4], packed, max_len=4)


# ------------------------------------------------------------------------------- attention


def test_block_diagonal_mask_matches_loop():
    cu = torch.tensor([0, 3, 3, 5, 9], dtype=torch.int32)
    mask = block_diagonal_attention_mask(cu, 11)
    bounds = [0, 3, 3, 5, 9, 11]  # trailing positions 9..10 form their own block
    expected = torch.zeros(11, 11, dtype=torch.bool)
    for start, end in pairwise(bounds):
        for q in range(start, end):
            for k in range(start, q + 1):
                expected[q, k] = True
    assert torch.equal(mask, expected)
    with pytest.raises(ValueError, match="total_len=8 is shorter than cu_seqlens\\[-1\\]=9"):
        block_diagonal_attention_mask(cu, 8)
    with pytest.raises(ValueError, match="must start at 0 and be non-decreasing"):
        block_diagonal_attention_mask(torch.tensor([0, 4, 2]), 4)


def test_packed_attention_equals_per_sequence_attention():
    torch.manual_seed(0)
    lengths = [5, 1, 7, 3]
    heads, dim, multiple = 2, 8, 4
    input_ids = torch.randint(1, 50, (len(lengths), max(lengths)))
    packed = pack_sequences(input_ids, torch.tensor(lengths), pad_multiple=multiple)
    # Per-token features as a function of the token id, so packed and unpacked see the same inputs.
    table_q, table_k, table_v = (torch.randn(50, heads, dim, dtype=torch.float64) for _ in range(3))

    def attend(ids: torch.Tensor, attn_mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        q, k, v = (table[ids].transpose(0, 1) for table in (table_q, table_k, table_v))  # [H, L, D]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal).transpose(0, 1)

    mask = block_diagonal_attention_mask(packed.cu_seqlens, packed.total_len)
    packed_out = attend(packed.input_ids[0], mask, causal=False)  # [total, H, D]
    unpacked = unpack_sequences(packed_out.unsqueeze(0), packed, max_len=max(lengths))
    for row, length in enumerate(lengths):
        reference = attend(input_ids[row, :length], None, causal=True)
        torch.testing.assert_close(unpacked[row, :length], reference, atol=1e-6, rtol=0)
