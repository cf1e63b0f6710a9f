"""Framework cost: ``Model.fit`` against a hand-written loop over the same DataLoader.

One epoch of Paddle's guide's LeNet (Adam 1e-3, batch 64) on 12,800 real Fashion-MNIST
images, interleaved, medians. Targets: <= 1.02x with ``verbose=0``, <= 1.03x with
progress output (Paddle-style lines, and the tqdm bar as on a terminal).

The table prints each row's target and a verdict on the ratio of medians, and the
spread (min..max) of the per-repeat ratios: each repeat runs every contender once,
so a repeat's ratio pairs runs taken moments apart. On a noisy machine a single
ratio can land on either side of its target; the spread says how far to trust one.

    python benchmarks/bench_framework.py [--repeats 5] [--samples 12800]
"""

from __future__ import annotations

import statistics
import sys
import unittest.mock

import torch
from common import BATCH, hand_loop, interleave, lenet_and_adam, quiet_stdout, setup, table
from torch import nn
from torch.utils.data import DataLoader

from hapi import Model

BASELINE = "hand-written loop"
# The targets of docs/benchmarks.md (Framework cost): Model.fit's time over the hand-written loop's, ratio of medians.
TARGETS = {
    "Model.fit verbose=0": 1.02,
    "Model.fit verbose=2 (lines)": 1.03,
    "Model.fit verbose=1 (tqdm bar)": 1.03,
}


def repeat_ratios(times: dict[str, list[float]], name: str) -> list[float]:
    """Each repeat's time of ``name`` over the baseline's in the same repeat (runs moments apart)."""
    return [value / base for value, base in zip(times[name], times[BASELINE])]


def with_verdicts(times: dict[str, list[float]], title: str) -> str:
    """``common.table`` plus, per row, the target, the verdict on the ratio of medians and the spread.

    Without a target and a verdict beside the ratio, a reader cannot tell 1.049x from a
    failure; without the spread, cannot tell a failure from this machine's noise.
    """
    base_median = statistics.median(times[BASELINE])
    lines = table(times, BASELINE, title).splitlines()
    for index, line in enumerate(lines):
        if line.startswith("| contender |"):
            lines[index] = line + " target | verdict | per-repeat ratios, min..max |"
        elif line.startswith("|---|"):
            lines[index] = line + "---|---|---|"
        for name in times:
            if not line.startswith(f"| {name} |"):
                continue
            ratios = repeat_ratios(times, name)
            target, verdict = "—", "baseline"
            if name in TARGETS:
                target = f"<= {TARGETS[name]:.2f}x"
                ratio = statistics.median(times[name]) / base_median
                verdict = "met" if ratio <= TARGETS[name] else "NOT met"
                if len(ratios) > 1 and min(ratios) <= TARGETS[name] <= max(ratios):
                    verdict += " (target inside the spread: within noise)"
            lines[index] = line + f" {target} | {verdict} | {min(ratios):.3f}..{max(ratios):.3f} |"
    fit_ratios = [ratio for name in TARGETS for ratio in repeat_ratios(times, name)]
    base_runs = times[BASELINE]
    lines += [
        "",
        f"Targets (docs/benchmarks.md): Model.fit costs at most 2% over the hand-written loop with "
        f"verbose=0 (ratio of medians <= {TARGETS['Model.fit verbose=0']:.2f}x), at most 3% with progress "
        f"output (<= {TARGETS['Model.fit verbose=2 (lines)']:.2f}x).",
        f"This machine's variation: over {len(base_runs)} repeat(s), Model.fit's per-repeat ratios span "
        f"{min(fit_ratios):.3f}..{max(fit_ratios):.3f}; the hand-written loop alone ran "
        f"{min(base_runs):.2f}..{max(base_runs):.2f} s "
        f"({(max(base_runs) / min(base_runs) - 1) * 100:.0f}% apart).",
    ]
    return "\n".join(lines)


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

    times = interleave(
        {
            BASELINE: hand,
            "Model.fit verbose=0": fit(0),
            "Model.fit verbose=2 (lines)": fit(2),
            "Model.fit verbose=1 (tqdm bar)": fit(1, bar=True),
        },
        repeats,
    )
    title = f"Framework cost: one epoch, {len(data)} images, batch {BATCH}, same DataLoader"
    print(with_verdicts(times, title))


if __name__ == "__main__":
    torch.set_num_threads(torch.get_num_threads())
    main()
