"""A batch iterator whose position can be saved in a checkpoint and resumed exactly.

Each epoch's order is a permutation drawn from a generator seeded by `(seed, epoch)`, so the
whole random state is `(seed, epoch)` and the position within the epoch is the number of
batches already handed out. A resumed loader yields exactly the batches an uninterrupted
one would have yielded next.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import torch

from rl_algos.data.errors import DataError

DATALOADER_STATE_FILE = "dataloader.pt"

ItemT = TypeVar("ItemT")
ItemT_co = TypeVar("ItemT_co", covariant=True)
BatchT = TypeVar("BatchT")


class IndexableDataset(Protocol[ItemT_co]):
    """Anything with a length and integer indexing: a list, a `ProcessedDataset`, ..."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> ItemT_co: ...


class StatefulDataLoader(Generic[ItemT, BatchT]):
    """Batches of `batch_size` items of `dataset`, reshuffled every epoch.

    Iterating yields the rest of the current epoch; the next iteration continues with the next
    epoch (like `torch.utils.data.DataLoader` over epochs, but resumable mid-epoch). With
    `drop_last` the incomplete last batch of an epoch is skipped, so every batch has
    `batch_size` items (GRPO needs fixed-size prompt batches).
    """

    def __init__(
        self,
        dataset: IndexableDataset[ItemT],
        batch_size: int,
        collate_fn: Callable[[list[ItemT]], BatchT],
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if len(dataset) == 0 or (drop_last and len(dataset) < batch_size):
            raise DataError(
                f"the dataset has {len(dataset)} samples, fewer than one batch of {batch_size}"
                + (" (drop_last=True)" if drop_last and len(dataset) else "")
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0  # batches of `epoch` already yielded
        self._restores = 0  # bumped by load_state_dict, which ends any iterator in progress

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(len(self.dataset), self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def epoch_order(self, epoch: int) -> list[int]:
        """The order in which epoch `epoch` visits the dataset."""
        if not self.shuffle:
            return list(range(len(self.dataset)))
        # SeedSequence mixes (seed, epoch) so neighbouring seeds do not share epoch orders.
        epoch_seed = int(
            np.random.SeedSequence([self.seed, epoch]).generate_state(1, dtype=np.uint64)[0] >> 1
        )
        generator = torch.Generator().manual_seed(epoch_seed)
        return torch.randperm(len(self.dataset), generator=generator).tolist()

    def __iter__(self) -> Iterator[BatchT]:
        epoch, start, restores = self.epoch, self.position, self._restores
        order = self.epoch_order(epoch)
        num_batches = len(self)
        for batch_index in range(start, num_batches):
            indices = order[batch_index * self.batch_size : (batch_index + 1) * self.batch_size]
            # Advance the state before yielding, so a checkpoint taken while the caller works on
            # this batch resumes at the next one; after the last batch it points at the next epoch.
            if batch_index + 1 == num_batches:
                self.epoch, self.position = epoch + 1, 0
            else:
                self.position = batch_index + 1
            yield self.collate_fn([self.dataset[i] for i in indices])
            if self._restores != restores:
                return  # the state was replaced; a fresh iterator continues from it

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "num_samples": len(self.dataset),
        }

    def load_state_dict(self, state: dict[str, Any], source: str = "dataloader state") -> None:
        """Restore the position; refuses a state saved for a different dataset or batching,
        which would silently resume at the wrong samples."""
        mine = self.state_dict()
        for key in ("num_samples", "batch_size", "drop_last", "shuffle"):
            if key not in state:
                raise DataError(f"{source}: missing '{key}'")
            if state[key] != mine[key]:
                raise DataError(
                    f"{source}: saved with {key}={state[key]!r} but this run has {key}={mine[key]!r}; "
                    "the data position cannot be resumed"
                )
        position = int(state["position"])
        if not 0 <= position < max(len(self), 1):
            raise DataError(f"{source}: position {position} is outside an epoch of {len(self)} batches")
        self.epoch, self.position, self.seed = int(state["epoch"]), position, int(state["seed"])
        self._restores += 1

    def save(self, checkpoint_dir: str | Path) -> Path:
        """Write the state to `checkpoint_dir/dataloader.pt`."""
        path = Path(checkpoint_dir) / DATALOADER_STATE_FILE
        torch.save(self.state_dict(), path)
        return path

    def load(self, checkpoint_dir: str | Path) -> None:
        """Restore the state from `checkpoint_dir/dataloader.pt`."""
        path = Path(checkpoint_dir) / DATALOADER_STATE_FILE
        if not path.exists():
            raise DataError(f"{path}: no dataloader state in this checkpoint")
        self.load_state_dict(torch.load(path, weights_only=True), source=str(path))
