"""Data path: ``Model.fit`` on hapi's FashionMNIST (whole batches by index) against a
hand-written loop over a torchvision-style per-sample view (``__getitem__`` + default
collate) of the same images. Target: ``Model.fit`` at most 0.80x the hand loop's time.

    python benchmarks/bench_datapath.py [--repeats 5] [--samples 12800]
"""

from __future__ import annotations


from torch import nn
from torch.utils.data import DataLoader

from common import BATCH, PerSampleView, hand_loop, interleave, lenet_and_adam, setup, table, timed
from hapi import Model
from hapi.data import make_loader


def main() -> None:
    repeats, data = setup()
    per_sample = PerSampleView(data)

    def hand():
        network, optimizer = lenet_and_adam()
        hand_loop(network, optimizer, DataLoader(per_sample, batch_size=BATCH, shuffle=True))

    def fit():
        network, optimizer = lenet_and_adam()
        model = Model(network)
        model.prepare(optimizer, nn.CrossEntropyLoss())
        model.fit(data, batch_size=BATCH, epochs=1, verbose=0)

    times = interleave({"hand loop, per-sample view": hand, "Model.fit on hapi FashionMNIST": fit},
                       repeats)
    print(table(times, "hand loop, per-sample view",
                f"Data path: one epoch, {len(data)} images, batch {BATCH}"))
    loading = {
        "per-sample DataLoader, loading only": lambda: [None for _ in DataLoader(
            per_sample, batch_size=BATCH, shuffle=True)],
        "hapi loader, loading only": lambda: [None for _ in make_loader(
            data, role="train_data", batch_size=BATCH, shuffle=True)],
    }
    print()
    print(table({name: [timed(run) for _ in range(repeats)] for name, run in loading.items()},
                "per-sample DataLoader, loading only", "Loading alone (no training)"))


if __name__ == "__main__":
    main()
