"""`BatchedDataDict`: a dict of batch-first values, and how a batch is sharded for training.

Values are `torch.Tensor` (dim 0 is the batch), `numpy.ndarray` (same) or `list` (one item
per sample, e.g. message logs: a list of lists of dicts). Every value holds the same number
of rows, `size`.

Row operations (`slice`, `select_indices`, `chunk`, `repeat_interleave`, `reorder_data`,
`get_batch`, `shard_by_batch_size`) return new `BatchedDataDict`s and leave the original
alone. `slice`/`chunk`/`get_batch` give tensor views; `select_indices` and everything built on
it copy tensors. Lists are new lists holding the same item objects, except in
`repeat_interleave`, which deep-copies items so that repeated samples can grow independently
(e.g. each generation appends to its own message log).

Sequence-aligned tensors: where a method needs to pad or truncate the sequence dimension
(the micro-batch iterators), it acts on every tensor of rank >= 2 whose dim-1 size equals
that of the plan's `input_key` tensor (by default `input_ids`, `[B, T]`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Generic, Self, overload

import numpy as np
import torch

# typing_extensions for the PEP 696 default, so an unparameterised `BatchedDataDict(...)`
# needs no annotation. (A dependency of torch and pydantic, hence always installed.)
from typing_extensions import TypeVar

from rl_core.data.microbatching import (
    DynamicBatchingArgs,
    GroupingRule,
    MicroBatch,
    MicroBatchPlan,
    PlanKind,
    SequencePackingArgs,
    plan_step,
)
from rl_core.data.msgpack_codec import decode_msgpack, encode_msgpack

__all__ = ["BatchedDataDict"]

DictT = TypeVar("DictT", bound=Mapping[str, object], default=Mapping[str, Any])

_MSGPACK_FORMAT = "rl_core.BatchedDataDict"
_MSGPACK_VERSION = 1


def _even_split(total: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of `parts` consecutive pieces of `total` rows; the first `total % parts` get one more."""
    base, extra = divmod(total, parts)
    bounds = []
    start = 0
    for part in range(parts):
        end = start + base + (1 if part < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def _num_rows(key: str, value: Any) -> int:
    if isinstance(value, torch.Tensor | np.ndarray):
        if value.ndim == 0:
            raise ValueError(
                f"key {key!r} holds a 0-d {type(value).__name__}; every value needs a batch dimension"
            )
        return int(value.shape[0])
    if isinstance(value, list):
        return len(value)
    raise TypeError(
        f"key {key!r} holds a {type(value).__name__}; BatchedDataDict values must be "
        "torch.Tensor, numpy.ndarray or list (batch first)"
    )


def _take_rows(key: str, value: Any, indices: list[int], deep_copy_items: bool) -> Any:
    if isinstance(value, torch.Tensor):
        return value[torch.tensor(indices, dtype=torch.long, device=value.device)]
    if isinstance(value, np.ndarray):
        return value[np.asarray(indices, dtype=np.int64)]
    if isinstance(value, list):
        if deep_copy_items:
            return [copy.deepcopy(value[i]) for i in indices]
        return [value[i] for i in indices]
    _num_rows(key, value)  # raises the unsupported-type error
    raise AssertionError("unreachable")


def _value_kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "torch.Tensor"
    if isinstance(value, np.ndarray):
        return "numpy.ndarray"
    return type(value).__name__


def _concat_padded(key: str, values: list[Any], pad_value: float) -> Any:
    """Concatenate batch-first values along dim 0, right-padding dim 1 of tensors/arrays to the longest."""
    kinds = {_value_kind(v) for v in values}
    if len(kinds) > 1:
        raise TypeError(f"from_batches: key {key!r} mixes value types across batches: {sorted(kinds)}")
    first = values[0]
    if isinstance(first, list):
        return [item for value in values for item in value]
    if not isinstance(first, torch.Tensor | np.ndarray):
        _num_rows(key, first)  # raises the unsupported-type error
    shapes = [tuple(v.shape) for v in values]
    dtypes = {str(v.dtype) for v in values}
    if len(dtypes) > 1:
        raise TypeError(f"from_batches: key {key!r} has different dtypes across batches: {sorted(dtypes)}")
    if len({len(shape) for shape in shapes}) > 1 or any(len(shape) == 0 for shape in shapes):
        raise ValueError(f"from_batches: key {key!r} has incompatible shapes across batches: {shapes}")
    if any(shape[2:] != shapes[0][2:] for shape in shapes):
        raise ValueError(
            f"from_batches: key {key!r} differs across batches beyond dim 1 (only dim 1 is padded): {shapes}"
        )
    if isinstance(first, torch.Tensor):
        devices = {str(v.device) for v in values}
        if len(devices) > 1:
            raise ValueError(
                f"from_batches: key {key!r} is on different devices across batches: {sorted(devices)}"
            )
    padded = (
        [_resize_dim1(v, max(shape[1] for shape in shapes), pad_value) for v in values]
        if len(shapes[0]) >= 2
        else values
    )
    if isinstance(first, torch.Tensor):
        return torch.cat(padded, dim=0)
    return np.concatenate(padded, axis=0)


def _resize_dim1(value: Any, length: int, pad_value: float) -> Any:
    """Truncate or right-pad dim 1 of a tensor/array to `length`."""
    current = value.shape[1]
    if current >= length:
        return value[:, :length]
    shape = (value.shape[0], length, *value.shape[2:])
    out = (
        value.new_full(shape, pad_value)
        if isinstance(value, torch.Tensor)
        else np.full(shape, pad_value, dtype=value.dtype)
    )
    out[:, :current] = value
    return out


class BatchedDataDict(dict[str, Any], Generic[DictT]):
    """A dict of batch-first values; see the module docstring for the value conventions.

    May be parameterised with a TypedDict describing its keys, e.g.
    `BatchedDataDict[TrainingBatch]` (annotation only; nothing is checked at run time).

    A shard returned by `shard_by_batch_size` with dynamic batching or sequence packing also
    carries a `microbatch_plan` (see `MicroBatchPlan`), kept by `copy`, `to`,
    `truncate_tensors`, pickling and msgpack, narrowed by `get_batch`, and dropped by every
    operation that changes rows.
    """

    _microbatch_plan: MicroBatchPlan | None = None

    # ----------------------------------------------------------------------------------- build

    @classmethod
    def ensure(cls, data: Mapping[str, Any]) -> Self:
        """`data` itself if it already is one of these, else a new one over the same values."""
        return data if isinstance(data, cls) else cls(data)

    @classmethod
    def from_batches(
        cls, batches: Sequence[Mapping[str, Any]], pad_value_dict: Mapping[str, float] | None = None
    ) -> Self:
        """Concatenate batches along dim 0.

        Tensors/arrays whose dim-1 lengths differ are right-padded to the longest with
        `pad_value_dict[key]` (default 0); lists are concatenated. All batches must have the
        same keys, and each key the same value type, dtype and trailing (dim >= 2) shape.
        """
        if not batches:
            raise ValueError("from_batches: got no batches")
        keys = list(batches[0].keys())
        for index, batch in enumerate(batches[1:], start=1):
            if set(batch.keys()) != set(keys):
                missing = sorted(set(keys) - set(batch.keys()))
                extra = sorted(set(batch.keys()) - set(keys))
                raise KeyError(
                    f"from_batches: batch {index} has different keys than batch 0: missing {missing}, extra {extra}"
                )
        pads = pad_value_dict or {}
        out = cls()
        for key in keys:
            out[key] = _concat_padded(key, [batch[key] for batch in batches], pads.get(key, 0))
        return out

    def _with_values(self, values: Mapping[str, Any], plan: MicroBatchPlan | None = None) -> Self:
        out = type(self)(values)
        out._microbatch_plan = plan
        return out

    # ------------------------------------------------------------------------------ inspection

    @property
    def size(self) -> int:
        """Number of rows; 0 for an empty dict. Raises if keys disagree."""
        sizes = {key: _num_rows(key, value) for key, value in self.items()}
        if not sizes:
            return 0
        first_key, first_size = next(iter(sizes.items()))
        for key, size in sizes.items():
            if size != first_size:
                raise ValueError(
                    f"inconsistent batch sizes: key {first_key!r} has {first_size} rows but key {key!r} has {size}"
                )
        return first_size

    @property
    def microbatch_plan(self) -> MicroBatchPlan | None:
        return self._microbatch_plan

    @property
    def micro_batch_indices(self) -> list[list[list[int]]] | None:
        """Per step, the [start, end) rows of each micro-batch (None without a plan)."""
        if self._microbatch_plan is None:
            return None
        return [[[mb.start, mb.end] for mb in step] for step in self._microbatch_plan.steps]

    @property
    def micro_batch_lengths(self) -> list[list[int]] | None:
        """Per step, each micro-batch's padded sequence length (`MicroBatch.seq_len`; None without a plan)."""
        if self._microbatch_plan is None:
            return None
        return [[mb.seq_len for mb in step] for step in self._microbatch_plan.steps]

    def __repr__(self) -> str:
        parts = []
        for key, value in self.items():
            if isinstance(value, torch.Tensor | np.ndarray):
                parts.append(f"{key}={type(value).__name__}{list(value.shape)} {value.dtype}")
            elif isinstance(value, list):
                parts.append(f"{key}=list[{len(value)}]")
            else:
                parts.append(f"{key}={type(value).__name__}")
        plan = f", plan={self._microbatch_plan.kind}" if self._microbatch_plan else ""
        return f"{type(self).__name__}({', '.join(parts)}{plan})"

    # ----------------------------------------------------------------------------- row access

    def slice(self, start: int, end: int) -> Self:
        """Rows [start, end) (0 <= start <= end <= size); tensors are views."""
        size = self.size
        if not 0 <= start <= end <= size:
            raise IndexError(f"slice({start}, {end}) is out of range for a batch of {size} rows")
        return self._with_values({key: value[start:end] for key, value in self.items()})

    def select_indices(self, indices: Sequence[int] | torch.Tensor) -> Self:
        """Rows `indices` in that order (repeats allowed): out[j] = self[indices[j]]."""
        rows = indices.tolist() if isinstance(indices, torch.Tensor) else [int(i) for i in indices]
        return self._take(rows, deep_copy_items=False)

    def _take(self, rows: list[int], deep_copy_items: bool) -> Self:
        size = self.size
        for position, row in enumerate(rows):
            if not 0 <= row < size:
                raise IndexError(
                    f"index {row} (position {position}) is out of range for a batch of {size} rows"
                )
        return self._with_values(
            {key: _take_rows(key, value, rows, deep_copy_items) for key, value in self.items()}
        )

    def chunk(self, rank: int, chunks: int) -> Self:
        """The `rank`-th of `chunks` consecutive pieces; sizes differ by at most one, larger first."""
        if chunks < 1 or not 0 <= rank < chunks:
            raise IndexError(f"chunk(rank={rank}, chunks={chunks}): need chunks >= 1 and 0 <= rank < chunks")
        start, end = _even_split(self.size, chunks)[rank]
        return self.slice(start, end)

    def repeat_interleave(self, num_repeats: int) -> Self:
        """Each row repeated `num_repeats` times in place (a, a, b, b); list items are deep copies."""
        if isinstance(num_repeats, bool) or not isinstance(num_repeats, int) or num_repeats < 1:
            raise ValueError(f"repeat_interleave: num_repeats must be a positive int, got {num_repeats!r}")
        rows = [row for row in range(self.size) for _ in range(num_repeats)]
        return self._take(rows, deep_copy_items=num_repeats > 1)

    def reorder_data(self, reordered_indices: Sequence[int] | torch.Tensor) -> Self:
        """Undo a permutation: out[reordered_indices[j]] = self[j].

        `reordered_indices` must be a permutation of range(size). Convention: if
        `y = x.select_indices(idx)` then `y.reorder_data(idx)` equals `x`; and for the
        `sorted_indices` returned by `shard_by_batch_size`,
        `BatchedDataDict.from_batches(shards).reorder_data(sorted_indices)` is the original batch.
        """
        positions = (
            reordered_indices.tolist()
            if isinstance(reordered_indices, torch.Tensor)
            else list(reordered_indices)
        )
        size = self.size
        if sorted(positions) != list(range(size)):
            raise ValueError(
                f"reorder_data: indices must be a permutation of range({size}), got {len(positions)} indices "
                f"{positions[:20]}{' ...' if len(positions) > 20 else ''}"
            )
        inverse = [0] * size
        for position, original in enumerate(positions):
            inverse[original] = position
        return self._take(inverse, deep_copy_items=False)

    def get_batch(self, batch_idx: int, batch_size: int | None = None) -> Self:
        """Rows of optimiser step `batch_idx`.

        Without a plan: rows [batch_idx * batch_size, (batch_idx + 1) * batch_size).
        With a micro-batch plan: the step's rows from the plan, carrying that step's plan;
        `batch_size` may be omitted and, if given, must equal the step's row count.
        """
        plan = self._microbatch_plan
        if plan is None:
            if batch_size is None or batch_size < 1:
                raise ValueError(
                    f"get_batch: need a positive batch_size without a micro-batch plan, got {batch_size}"
                )
            start = batch_idx * batch_size
            if batch_idx < 0 or start + batch_size > self.size:
                raise IndexError(
                    f"get_batch({batch_idx}, {batch_size}) is out of range for a batch of {self.size} rows"
                )
            return self.slice(start, start + batch_size)
        if not 0 <= batch_idx < len(plan.steps):
            raise IndexError(
                f"get_batch: step {batch_idx} is out of range; the plan has {len(plan.steps)} steps"
            )
        start, end = plan.step_rows(batch_idx)
        if batch_size is not None and batch_size != end - start:
            raise ValueError(
                f"get_batch: step {batch_idx} of this shard has {end - start} rows under its micro-batch plan, "
                f"but batch_size={batch_size} was given; pass batch_size=None to take the planned step"
            )
        step = tuple(
            MicroBatch(mb.start - start, mb.end - start, mb.seq_len, mb.num_tokens)
            for mb in plan.steps[batch_idx]
        )
        step_plan = MicroBatchPlan(kind=plan.kind, input_key=plan.input_key, steps=(step,))
        return self._with_values({key: value[start:end] for key, value in self.items()}, step_plan)

    # ------------------------------------------------------------------------ value transforms

    def copy(self) -> Self:
        """Shallow copy: a new dict (and plan) holding the same value objects."""
        return self._with_values(self, self._microbatch_plan)

    def to(self, device: str | torch.device) -> Self:
        """Move top-level tensors to `device` in place and return self (like `nn.Module.to`)."""
        for key, value in self.items():
            if isinstance(value, torch.Tensor):
                self[key] = value.to(device)
        return self

    def truncate_tensors(self, dim: int, truncated_len: int, keys: Sequence[str] | None = None) -> Self:
        """Tensors (of `keys`, default all) with more than `dim` dims cut to `truncated_len` along `dim`."""
        if truncated_len < 0:
            raise ValueError(f"truncate_tensors: truncated_len must be >= 0, got {truncated_len}")
        selected = set(self.keys() if keys is None else keys)
        unknown = selected - set(self.keys())
        if unknown:
            raise KeyError(f"truncate_tensors: no such keys {sorted(unknown)}")
        values = {
            key: value.narrow(dim, 0, min(truncated_len, value.shape[dim]))
            if key in selected and isinstance(value, torch.Tensor) and value.dim() > dim
            else value
            for key, value in self.items()
        }
        return self._with_values(values, self._microbatch_plan)

    # -------------------------------------------------------------------------------- sharding

    @overload
    def shard_by_batch_size(
        self,
        shards: int,
        batch_size: int | None = None,
        allow_uneven_shards: bool = False,
        dynamic_batching_args: None = None,
        sequence_packing_args: None = None,
    ) -> list[Self]: ...

    @overload
    def shard_by_batch_size(
        self,
        shards: int,
        batch_size: int | None = None,
        allow_uneven_shards: bool = False,
        *,
        dynamic_batching_args: DynamicBatchingArgs,
        sequence_packing_args: None = None,
    ) -> tuple[list[Self], list[int]]: ...

    @overload
    def shard_by_batch_size(
        self,
        shards: int,
        batch_size: int | None = None,
        allow_uneven_shards: bool = False,
        *,
        dynamic_batching_args: None = None,
        sequence_packing_args: SequencePackingArgs,
    ) -> tuple[list[Self], list[int]]: ...

    @overload
    def shard_by_batch_size(
        self,
        shards: int,
        batch_size: int | None = None,
        allow_uneven_shards: bool = False,
        dynamic_batching_args: DynamicBatchingArgs | None = None,
        sequence_packing_args: SequencePackingArgs | None = None,
    ) -> list[Self] | tuple[list[Self], list[int]]: ...

    def shard_by_batch_size(
        self,
        shards: int,
        batch_size: int | None = None,
        allow_uneven_shards: bool = False,
        dynamic_batching_args: DynamicBatchingArgs | None = None,
        sequence_packing_args: SequencePackingArgs | None = None,
    ) -> list[Self] | tuple[list[Self], list[int]]:
        """Split the batch for `shards` data-parallel ranks, optimiser step by optimiser step.

        The batch is cut into consecutive steps of `batch_size` rows (one optimiser step's
        global batch; None: the whole batch is one step; size must be a multiple). Each step is
        split across the ranks: `batch_size / shards` rows each, or with `allow_uneven_shards`
        sizes differing by at most one (lower ranks larger). Shard r holds its rows of step 0,
        then of step 1, and so on, so `shard.get_batch(s, ...)` is its part of step s.

        Plain (no args): rank r's rows of step s are the consecutive rows
        [s*bs + start_r, s*bs + end_r) in their original order; returns the list of shards.

        With `dynamic_batching_args` or `sequence_packing_args` (not both): within each step,
        rows are dealt to ranks balancing total length (longest first to the least-loaded
        rank), each rank groups its rows into micro-batches within the token budget, and ranks
        with fewer micro-batches split theirs until every rank has the same number in that
        step (always possible with even shards). With uneven shards a rank may need more
        micro-batches than another has rows; the step is then grouped as a whole and whole
        micro-batches are dealt to ranks, so ranks may get different row counts; if no equal
        count of non-empty micro-batches exists, ValueError. Each shard's rows are laid out micro-batch by micro-batch (longest first) and
        it carries the plan (`microbatch_plan`, `micro_batch_indices`, `micro_batch_lengths`).
        Returns `(shards, sorted_indices)` where `sorted_indices[j]` is the original row of
        row j of the shards concatenated in rank order, i.e.
        `BatchedDataDict.from_batches(shards).reorder_data(sorted_indices)` restores the
        original order (apply the same to per-row outputs gathered from the ranks).
        A single sequence longer than the budget is an error naming its row and length.
        """
        if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
            raise ValueError(f"shard_by_batch_size: shards must be a positive int, got {shards!r}")
        if dynamic_batching_args is not None and sequence_packing_args is not None:
            raise ValueError(
                "shard_by_batch_size: pass dynamic_batching_args or sequence_packing_args, not both"
            )
        total = self.size
        step_size = total if batch_size is None else batch_size
        if step_size < 1 or total % step_size != 0:
            raise ValueError(
                f"shard_by_batch_size: batch of {total} rows is not a positive multiple of batch_size={batch_size}"
            )
        if step_size % shards != 0 and not allow_uneven_shards:
            raise ValueError(
                f"shard_by_batch_size: batch_size={step_size} is not divisible by shards={shards}; "
                "pass allow_uneven_shards=True to allow shards differing by one row"
            )
        num_steps = total // step_size
        rank_bounds = _even_split(step_size, shards)

        args = dynamic_batching_args or sequence_packing_args
        if args is None:
            return [
                self.select_indices(
                    [step * step_size + row for step in range(num_steps) for row in range(start, end)]
                )
                for start, end in rank_bounds
            ]

        rule = GroupingRule.for_args(args)
        lengths = self._sequence_lengths(args.input_key, args.input_lengths_key)
        rank_sizes = [end - start for start, end in rank_bounds]
        # step_groups[s][r] = rank r's micro-batches (lists of original rows) in step s
        step_groups = [
            plan_step(range(step * step_size, (step + 1) * step_size), lengths, rank_sizes, rule, step)
            for step in range(num_steps)
        ]
        return self._build_planned_shards(step_groups, lengths, rule, args.input_key)

    def _sequence_lengths(self, input_key: str, lengths_key: str) -> list[int]:
        for key in (input_key, lengths_key):
            if key not in self:
                raise KeyError(
                    f"shard_by_batch_size: the batch has no key {key!r} (keys: {sorted(self.keys())})"
                )
        tokens = self[input_key]
        if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2:
            raise ValueError(f"shard_by_batch_size: {input_key!r} must be a [batch, seq_len] tensor")
        raw = self[lengths_key]
        if isinstance(raw, torch.Tensor):
            if raw.dim() != 1 or raw.is_floating_point() or raw.dtype == torch.bool:
                raise ValueError(
                    f"shard_by_batch_size: {lengths_key!r} must be a 1-d integer tensor, "
                    f"got {raw.dtype} of shape {list(raw.shape)}"
                )
            lengths = [int(x) for x in raw.tolist()]
        else:
            lengths = [int(x) for x in raw]
        max_len = tokens.shape[1]
        for row, length in enumerate(lengths):
            if not 0 <= length <= max_len:
                raise ValueError(
                    f"shard_by_batch_size: {lengths_key!r} of row {row} is {length}, "
                    f"outside [0, {max_len}] ({input_key!r} has {max_len} columns)"
                )
        return lengths

    def _build_planned_shards(
        self, step_groups: list[list[list[list[int]]]], lengths: list[int], rule: GroupingRule, input_key: str
    ) -> tuple[list[Self], list[int]]:
        shards = []
        sorted_indices: list[int] = []
        for rank in range(len(step_groups[0])):
            rows: list[int] = []
            plan_steps = []
            for groups in step_groups:
                micro_batches = []
                for group in groups[rank]:
                    group_lengths = [lengths[row] for row in group]
                    micro_batches.append(
                        MicroBatch(
                            len(rows),
                            len(rows) + len(group),
                            rule.seq_len(group_lengths),
                            rule.num_tokens(group_lengths),
                        )
                    )
                    rows.extend(group)
                plan_steps.append(tuple(micro_batches))
            shard = self.select_indices(rows)
            shard._microbatch_plan = MicroBatchPlan(
                kind=rule.kind, input_key=input_key, steps=tuple(plan_steps)
            )
            shards.append(shard)
            sorted_indices.extend(rows)
        return shards, sorted_indices

    # ---------------------------------------------------------------------- micro-batch iterators

    def make_microbatch_iterator(self, microbatch_size: int) -> Iterator[Self]:
        """Consecutive slices of `microbatch_size` rows (the last may be shorter)."""
        if microbatch_size < 1:
            raise ValueError(
                f"make_microbatch_iterator: microbatch_size must be positive, got {microbatch_size}"
            )
        size = self.size
        for start in range(0, size, microbatch_size):
            yield self.slice(start, min(start + microbatch_size, size))

    def get_microbatch_iterator_len(self, microbatch_size: int) -> int:
        if microbatch_size < 1:
            raise ValueError(
                f"get_microbatch_iterator_len: microbatch_size must be positive, got {microbatch_size}"
            )
        return -(-self.size // microbatch_size)

    def make_microbatch_iterator_with_dynamic_shapes(
        self, pad_value_dict: Mapping[str, float] | None = None
    ) -> Iterator[Self]:
        """The planned dynamic-batching micro-batches, every step in order.

        Sequence-aligned tensors (module docstring) are truncated, or right-padded with
        `pad_value_dict[key]` (default 0), to exactly the micro-batch's `seq_len`.
        """
        return self._planned_microbatches("dynamic_batching", pad_value_dict)

    def get_microbatch_iterator_dynamic_shapes_len(self) -> int:
        return self._planned_microbatch_count("dynamic_batching")

    def make_microbatch_iterator_for_packable_sequences(
        self, pad_value_dict: Mapping[str, float] | None = None
    ) -> Iterator[Self]:
        """One micro-batch per planned bin, every step in order, ready for `pack_sequences`.

        Sequence-aligned tensors are truncated/padded to the bin's `seq_len` (its longest
        sequence rounded up to the pad multiple) as in the dynamic-shapes iterator.
        """
        return self._planned_microbatches("sequence_packing", pad_value_dict)

    def get_microbatch_iterator_for_packable_sequences_len(self) -> int:
        return self._planned_microbatch_count("sequence_packing")

    def _require_plan(self, kind: PlanKind) -> MicroBatchPlan:
        plan = self._microbatch_plan
        if plan is None:
            raise ValueError(
                f"this BatchedDataDict has no micro-batch plan; {kind} micro-batches need a shard from "
                f"shard_by_batch_size(..., {'dynamic_batching_args' if kind == 'dynamic_batching' else 'sequence_packing_args'}=...)"
            )
        if plan.kind != kind:
            raise ValueError(f"this shard was planned for {plan.kind}, not {kind}; use the matching iterator")
        return plan

    def _planned_microbatch_count(self, kind: PlanKind) -> int:
        return sum(len(step) for step in self._require_plan(kind).steps)

    def _planned_microbatches(
        self, kind: PlanKind, pad_value_dict: Mapping[str, float] | None
    ) -> Iterator[Self]:
        plan = self._require_plan(kind)
        pads = pad_value_dict or {}
        seq_dim = self[plan.input_key].shape[1]
        for step in plan.steps:
            for mb in step:
                values = {
                    key: _resize_dim1(value[mb.start : mb.end], mb.seq_len, pads.get(key, 0))
                    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == seq_dim
                    else value[mb.start : mb.end]
                    for key, value in self.items()
                }
                yield self._with_values(values)

    # ------------------------------------------------------------------------------- transport

    def to_msgpack(self) -> bytes:
        """Encode values and micro-batch plan as msgpack (see `rl_core.data.msgpack_codec`); no pickle."""
        payload = {
            "format": _MSGPACK_FORMAT,
            "version": _MSGPACK_VERSION,
            "data": dict(self),
            "microbatch_plan": None if self._microbatch_plan is None else self._microbatch_plan.to_dict(),
        }
        try:
            return encode_msgpack(payload)
        except (TypeError, ValueError, OverflowError) as error:
            # Re-encode key by key (only on failure) to name the offending key.
            for key, value in self.items():
                try:
                    encode_msgpack(value)
                except (TypeError, ValueError, OverflowError) as key_error:
                    raise TypeError(
                        f"BatchedDataDict.to_msgpack: cannot encode key {key!r}: {key_error}"
                    ) from key_error
            raise TypeError(f"BatchedDataDict.to_msgpack: {error}") from error

    @classmethod
    def from_msgpack(cls, data: bytes) -> Self:
        """Decode bytes written by `to_msgpack` (tensors land on CPU)."""
        payload = decode_msgpack(data)
        if not isinstance(payload, dict) or payload.get("format") != _MSGPACK_FORMAT:
            raise ValueError("from_msgpack: the bytes are not a BatchedDataDict written by to_msgpack")
        if payload.get("version") != _MSGPACK_VERSION:
            raise ValueError(
                f"from_msgpack: unsupported payload version {payload.get('version')!r} (expected {_MSGPACK_VERSION})"
            )
        out = cls(payload["data"])
        plan = payload.get("microbatch_plan")
        out._microbatch_plan = None if plan is None else MicroBatchPlan.from_dict(plan)
        return out
