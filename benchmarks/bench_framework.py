"""Framework cost: ``Model.fit`` against a hand-written loop over the same DataLoader.

One epoch of the seeds' LeNet (Adam 1e-3, batch 64) on 12,800 real Fashion-MNIST
images, interleaved, medians. Targets: <= 1.02x with ``verbose=0``, <= 1.03x with
progress output (Paddle-style lines, and the tqdm bar as on a terminal).

    python benchmarks/bench_framework.py [--repeats 5] [--samples 12800]
"""

from __future__ import annotations

import sys
import unittest.mock

import torch
from torch import nn
from torch.utils.data import DataLoader

from common import BATCH, hand_loop, interleave, lenet_and_adam, quiet_stdout, setup, table
from hapi import Model


def main() -> None:
    repeats, data = setup()

    def loader():
        return DataLoader(data, batch_size=BATCH, shuffle=True)

    def hand():
        network, optimizer = lenet_and_adam()
        hand_loop(network, optimizer, loader())

    def fit(verbose: int, bar: bool = False):
        def run():
            network, optimizer = lenet_and_adam()
            model = Model(network)
            model.prepare(optimizer, nn.CrossEntropyLoss())
            with quiet_stdout(), unittest.mock.patch.object(sys.stdout, "isatty", lambda: bar):
                model.fit(loader(), epochs=1, verbose=verbose, log_freq=10)
        return run

    times = interleave({
        "hand-written loop": hand,
        "Model.fit verbose=0": fit(0),
        "Model.fit verbose=2 (lines)": fit(2),
        "Model.fit verbose=1 (tqdm bar)": fit(1, bar=True),
    }, repeats)
    print(table(times, "hand-written loop",
                f"Framework cost: one epoch, {len(data)} images, batch {BATCH}, same DataLoader"))


if __name__ == "__main__":
    torch.set_num_threads(torch.get_num_threads())
    main()
