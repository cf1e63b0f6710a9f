"""Users' own samplers on several processes: each rank records what it read.

python samplers_script.py OUT_DIR: writes OUT_DIR/samplers.rank<R>.json. Also run on one
process by the test (WORLD_SIZE unset) for the reference figures.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import torch
from torch import nn
from torch.utils.data import (
    DataLoader,
    Dataset,
    Sampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

from conftest import TinyNet, make_tiny_data  # noqa: E402

from hapi import Model  # noqa: E402
from hapi.metrics import Accuracy  # noqa: E402

SAMPLES = 50
TRAIN_INDICES = list(range(0, 50, 5)) + list(range(1, 50, 5)) + list(range(2, 50, 5))  # 30 of 50
HELD_OUT = sorted(set(range(SAMPLES)) - set(TRAIN_INDICES))  # 20: a validation split
ZERO_WEIGHT = set(range(25, 50))


class Recorded(Dataset):
    """Records the indices read, per epoch (EpochMarks starts a new list)."""

    def __init__(self):
        self.x, self.y = make_tiny_data(SAMPLES)
        self.epochs: list[list[int]] = []

    def __len__(self):
        return SAMPLES

    def __getitem__(self, index):
        if not self.epochs:
            self.epochs.append([])
        self.epochs[-1].append(int(index))
        return self.x[index], self.y[index]

    def new_epoch(self):
        self.epochs.append([])


class FixedOrder(Sampler[int]):
    """A deterministic sampler of the user's own: the training split, backwards."""

    def __iter__(self):
        return iter(reversed(TRAIN_INDICES))

    def __len__(self):
        return len(TRAIN_INDICES)


class EpochAware(Sampler[int]):
    """A user's epoch-aware sampler (not a DistributedSampler): its order is a function of the
    epoch it is told, as DistributedSampler's is; without set_epoch each epoch replays the first."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(
            len(TRAIN_INDICES), generator=torch.Generator().manual_seed(self.epoch)
        )
        return iter([TRAIN_INDICES[i] for i in order])

    def __len__(self):
        return len(TRAIN_INDICES)


class OddBatches(Sampler[list]):
    """A batch sampler of the user's own (not torch's BatchSampler): batches of 3, then 7."""

    def __iter__(self):
        start, sizes = 0, [3, 7] * 5
        for size in sizes:
            yield list(range(start, start + size))
            start += size

    def __len__(self):
        return 10


class Endless(Sampler[int]):
    def __iter__(self):
        while True:
            yield 0


def model(lr: float = 0.1) -> Model:
    torch.manual_seed(0)
    network = Model(TinyNet())
    network.prepare(torch.optim.SGD(network.parameters(), lr=lr), nn.CrossEntropyLoss(), Accuracy())
    return network


def weights(trained: Model) -> list[float]:
    return torch.cat([p.detach().flatten() for p in trained.parameters()]).tolist()


def epochs_read(loader: DataLoader, trained: Model, epochs: int = 2) -> list[list[int]]:
    from callbacks import Callback

    class Marks(Callback):
        def on_epoch_begin(self, epoch, logs=None):
            loader.dataset.new_epoch()

    loader.dataset.epochs.clear()
    trained.fit(loader, epochs=epochs, verbose=0, callbacks=[Marks()])
    return [list(epoch) for epoch in loader.dataset.epochs if epoch]


def run() -> dict:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    batch = 6 // world if world in (1, 2, 3) else 2  # one process at 6 = N processes at 6/N
    results: dict = {}
    data = Recorded()
    subset = DataLoader(data, batch_size=batch, sampler=SubsetRandomSampler(TRAIN_INDICES))
    results["subset_epochs"] = epochs_read(subset, model())
    weighted = [0.0 if i in ZERO_WEIGHT else 1.0 for i in range(SAMPLES)]
    drawn = DataLoader(data, batch_size=batch, sampler=WeightedRandomSampler(weighted, 40))
    results["weighted_epochs"] = epochs_read(drawn, model())
    aware = DataLoader(data, batch_size=batch, sampler=EpochAware())
    results["epoch_aware_epochs"] = epochs_read(aware, model(), epochs=4)
    fixed = model()
    fixed.fit(DataLoader(data, batch_size=batch, sampler=FixedOrder()), epochs=2, verbose=0)
    results["fixed_order_weights"] = weights(fixed)
    results["batch_sampler_epochs"] = epochs_read(
        DataLoader(data, batch_sampler=OddBatches()), model()
    )
    # Evaluation and prediction keep the sampler's meaning too: the validation split only.
    scorer = model()
    results["eval_subset"] = scorer.evaluate(
        DataLoader(data, batch_size=4, sampler=SubsetRandomSampler(HELD_OUT)), verbose=0
    )
    data.epochs.clear()
    results["predict_fixed"] = scorer.predict(
        DataLoader(data, batch_size=4, sampler=FixedOrder()), stack_outputs=True, verbose=0
    )[0].tolist()
    results["predict_read"] = sorted(i for epoch in data.epochs for i in epoch)
    if world == 1:
        return results  # one process uses the DataLoader as given, endless or not
    try:
        model().fit(DataLoader(data, batch_size=batch, sampler=Endless()), verbose=0)
        results["endless"] = "no error"
    except Exception as error:  # noqa: BLE001 -- the test reads the message
        results["endless"] = f"{type(error).__name__}: {error}"
    return results


if __name__ == "__main__":
    out = pathlib.Path(sys.argv[1])
    rank = os.environ.get("RANK", "0")
    (out / f"samplers.rank{rank}.json").write_text(json.dumps(run()))
