"""Micro-batch planning for one optimiser step across data-parallel ranks.

Given the sequence lengths of one step's rows, a plan decides which rank processes each row
and how each rank groups its rows into micro-batches under a token budget, such that every
rank runs the same number of micro-batches (FSDP and Megatron issue collectives per
micro-batch; a rank with fewer would hang the others).

Two grouping rules share that machinery:

* dynamic batching: a micro-batch is a padded rectangle, costing
  `num_seqs * round_up(max_len, sequence_length_round)` tokens;
* sequence packing: a micro-batch is one packed row, costing
  `sum(round_up(len, sequence_length_pad_multiple))` tokens.

Both costs only shrink when rows are removed from a micro-batch, which is what makes
splitting a micro-batch (to raise a rank's count) always stay within the budget.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

from rl_core.data.packing import get_packer, resolve_packer_name, round_up

__all__ = [
    "DynamicBatchingArgs",
    "MicroBatch",
    "MicroBatchPlan",
    "PackingAlgorithm",
    "PlanKind",
    "SequencePackingArgs",
    "plan_step",
]

PlanKind = Literal["dynamic_batching", "sequence_packing"]
PackingAlgorithm = Literal[
    "first_fit_decreasing", "modified_first_fit_decreasing", "first_fit_shuffle", "ffd", "mffd", "ffs"
]


def _require_positive(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class DynamicBatchingArgs:
    """Group rows into padded micro-batches of at most `max_tokens_per_microbatch` tokens.

    A micro-batch's tokens are `num_seqs * round_up(longest length, sequence_length_round)`.
    Lengths are read from `input_lengths_key`; `input_key` names the `[B, T]` token tensor
    whose dim-1 size identifies the sequence-aligned tensors (see `BatchedDataDict`).
    """

    max_tokens_per_microbatch: int
    sequence_length_round: int
    input_key: str = "input_ids"
    input_lengths_key: str = "input_lengths"

    def __post_init__(self) -> None:
        _require_positive("DynamicBatchingArgs", "max_tokens_per_microbatch", self.max_tokens_per_microbatch)
        _require_positive("DynamicBatchingArgs", "sequence_length_round", self.sequence_length_round)


@dataclass(frozen=True)
class SequencePackingArgs:
    """Pack rows into bins of at most `max_tokens_per_microbatch` tokens, one bin per micro-batch.

    Each sequence counts `round_up(length, sequence_length_pad_multiple)` tokens (the multiple
    keeps every sequence divisible for tensor/context parallelism, e.g. TP * CP * 2).
    `algorithm` is a registered packer name or its alias ("ffd", "mffd", "ffs"); it is stored
    in its full form.
    """

    max_tokens_per_microbatch: int
    algorithm: PackingAlgorithm
    sequence_length_pad_multiple: int = 1
    input_key: str = "input_ids"
    input_lengths_key: str = "input_lengths"

    def __post_init__(self) -> None:
        _require_positive("SequencePackingArgs", "max_tokens_per_microbatch", self.max_tokens_per_microbatch)
        _require_positive(
            "SequencePackingArgs", "sequence_length_pad_multiple", self.sequence_length_pad_multiple
        )
        object.__setattr__(self, "algorithm", resolve_packer_name(self.algorithm))


@dataclass(frozen=True)
class MicroBatch:
    """Rows [start, end) of a shard, processed together.

    `seq_len`: the length the micro-batch iterators pad/truncate sequence-aligned tensors to
    (longest row rounded up to `sequence_length_round`, or to the packing pad multiple).
    `num_tokens`: what the micro-batch counts against `max_tokens_per_microbatch`.
    """

    start: int
    end: int
    seq_len: int
    num_tokens: int

    @property
    def num_rows(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class MicroBatchPlan:
    """A shard's micro-batches, per optimiser step, in execution order."""

    kind: PlanKind
    input_key: str
    steps: tuple[tuple[MicroBatch, ...], ...]

    def step_rows(self, step: int) -> tuple[int, int]:
        """Rows [start, end) of the shard that belong to `step`."""
        micro_batches = self.steps[step]
        return micro_batches[0].start, micro_batches[-1].end

    def to_dict(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "input_key": self.input_key,
            "steps": [[[mb.start, mb.end, mb.seq_len, mb.num_tokens] for mb in step] for step in self.steps],
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> MicroBatchPlan:
        kind = data["kind"]
        if kind not in ("dynamic_batching", "sequence_packing"):
            raise ValueError(f"unknown micro-batch plan kind {kind!r}")
        steps = data["steps"]
        assert isinstance(steps, list)
        return cls(
            kind=kind,
            input_key=str(data["input_key"]),
            steps=tuple(tuple(MicroBatch(*(int(v) for v in mb)) for mb in step) for step in steps),
        )


class GroupingRule(ABC):
    """How rows are grouped into micro-batches and what a group costs."""

    kind: ClassVar[PlanKind]

    def __init__(self, max_tokens: int, round_to: int) -> None:
        self.max_tokens = max_tokens
        self.round_to = round_to

    def seq_len(self, lengths: Sequence[int]) -> int:
        return round_up(max(lengths, default=0), self.round_to)

    @abstractmethod
    def num_tokens(self, lengths: Sequence[int]) -> int:
        """Tokens a micro-batch of sequences with these lengths counts against the budget."""

    @abstractmethod
    def form_groups(self, rows: Sequence[int], lengths: Sequence[int]) -> list[list[int]]:
        """Group `rows` (indices into `lengths`) into micro-batches within the budget."""

    @staticmethod
    def for_args(args: DynamicBatchingArgs | SequencePackingArgs) -> GroupingRule:
        if isinstance(args, DynamicBatchingArgs):
            return DynamicBatchingRule(args.max_tokens_per_microbatch, args.sequence_length_round)
        return SequencePackingRule(
            args.max_tokens_per_microbatch, args.sequence_length_pad_multiple, args.algorithm
        )


class DynamicBatchingRule(GroupingRule):
    kind = "dynamic_batching"

    def num_tokens(self, lengths: Sequence[int]) -> int:
        return len(lengths) * self.seq_len(lengths)

    def form_groups(self, rows: Sequence[int], lengths: Sequence[int]) -> list[list[int]]:
        # Longest first, so the first micro-batch is the biggest (memory problems show early).
        # On length-sorted rows, greedily extending the current group gives the fewest
        # contiguous groups, because any sub-range of a group within budget is within budget.
        groups: list[list[int]] = []
        for row in _longest_first(rows, lengths):
            # Rows arrive longest first, so a group's first row sets its padded length.
            if groups and (len(groups[-1]) + 1) * self.seq_len([lengths[groups[-1][0]]]) <= self.max_tokens:
                groups[-1].append(row)
            else:
                groups.append([row])
        return groups


class SequencePackingRule(GroupingRule):
    kind = "sequence_packing"

    def __init__(self, max_tokens: int, round_to: int, algorithm: str) -> None:
        super().__init__(max_tokens, round_to)
        self.packer = get_packer(algorithm, max_tokens)

    def num_tokens(self, lengths: Sequence[int]) -> int:
        return sum(round_up(length, self.round_to) for length in lengths)

    def form_groups(self, rows: Sequence[int], lengths: Sequence[int]) -> list[list[int]]:
        bins = self.packer.pack([round_up(lengths[row], self.round_to) for row in rows])
        return [[rows[item] for item in bin_items] for bin_items in bins]


def _longest_first(rows: Sequence[int], lengths: Sequence[int]) -> list[int]:
    return sorted(rows, key=lambda row: (-lengths[row], row))


def _assign_rows_to_ranks(
    rows: Sequence[int], lengths: Sequence[int], rank_sizes: Sequence[int]
) -> list[list[int]]:
    """Deal rows to ranks, `rank_sizes[r]` rows each, balancing each rank's total length.

    Longest-processing-time-first: each row, longest first, goes to the least-loaded rank that
    still has room, so every rank sees a similar mix of long and short sequences.
    """
    assigned: list[list[int]] = [[] for _ in rank_sizes]
    load = [0] * len(rank_sizes)
    for row in _longest_first(rows, lengths):
        rank = min(
            (r for r in range(len(rank_sizes)) if len(assigned[r]) < rank_sizes[r]),
            key=lambda r: (load[r], r),
        )
        assigned[rank].append(row)
        load[rank] += lengths[row]
    return assigned


def _split_until(groups: list[list[int]], count: int, lengths: Sequence[int], rule: GroupingRule) -> None:
    """Split groups in place until there are `count` of them (needs `count` <= total rows).

    The costliest group with >= 2 rows is cut into its longer and shorter halves; removing rows
    never raises a group's cost, so both halves stay within the budget.
    """
    while len(groups) < count:
        splittable = [i for i, group in enumerate(groups) if len(group) >= 2]
        assert splittable, "caller guarantees count <= number of rows"
        index = max(splittable, key=lambda i: (rule.num_tokens([lengths[r] for r in groups[i]]), -i))
        ordered = _longest_first(groups[index], lengths)
        half = len(ordered) // 2
        groups[index : index + 1] = [ordered[:half], ordered[half:]]


def _regroup_whole_step(
    rows: Sequence[int], lengths: Sequence[int], ranks: int, rule: GroupingRule, step: int
) -> list[list[list[int]]]:
    """Group the step's rows jointly, then deal whole groups to ranks, equally many each.

    Used when per-rank grouping cannot be equalised (only with uneven shards: a rank must run
    more micro-batches than another rank has rows). The number of groups is raised to the next
    multiple of `ranks` by splitting, which works iff that multiple is at most the number of
    rows; otherwise no plan of non-empty micro-batches exists for this grouping and we raise.
    Ranks may then hold different numbers of rows. Groups go, costliest first, to the
    least-loaded rank that still has room.
    """
    groups = rule.form_groups(rows, lengths)
    needed = -(-len(groups) // ranks) * ranks
    if needed > len(rows):
        raise ValueError(
            f"step {step}: cannot give all {ranks} ranks the same number of micro-batches: its "
            f"{len(rows)} sequences need {len(groups)} micro-batches under "
            f"max_tokens_per_microbatch={rule.max_tokens}, and {needed} (a multiple of {ranks}) non-empty "
            f"micro-batches would need at least {needed} sequences. Use a batch_size divisible by the number "
            f"of shards, or raise the token budget."
        )
    _split_until(groups, needed, lengths, rule)
    per_rank: list[list[list[int]]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for group in sorted(groups, key=lambda g: -rule.num_tokens([lengths[r] for r in g])):
        rank = min(
            (r for r in range(ranks) if len(per_rank[r]) < needed // ranks), key=lambda r: (load[r], r)
        )
        per_rank[rank].append(group)
        load[rank] += rule.num_tokens([lengths[r] for r in group])
    return per_rank


def plan_step(
    rows: Sequence[int], lengths: Sequence[int], rank_sizes: Sequence[int], rule: GroupingRule, step: int
) -> list[list[list[int]]]:
    """Micro-batches of one optimiser step: for each rank, its groups of rows, in order.

    `rows` index into `lengths`. Rank r is dealt `rank_sizes[r]` rows (balancing total length),
    groups them under the rule, and ranks with fewer groups split theirs until all ranks have
    as many as the rank with the most. A rank with n rows can reach any count up to n, so with
    equal `rank_sizes` this always succeeds. With uneven sizes a rank may need more groups than
    another rank has rows; then the whole step is regrouped (`_regroup_whole_step`), moving
    rows between ranks. Every rank ends with the same number of non-empty groups, each within
    the rule's budget, rows longest first within a group. Each single row must fit the budget.
    """
    for row in rows:
        if rule.num_tokens([lengths[row]]) > rule.max_tokens:
            raise ValueError(
                f"sequence at index {row} has length {lengths[row]} "
                f"({rule.num_tokens([lengths[row]])} tokens after rounding to a multiple of {rule.round_to}), "
                f"more than max_tokens_per_microbatch={rule.max_tokens}"
            )
    per_rank = _assign_rows_to_ranks(rows, lengths, rank_sizes)
    groups = [rule.form_groups(rank_rows, lengths) for rank_rows in per_rank]
    target = max(len(rank_groups) for rank_groups in groups)
    if all(len(rank_rows) >= target for rank_rows in per_rank):
        for rank_groups in groups:
            _split_until(rank_groups, target, lengths, rule)
    else:
        groups = _regroup_whole_step(rows, lengths, len(rank_sizes), rule, step)
    counts = {len(rank_groups) for rank_groups in groups}
    assert len(counts) == 1 and all(g for rank_groups in groups for g in rank_groups), counts
    return [[_longest_first(group, lengths) for group in rank_groups] for rank_groups in groups]
