"""NamedSharding against plain nested loops over the layout."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_core.distributed.named_sharding import NamedSharding


@pytest.fixture
def permuted_2x2x2() -> tuple[list[list[list[int]]], NamedSharding]:
    # A shuffled layout, so rank order differs from layout order and nothing lines up by accident.
    layout = np.random.default_rng(0).permutation(8).reshape(2, 2, 2).tolist()
    return layout, NamedSharding(layout, ["dp", "pp", "tp"])


def test_coords_and_ranks_match_plain_loops(permuted_2x2x2: tuple[list, NamedSharding]) -> None:
    layout, sharding = permuted_2x2x2
    assert sharding.names == ("dp", "pp", "tp")
    assert (sharding.ndim, sharding.size, sharding.shape) == (3, 8, (2, 2, 2))
    assert sharding.layout.tolist() == layout
    for i, j, k in itertools.product(range(2), repeat=3):
        assert sharding.get_worker_coords(layout[i][j][k]) == {"dp": i, "pp": j, "tp": k}
    for i in range(2):
        assert sharding.get_ranks(dp=i) == [layout[i][j][k] for j in range(2) for k in range(2)]
        assert sharding.get_ranks(tp=i) == [layout[a][b][i] for a in range(2) for b in range(2)]
    for j, k in itertools.product(range(2), repeat=2):
        assert sharding.get_ranks(pp=j, tp=k) == [layout[i][j][k] for i in range(2)]
    assert sharding.get_ranks(dp=1, pp=0, tp=1) == [layout[1][0][1]]
    assert sharding.get_ranks() == [r for plane in layout for row in plane for r in row]


def test_axis_sizes_of_uneven_layout() -> None:
    sharding = NamedSharding.from_axis_sizes({"dp": 3, "tp": 2})
    assert sharding.layout.tolist() == [[0, 1], [2, 3], [4, 5]]
    assert [sharding.get_axis_size(n) for n in ("dp", "tp")] == [3, 2]
    assert sharding.axis_sizes() == {"dp": 3, "tp": 2}
    assert sharding.get_ranks(tp=1) == [1, 3, 5]
    assert sharding.get_worker_coords(4) == {"dp": 2, "tp": 0}


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(1, 3), min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_coords_invert_layout_for_random_shapes(shape: list[int], seed: int) -> None:
    layout = np.random.default_rng(seed).permutation(int(np.prod(shape))).reshape(shape)
    names = [f"a{i}" for i in range(len(shape))]
    sharding = NamedSharding(layout, names)
    for index in itertools.product(*(range(s) for s in shape)):
        rank = int(layout[index])
        assert sharding.get_worker_coords(rank) == dict(zip(names, index))
        assert sharding.get_ranks(**dict(zip(names, index))) == [rank]


def test_equality_hash_and_repr() -> None:
    a = NamedSharding([[0, 1], [2, 3]], ["dp", "tp"])
    b = NamedSharding(np.array([[0, 1], [2, 3]]), ("dp", "tp"))
    assert a == b and hash(a) == hash(b)
    assert a != NamedSharding([[0, 2], [1, 3]], ["dp", "tp"])
    assert a != NamedSharding([[0, 1], [2, 3]], ["tp", "dp"])
    assert repr(a) == "NamedSharding(names=['dp', 'tp'], layout=[[0, 1], [2, 3]])"
    with pytest.raises(ValueError):
        a.layout[0, 0] = 5  # read-only view


def test_name_count_must_match_dimensions() -> None:
    with pytest.raises(ValueError, match=r"2 dimension\(s\).*but 1 name\(s\).*\['dp'\]"):
        NamedSharding([[0, 1], [2, 3]], ["dp"])


def test_ranks_must_be_a_permutation() -> None:
    with pytest.raises(ValueError, match=r"missing \[2\], repeated \[1\]"):
        NamedSharding([[0, 1], [1, 3]], ["dp", "tp"])
    with pytest.raises(ValueError, match=r"out of range \[7\]"):
        NamedSharding([0, 7], ["dp"])
    with pytest.raises(ValueError, match="integer ranks"):
        NamedSharding([0.0, 1.0], ["dp"])
    with pytest.raises(ValueError, match=r"unique; repeated: \['dp'\]"):
        NamedSharding([[0, 1], [2, 3]], ["dp", "dp"])


def test_unknown_axis_error_names_it_and_lists_valid_ones() -> None:
    sharding = NamedSharding([[0, 1], [2, 3]], ["dp", "tp"])
    with pytest.raises(KeyError, match=r"unknown sharding axis 'pp'; valid axis names are \['dp', 'tp'\]"):
        sharding.get_axis_size("pp")
    with pytest.raises(KeyError, match="'cp'"):
        sharding.get_ranks(cp=0)
    with pytest.raises(ValueError, match=r"coordinate tp=2 is out of range; axis 'tp' has size 2"):
        sharding.get_ranks(tp=2)
    with pytest.raises(ValueError, match=r"rank 4 is not in this sharding \(valid ranks: 0..3\)"):
        sharding.get_worker_coords(4)
