"""Sequence packing.

Two halves:

* Bin packers that group sequence lengths into bins of at most a token budget
  (`first_fit_decreasing`, `modified_first_fit_decreasing`, `first_fit_shuffle`), all behind
  one interface, `SequencePacker.pack(lengths) -> bins of indices`, and looked up by name.
* The packed-row layout that variable-length attention kernels consume: `pack_sequences`
  lays a right-padded batch end to end in one row with position ids restarting per sequence
  and `cu_seqlens` boundaries; `unpack_sequences` turns per-token outputs of that row back
  into a right-padded batch; `block_diagonal_attention_mask` is the equivalent dense mask
  for code paths (CPU, tests) that have no varlen kernel.
"""

from __future__ import annotations

import bisect
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

__all__ = [
    "PACKER_ALIASES",
    "FirstFitDecreasingPacker",
    "FirstFitShufflePacker",
    "ModifiedFirstFitDecreasingPacker",
    "PackedSequences",
    "SequencePacker",
    "available_packers",
    "block_diagonal_attention_mask",
    "get_packer",
    "pack_sequences",
    "resolve_packer_name",
    "round_up",
    "unpack_sequences",
]


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= `value` (`multiple` >= 1)."""
    return -(-value // multiple) * multiple


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


# ---------------------------------------------------------------------------------------------
# Bin packers
# ---------------------------------------------------------------------------------------------


class SequencePacker(ABC):
    """Packs sequence lengths into bins whose total length is at most `capacity`.

    `pack(lengths)` returns a list of bins, each a non-empty list of indices into `lengths`;
    every index appears in exactly one bin. Zero lengths are allowed (they fit anywhere).
    """

    name: ClassVar[str]

    def __init__(self, capacity: int) -> None:
        self.capacity = _check_positive_int(f"{type(self).__name__} capacity", capacity)

    def pack(self, lengths: Sequence[int]) -> list[list[int]]:
        sizes: list[int] = []
        for index, length in enumerate(lengths):
            size = int(length)
            if size < 0:
                raise ValueError(f"{self.name}: sequence at index {index} has negative length {size}")
            if size > self.capacity:
                raise ValueError(
                    f"{self.name}: sequence at index {index} has length {size}, "
                    f"more than the bin capacity {self.capacity}"
                )
            sizes.append(size)
        return self._pack(sizes)

    @abstractmethod
    def _pack(self, sizes: list[int]) -> list[list[int]]:
        """Pack validated sizes (each 0 <= size <= capacity)."""


class _FirstFitBins:
    """Bins in opening order, with first-fit placement in O(log n).

    A max segment tree over bin slots holds each slot's free space. Slots not yet opened hold
    the full capacity, so the leftmost slot with room for an item is the first open bin that
    fits, or else the next new bin: first fit needs no separate "open a bin" case.
    """

    def __init__(self, capacity: int, max_bins: int) -> None:
        leaves = 1
        while leaves < max(max_bins, 1):
            leaves *= 2
        self._leaves = leaves
        self._free = [capacity] * (2 * leaves)
        self.bins: list[list[int]] = []

    def place(self, item: int, size: int) -> None:
        node = 1
        while node < self._leaves:
            node = 2 * node if self._free[2 * node] >= size else 2 * node + 1
        slot = node - self._leaves
        if slot == len(self.bins):
            self.bins.append([])
        self.bins[slot].append(item)
        self._free[node] -= size
        node //= 2
        while node:
            self._free[node] = max(self._free[2 * node], self._free[2 * node + 1])
            node //= 2


def _first_fit(order: Sequence[int], sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Place items in the given order, each into the first bin with room."""
    bins = _FirstFitBins(capacity, len(order))
    for item in order:
        bins.place(item, sizes[item])
    return bins.bins


def _decreasing(items: Sequence[int], sizes: Sequence[int]) -> list[int]:
    # Ties broken by index so results are deterministic.
    return sorted(items, key=lambda item: (-sizes[item], item))


class FirstFitDecreasingPacker(SequencePacker):
    """First fit decreasing: largest first, each into the first bin with room.

    Uses at most 11/9 * OPT + 6/9 bins (Dósa 2007, tight).
    """

    name = "first_fit_decreasing"

    def _pack(self, sizes: list[int]) -> list[list[int]]:
        return _first_fit(_decreasing(range(len(sizes)), sizes), sizes, self.capacity)


class FirstFitShufflePacker(SequencePacker):
    """First fit in a seeded random order: no sorting bias, e.g. to mix lengths within a bin."""

    name = "first_fit_shuffle"

    def __init__(self, capacity: int, seed: int = 0) -> None:
        super().__init__(capacity)
        self.seed = seed

    def _pack(self, sizes: list[int]) -> list[list[int]]:
        order = list(range(len(sizes)))
        random.Random(self.seed).shuffle(order)
        return _first_fit(order, sizes, self.capacity)


class _SortedPool:
    """Remaining items of a packing phase, kept sorted by (size, index)."""

    def __init__(self, items: Sequence[int], sizes: Sequence[int]) -> None:
        self._sizes = sizes
        self._keys = sorted((sizes[item], item) for item in items)

    def __len__(self) -> int:
        return len(self._keys)

    def smallest_sizes(self, count: int) -> list[int]:
        return [size for size, _ in self._keys[:count]]

    def pop_smallest(self) -> int:
        return self._keys.pop(0)[1]

    def pop_largest_fitting(self, free: int) -> int | None:
        """Remove and return the largest item with size <= free, or None if none fits."""
        position = bisect.bisect_right(self._keys, (free, len(self._sizes))) - 1
        if position < 0:
            return None
        return self._keys.pop(position)[1]

    def items(self) -> list[int]:
        return [item for _, item in self._keys]


class ModifiedFirstFitDecreasingPacker(SequencePacker):
    """Modified first fit decreasing (Johnson & Garey, "A 71/60 theorem for bin packing", 1985).

    With bin capacity C, items are large (> C/2), medium (C/3, C/2], small (C/6, C/3] or
    tiny (<= C/6). Phases:

    1. one bin per large item, largest first;
    2. forward over those bins: if the smallest remaining medium item fits, add the largest
       remaining medium item that fits;
    3. backward over the bins without a medium item: if the two smallest remaining small items
       fit together, add the smallest small item and then the largest small item that still fits;
    4. forward over all bins: while the smallest remaining item (any class) fits, add the largest
       remaining item that fits;
    5. first fit decreasing for whatever is left, into new bins.

    Uses at most 71/60 * OPT + 1 bins (the paper's bound; FFD's is 11/9 * OPT + 6/9).
    """

    name = "modified_first_fit_decreasing"

    def _pack(self, sizes: list[int]) -> list[list[int]]:
        capacity = self.capacity
        # Integer comparisons avoid rounding at the class boundaries.
        large = [i for i, s in enumerate(sizes) if 2 * s > capacity]
        medium = [i for i, s in enumerate(sizes) if 3 * s > capacity >= 2 * s]
        small = [i for i, s in enumerate(sizes) if 6 * s > capacity >= 3 * s]
        tiny = [i for i, s in enumerate(sizes) if capacity >= 6 * s]

        bins = [[item] for item in _decreasing(large, sizes)]
        free = [capacity - sizes[b[0]] for b in bins]

        def add(bin_index: int, item: int) -> None:
            bins[bin_index].append(item)
            free[bin_index] -= sizes[item]

        medium_pool = _SortedPool(medium, sizes)
        has_medium = [False] * len(bins)
        for b in range(len(bins)):
            if medium_pool and medium_pool.smallest_sizes(1)[0] <= free[b]:
                item = medium_pool.pop_largest_fitting(free[b])
                assert item is not None  # the smallest medium item fits
                add(b, item)
                has_medium[b] = True

        small_pool = _SortedPool(small, sizes)
        for b in reversed(range(len(bins))):
            if has_medium[b] or len(small_pool) < 2 or sum(small_pool.smallest_sizes(2)) > free[b]:
                continue
            add(b, small_pool.pop_smallest())
            partner = small_pool.pop_largest_fitting(free[b])
            assert partner is not None  # the (former) second-smallest small item fits
            add(b, partner)

        rest_pool = _SortedPool(medium_pool.items() + small_pool.items() + tiny, sizes)
        for b in range(len(bins)):
            while rest_pool and rest_pool.smallest_sizes(1)[0] <= free[b]:
                item = rest_pool.pop_largest_fitting(free[b])
                assert item is not None
                add(b, item)

        leftover = rest_pool.items()
        return bins + _first_fit(_decreasing(leftover, sizes), sizes, capacity)


PACKER_ALIASES: dict[str, str] = {
    "ffd": FirstFitDecreasingPacker.name,
    "mffd": ModifiedFirstFitDecreasingPacker.name,
    "ffs": FirstFitShufflePacker.name,
}

_PACKERS: dict[str, type[SequencePacker]] = {
    cls.name: cls
    for cls in (FirstFitDecreasingPacker, ModifiedFirstFitDecreasingPacker, FirstFitShufflePacker)
}


def available_packers() -> list[str]:
    """Registered packer names (aliases in `PACKER_ALIASES` are accepted too)."""
    return sorted(_PACKERS)


def resolve_packer_name(name: str) -> str:
    """The registered name for `name` or its short alias; unknown names raise ValueError."""
    canonical = PACKER_ALIASES.get(name, name)
    if canonical not in _PACKERS:
        valid = ", ".join(
            available_packers() + [f"{alias} (= {full})" for alias, full in PACKER_ALIASES.items()]
        )
        raise ValueError(f"unknown sequence packing algorithm {name!r}; valid: {valid}")
    return canonical


def get_packer(name: str, capacity: int) -> SequencePacker:
    """A packer by registered name or alias, for bins of at most `capacity` tokens."""
    return _PACKERS[resolve_packer_name(name)](capacity)


# ---------------------------------------------------------------------------------------------
# Packed-row layout
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackedSequences:
    """A batch laid end to end in one row.

    Sequence i occupies packed positions [cu_seqlens[i], cu_seqlens[i+1]): its
    `seq_lens[i]` real tokens followed by `padded_seq_lens[i] - seq_lens[i]` pad tokens.
    """

    input_ids: torch.Tensor  # [1, total_len]
    position_ids: torch.Tensor  # [1, total_len], restarting at 0 for every sequence
    cu_seqlens: torch.Tensor  # int32 [num_sequences + 1], boundaries over padded lengths
    seq_lens: torch.Tensor  # int64 [num_sequences], real lengths
    padded_seq_lens: torch.Tensor  # int64 [num_sequences], lengths rounded up to the pad multiple

    @property
    def num_sequences(self) -> int:
        return int(self.seq_lens.numel())

    @property
    def total_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def max_seqlen(self) -> int:
        """Longest padded sequence (what varlen flash attention takes as max_seqlen)."""
        return int(self.padded_seq_lens.max()) if self.num_sequences else 0


def _segment_positions(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For segments of `lengths` laid end to end: each position's segment and offset in it."""
    segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    offset = torch.arange(segment.numel(), device=lengths.device) - starts[segment]
    return segment, offset


def _check_lengths(input_lengths: torch.Tensor, batch: int, max_len: int, what: str) -> torch.Tensor:
    if input_lengths.dim() != 1 or input_lengths.numel() != batch:
        raise ValueError(f"{what}: lengths must have shape [{batch}], got {list(input_lengths.shape)}")
    if input_lengths.is_floating_point() or input_lengths.is_complex() or input_lengths.dtype == torch.bool:
        raise ValueError(f"{what}: lengths must be an integer tensor, got {input_lengths.dtype}")
    lengths = input_lengths.to(torch.int64)
    bad = ((lengths < 0) | (lengths > max_len)).nonzero()
    if bad.numel():
        index = int(bad[0, 0])
        raise ValueError(
            f"{what}: sequence at index {index} has length {int(lengths[index])}, outside [0, {max_len}]"
        )
    return lengths


def pack_sequences(
    input_ids: torch.Tensor, input_lengths: torch.Tensor, pad_multiple: int = 1, pad_token_id: int = 0
) -> PackedSequences:
    """Lay the right-padded batch `input_ids [B, T]` end to end in one row.

    Each sequence keeps its first `input_lengths[i]` tokens and is padded with `pad_token_id`
    up to a multiple of `pad_multiple` (e.g. TP * CP * 2 so every sequence splits evenly).
    """
    pad_multiple = _check_positive_int("pad_multiple", pad_multiple)
    if input_ids.dim() != 2:
        raise ValueError(
            f"pack_sequences: input_ids must be [batch, seq_len], got shape {list(input_ids.shape)}"
        )
    batch, seq_len = input_ids.shape
    lengths = _check_lengths(input_lengths.to(input_ids.device), batch, seq_len, "pack_sequences")
    padded = -(-lengths // pad_multiple) * pad_multiple
    segment, offset = _segment_positions(padded)
    tokens = input_ids[segment, offset.clamp(max=max(seq_len - 1, 0))]
    packed_ids = torch.where(offset < lengths[segment], tokens, torch.full_like(tokens, pad_token_id))
    cu_seqlens = torch.zeros(batch + 1, dtype=torch.int32, device=input_ids.device)
    cu_seqlens[1:] = torch.cumsum(padded, 0)
    return PackedSequences(
        input_ids=packed_ids.unsqueeze(0),
        position_ids=offset.unsqueeze(0),
        cu_seqlens=cu_seqlens,
        seq_lens=lengths,
        padded_seq_lens=padded,
    )


def unpack_sequences(
    packed_values: torch.Tensor, packed: PackedSequences, max_len: int, pad_value: float = 0.0
) -> torch.Tensor:
    """Per-token values of a packed row `[1, total_len, ...]` back to `[B, max_len, ...]`.

    Row i holds the values at sequence i's real tokens, right-padded with `pad_value`; the
    values at pad positions of the packed row are dropped. Differentiable.
    """
    if packed_values.dim() < 2 or packed_values.shape[0] != 1:
        raise ValueError(
            f"unpack_sequences: packed_values must be [1, total_len, ...], got shape {list(packed_values.shape)}"
        )
    if packed_values.shape[1] < packed.total_len:
        raise ValueError(
            f"unpack_sequences: packed_values has {packed_values.shape[1]} positions, "
            f"the packing needs {packed.total_len}"
        )
    longest = int(packed.seq_lens.max()) if packed.num_sequences else 0
    if max_len < longest:
        raise ValueError(
            f"unpack_sequences: max_len={max_len} is shorter than the longest sequence ({longest})"
        )
    device = packed_values.device
    seq_lens = packed.seq_lens.to(device)
    segment, offset = _segment_positions(seq_lens)
    source = packed.cu_seqlens.to(device=device, dtype=torch.int64)[segment] + offset
    out = packed_values.new_full((packed.num_sequences, max_len, *packed_values.shape[2:]), pad_value)
    out[segment, offset] = packed_values[0, source]
    return out


def block_diagonal_attention_mask(cu_seqlens: torch.Tensor, total_len: int) -> torch.Tensor:
    """Boolean `[total_len, total_len]` mask, True where query i may attend to key j.

    Causal within each sequence [cu_seqlens[k], cu_seqlens[k+1]), nothing across sequences
    (the `attn_mask` convention of `scaled_dot_product_attention`). Positions past
    `cu_seqlens[-1]` (extra padding of the row) form one more causal block, so no query row
    is fully masked.
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be a non-empty 1-d tensor, got shape {list(cu_seqlens.shape)}")
    bounds = cu_seqlens.to(torch.int64)
    lengths = bounds[1:] - bounds[:-1]
    if int(bounds[0]) != 0 or bool((lengths < 0).any()):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {bounds.tolist()}")
    end = int(bounds[-1])
    if total_len < end:
        raise ValueError(f"total_len={total_len} is shorter than cu_seqlens[-1]={end}")
    if total_len > end:
        lengths = torch.cat([lengths, lengths.new_tensor([total_len - end])])
    segment, offset = _segment_positions(lengths)
    same_sequence = segment[:, None] == segment[None, :]
    return same_sequence & (offset[:, None] >= offset[None, :])
