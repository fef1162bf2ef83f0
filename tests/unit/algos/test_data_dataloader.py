"""The resumable data loader: per-epoch seeded shuffles, exact resume from `dataloader.pt`."""

from __future__ import annotations

from itertools import islice
from pathlib import Path

import pytest
import torch

from rl_algos.data import DATALOADER_STATE_FILE, DataError, StatefulDataLoader

DATASET = [f"sample-{i}" for i in range(10)]


def make_loader(dataset: list[str] = DATASET, **kwargs) -> StatefulDataLoader[str, list[str]]:
    kwargs.setdefault("seed", 7)
    return StatefulDataLoader(dataset, batch_size=3, collate_fn=list, **kwargs)


def run_epochs(loader: StatefulDataLoader[str, list[str]], epochs: int) -> list[list[str]]:
    return [batch for _ in range(epochs) for batch in loader]


def test_epochs_are_seeded_permutations() -> None:
    loader = make_loader()
    assert len(loader) == 3  # 10 samples, batches of 3, incomplete last batch dropped
    epochs = [list(loader) for _ in range(3)]
    for epoch, batches in enumerate(epochs):
        order = loader.epoch_order(epoch)
        assert sorted(order) == list(range(10))
        assert batches == [[DATASET[i] for i in order[b * 3 : (b + 1) * 3]] for b in range(3)]
    assert len({tuple(loader.epoch_order(e)) for e in range(3)}) == 3  # reshuffled every epoch
    assert run_epochs(make_loader(), 3) == [
        b for batches in epochs for b in batches
    ]  # same seed, same batches
    assert run_epochs(make_loader(seed=8), 1) != epochs[0]


def test_without_shuffle_and_with_last_partial_batch() -> None:
    loader = make_loader(shuffle=False, drop_last=False)
    assert list(loader) == [DATASET[0:3], DATASET[3:6], DATASET[6:9], DATASET[9:10]]
    assert loader.state_dict()["epoch"] == 1


@pytest.mark.parametrize("consumed", [1, 2, 3, 4, 7])  # mid-epoch, at the epoch boundary, later epochs
def test_resume_gives_the_same_next_batches(tmp_path: Path, consumed: int) -> None:
    uninterrupted = run_epochs(make_loader(), 3)

    interrupted = make_loader()
    stream = (batch for _ in range(3) for batch in interrupted)
    seen = list(islice(stream, consumed))
    assert seen == uninterrupted[:consumed]
    checkpoint = tmp_path / f"step_{consumed}"
    checkpoint.mkdir()
    path = interrupted.save(checkpoint)
    assert path == checkpoint / DATALOADER_STATE_FILE

    resumed = make_loader(seed=123)  # the checkpoint's RNG state wins over a new run's seed
    resumed.load(checkpoint)
    epochs_left = 3 - resumed.epoch
    assert run_epochs(resumed, epochs_left) == uninterrupted[consumed:]


def test_state_is_plain_and_loads_with_weights_only(tmp_path: Path) -> None:
    loader = make_loader()
    next(iter(loader))
    loader.save(tmp_path)
    state = torch.load(tmp_path / DATALOADER_STATE_FILE, weights_only=True)
    assert state == {
        "epoch": 0,
        "position": 1,
        "seed": 7,
        "shuffle": True,
        "batch_size": 3,
        "drop_last": True,
        "num_samples": 10,
    }


def test_loading_state_mid_iteration_restarts_from_it() -> None:
    loader = make_loader()
    reference = run_epochs(make_loader(), 1)
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    next(iterator)
    loader.load_state_dict(state)
    assert list(iterator) == []  # the old iterator stops instead of overwriting the restored position
    assert list(loader) == reference[1:]


def test_refuses_state_of_another_dataset(tmp_path: Path) -> None:
    saved = make_loader()
    saved.save(tmp_path)
    other = make_loader(DATASET[:9])
    with pytest.raises(DataError) as info:
        other.load(tmp_path)
    assert str(info.value) == (
        f"{tmp_path / DATALOADER_STATE_FILE}: saved with num_samples=10 but this run has num_samples=9; "
        "the data position cannot be resumed"
    )


def test_missing_state_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no dataloader state in this checkpoint"):
        make_loader().load(tmp_path)


def test_dataset_smaller_than_a_batch() -> None:
    with pytest.raises(DataError, match="the dataset has 2 samples, fewer than one batch of 3"):
        make_loader(DATASET[:2])
