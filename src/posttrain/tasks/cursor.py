"""The one prompt cursor both loops use: a resumable (epoch, position) in a seeded per-epoch permutation
of a dataset's prompts, with what identifies the dataset, so a checkpoint resumes only on the data
it was saved with."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

_RUN_TAG = 0x52554E  # marks a permutation key that holds a run seed


class PromptCursor:
    """A resumable position in a dataset of `size` prompts, the one both loops use: epoch and position in
    that epoch's seeded permutation (numpy's generator seeded with [seed, epoch], or with [seed, epoch,
    run_seed, _RUN_TAG] when a run's seed also orders the prompts; the tag keeps the two forms apart).

    `next()` gives one index (None once `num_epochs` passes are done; None = never), `next_indices(n)`
    the next n, crossing into the next epoch's permutation when one runs out. `state_dict()` holds the
    position and what identifies the dataset (seed, shuffle, size, the dataset's `fingerprint`);
    `load_state_dict` refuses a state saved for another dataset, naming the key that differs.
    """

    def __init__(
        self,
        size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        num_epochs: int | None = None,
        fingerprint: str | None = None,
        name: str = "train",
        run_seed: int | None = None,
    ) -> None:
        self.size, self.seed, self.shuffle, self.num_epochs = size, seed, shuffle, num_epochs
        self.run_seed = run_seed
        self.fingerprint, self.name = fingerprint, name
        self.epoch = 0
        self.position = 0
        self._order_epoch = -1
        self._order: list[int] = []

    @property
    def exhausted(self) -> bool:
        return self.size == 0 or (self.num_epochs is not None and self.epoch >= self.num_epochs)

    def _epoch_order(self) -> list[int]:
        if self._order_epoch != self.epoch:
            key = [self.seed, self.epoch]
            if self.run_seed is not None:
                key += [self.run_seed % (1 << 64), _RUN_TAG]
            rng = np.random.default_rng(key)
            self._order = rng.permutation(self.size).tolist() if self.shuffle else list(range(self.size))
            self._order_epoch = self.epoch
        return self._order

    def next(self) -> int | None:
        """The next prompt index, or None at the end of the last epoch."""
        if self.exhausted:
            return None
        index = self._epoch_order()[self.position]
        self.position += 1
        if self.position == self.size:
            self.epoch, self.position = self.epoch + 1, 0
        return index

    def next_indices(self, n: int) -> list[int]:
        """The next `n` indices, moving on to the next epoch when needed (ignores `num_epochs`)."""
        if n < 1:
            raise ValueError(f"batch size must be at least 1, got {n}")
        out: list[int] = []
        while len(out) < n:
            order = self._epoch_order()
            take = order[self.position : self.position + n - len(out)]
            out.extend(take)
            self.position += len(take)
            if self.position >= len(order):
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict[str, Any]:
        """The position, plus what identifies the dataset: save this with a checkpoint."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "run_seed": self.run_seed,
            "shuffle": self.shuffle,
            "num_items": self.size,
            "fingerprint": self.fingerprint,
        }

    def check_state_dict(self, state: Mapping[str, Any]) -> None:
        """Refuse a `state_dict()` written for a different dataset or seed, or an invalid position."""
        expected = {
            "seed": self.seed,
            "run_seed": self.run_seed,
            "shuffle": self.shuffle,
            "num_items": self.size,
            "fingerprint": self.fingerprint,
        }
        for key, value in expected.items():
            if state.get(key) != value:
                raise ValueError(
                    f"the checkpoint's {self.name} data position was saved with {key}={state.get(key)!r} but "
                    f"this dataset has {key}={value!r}; resume with the same dataset, task config and run "
                    "seed (a checkpoint without run_seed predates run-seeded prompt order: resume it with "
                    "the posttrain version that wrote it)"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < max(self.size, 1):
            raise ValueError(f"invalid {self.name} data position epoch={epoch} position={position}")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a `state_dict()`, refused as `check_state_dict` refuses."""
        self.check_state_dict(state)
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
