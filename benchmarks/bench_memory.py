"""Peak resident memory of one hapitrain epoch against the hand-written loop.

Each runs in its own fresh process (peak RSS is per process). Target: within 10%.

    python benchmarks/bench_memory.py [--samples 60000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys
sys.path.insert(0, {here!r})
from torch import nn
from torch.utils.data import DataLoader
from common import BATCH, hand_loop, lenet_and_adam, real_train_data
data = real_train_data({samples})
network, optimizer = lenet_and_adam()
if {kind!r} == "hand":
    hand_loop(network, optimizer, DataLoader(data, batch_size=BATCH, shuffle=True))
else:
    from hapi import Model
    from hapi.metrics import Accuracy
    model = Model(network)
    model.prepare(optimizer, nn.CrossEntropyLoss(), Accuracy(topk=(1, 2)))
    model.fit(data, batch_size=BATCH, epochs=1, verbose=0)
print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))
"""


def peak_kib(kind: str, samples: int) -> int:
    import pathlib

    here = str(pathlib.Path(__file__).resolve().parent)
    out = subprocess.run(
        [sys.executable, "-c", CHILD.format(here=here, samples=samples, kind=kind)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=60_000)
    args = parser.parse_args()
    hand, fit = peak_kib("hand", args.samples), peak_kib("hapi", args.samples)
    print("## Peak resident memory, one epoch\n")
    print("| run | peak RSS MiB | ratio |\n|---|---|---|")
    print(f"| hand-written loop | {hand / 1024:.0f} | 1.000 |")
    print(f"| Model.fit (with Accuracy top-1/2) | {fit / 1024:.0f} | {fit / hand:.3f} |")


if __name__ == "__main__":
    main()
