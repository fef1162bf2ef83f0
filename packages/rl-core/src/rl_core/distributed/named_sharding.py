"""Named N-d layouts of global ranks (`dp`, `pp`, `tp`, `cp`, ...).

A `NamedSharding` says where every worker sits in a parallelism grid: entry
``layout[i, j, ...]`` is the global rank at coordinates ``(i, j, ...)`` along the axes
``names``. Worker groups use it to decide which worker gets which shard of the data.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


class NamedSharding:
    """An N-d array of global ranks whose axes carry names.

    Args:
        layout: nested list (or numpy array) of ints; its values must be a permutation of
            ``0 .. size-1``.
        names: one name per layout dimension, outermost first (e.g. ``["dp", "tp"]``).
    """

    def __init__(self, layout: Any, names: Sequence[str]) -> None:
        array = np.asarray(layout)
        if isinstance(names, str):
            raise TypeError(f"NamedSharding names must be a sequence of axis names, got the string {names!r}")
        names_tuple = tuple(names)
        if array.ndim != len(names_tuple):
            raise ValueError(
                f"NamedSharding layout has {array.ndim} dimension(s) (shape {array.shape}) "
                f"but {len(names_tuple)} name(s) were given: {list(names_tuple)}"
            )
        if len(set(names_tuple)) != len(names_tuple):
            duplicates = sorted({n for n in names_tuple if names_tuple.count(n) > 1})
            raise ValueError(f"NamedSharding axis names must be unique; repeated: {duplicates}")
        for name in names_tuple:
            if not isinstance(name, str) or not name:
                raise ValueError(f"NamedSharding axis names must be non-empty strings, got {name!r}")
        if array.size == 0:
            raise ValueError(f"NamedSharding layout is empty (shape {array.shape})")
        if not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"NamedSharding layout must hold integer ranks, got dtype {array.dtype}")
        flat = array.reshape(-1)
        expected = np.arange(array.size)
        if not np.array_equal(np.sort(flat), expected):
            missing = sorted(set(expected.tolist()) - set(flat.tolist()))
            counts = np.bincount(flat[(flat >= 0) & (flat < array.size)], minlength=array.size)
            repeated = np.flatnonzero(counts > 1).tolist()
            out_of_range = sorted({int(r) for r in flat.tolist() if r < 0 or r >= array.size})
            raise ValueError(
                f"NamedSharding layout must contain each rank 0..{array.size - 1} exactly once; "
                f"missing {missing}, repeated {repeated}, out of range {out_of_range}"
            )
        self._layout = array.astype(np.int64)
        self._layout.setflags(write=False)
        self._names = names_tuple
        # rank -> coordinates, computed once: lookups happen per worker per call.
        self._coords_by_rank: dict[int, tuple[int, ...]] = {
            int(rank): tuple(int(i) for i in index) for index, rank in np.ndenumerate(self._layout)
        }

    @classmethod
    def from_axis_sizes(cls, axis_sizes: Mapping[str, int]) -> NamedSharding:
        """Row-major layout: ``from_axis_sizes({"dp": 2, "tp": 2})`` gives ``[[0, 1], [2, 3]]``."""
        for name, size in axis_sizes.items():
            if not isinstance(size, int | np.integer) or size < 1:
                raise ValueError(f"axis {name!r} must have a positive integer size, got {size!r}")
        shape = tuple(int(s) for s in axis_sizes.values())
        return cls(np.arange(math.prod(shape)).reshape(shape), list(axis_sizes))

    @property
    def names(self) -> tuple[str, ...]:
        return self._names

    @property
    def ndim(self) -> int:
        return len(self._names)

    @property
    def size(self) -> int:
        return int(self._layout.size)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self._layout.shape)

    @property
    def layout(self) -> np.ndarray:
        """The rank array (read-only)."""
        return self._layout

    def axis_sizes(self) -> dict[str, int]:
        return dict(zip(self._names, self.shape))

    def _axis_index(self, name: str) -> int:
        try:
            return self._names.index(name)
        except ValueError:
            raise KeyError(
                f"unknown sharding axis {name!r}; valid axis names are {list(self._names)}"
            ) from None

    def get_axis_size(self, name: str) -> int:
        return self.shape[self._axis_index(name)]

    def get_worker_coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank`` along every axis, e.g. ``{"dp": 1, "tp": 0}``."""
        try:
            coords = self._coords_by_rank[int(rank)]
        except (KeyError, TypeError, ValueError):
            raise ValueError(
                f"rank {rank!r} is not in this sharding (valid ranks: 0..{self.size - 1})"
            ) from None
        return dict(zip(self._names, coords))

    def get_ranks(self, **coords: int) -> list[int]:
        """Ranks whose coordinates equal ``coords`` on the named axes, in layout (row-major) order.

        ``get_ranks(dp=1)`` on a dp x tp layout lists the tp group of data-parallel rank 1;
        with no arguments it lists every rank.
        """
        index: list[int | slice] = [slice(None)] * self.ndim
        for name, value in coords.items():
            axis = self._axis_index(name)
            size = self.shape[axis]
            if not isinstance(value, int | np.integer) or not 0 <= value < size:
                raise ValueError(
                    f"coordinate {name}={value!r} is out of range; axis {name!r} has size {size}"
                )
            index[axis] = int(value)
        return [int(r) for r in np.asarray(self._layout[tuple(index)]).reshape(-1)]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, NamedSharding):
            return NotImplemented
        return self._names == other._names and np.array_equal(self._layout, other._layout)

    def __hash__(self) -> int:
        return hash((self._names, self._layout.shape, self._layout.tobytes()))

    def __repr__(self) -> str:
        return f"NamedSharding(names={list(self._names)}, layout={self._layout.tolist()})"
