"""Start-up: what every process of every launch pays before its first batch.

Two measurements, each against its hand-written counterpart, in fresh processes that
alternate (A, B, A, B, ...) so a slow minute of this noisy machine hits both alike:

- ``import hapi`` against ``import torch`` (each in a fresh interpreter; median of
  ``--imports`` runs). Every process of a ``torchrun`` job pays it once.
- a tiny job under ``torchrun --standalone --nproc_per_node=2`` (8 batches of 64 per
  process, LeNet, Adam): ``Model.fit`` against the same training written by hand with
  ``init_process_group``, ``DistributedDataParallel`` and ``DistributedSampler``; wall
  time of the whole ``torchrun`` command, median of ``--jobs`` runs.

    python benchmarks/bench_startup.py [--imports 7] [--jobs 5] [--batches 8]

(``--imports 0`` or ``--jobs 0`` skips that part.)

Both job scripts build the same network from the same seed and the same synthetic data
(no files read), so the difference is what torch-hapi adds: its import, its set-up
(process group, DDP wrap, data sharding) and its teardown.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

NETWORK = """
import torch
from torch import nn

def lenet():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 6, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(400, 120), nn.Linear(120, 84), nn.Linear(84, 10),
    )

def data(batches, world):
    generator = torch.Generator().manual_seed(0)
    samples = 64 * batches * world
    images = torch.rand(samples, 1, 28, 28, generator=generator)
    return images, torch.randint(0, 10, (samples,), generator=generator)
"""

HAPI_JOB = (
    NETWORK
    + """
import os, sys
from hapi import Model

images, labels = data(int(sys.argv[1]), int(os.environ.get("WORLD_SIZE", "1")))
network = lenet()
model = Model(network)
model.prepare(torch.optim.Adam(network.parameters(), lr=1e-3), nn.CrossEntropyLoss())
model.fit((images, labels), batch_size=64, epochs=1)
"""
)

HAND_JOB = (
    NETWORK
    + """
import gc
import sys
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
images, labels = data(int(sys.argv[1]), dist.get_world_size())
network = DistributedDataParallel(lenet())
optimizer = torch.optim.Adam(network.parameters(), lr=1e-3)
loss_fn = nn.CrossEntropyLoss()
dataset = TensorDataset(images, labels)
sampler = DistributedSampler(dataset, shuffle=True, seed=0)
sampler.set_epoch(0)
for step, (x, y) in enumerate(DataLoader(dataset, batch_size=64, sampler=sampler)):
    loss = loss_fn(network(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if dist.get_rank() == 0:
        print(f"step {step + 1} - loss: {loss.item():.4f}", flush=True)
del network  # DDP's reducer first, while the group lives: freed after it, Gloo can abort
gc.collect()
dist.barrier()  # leave together: destroying Gloo while a peer still talks to it can abort
dist.destroy_process_group()
"""
)


def seconds(command: list[str], env: dict[str, str]) -> float:
    """Wall time of one command, which must succeed."""
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    took = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return took


def alternate(commands: dict[str, list[str]], runs: int, env: dict[str, str]) -> dict:
    """Every command ``runs`` times, in turns; the list of seconds per command."""
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(runs):
        for name, command in commands.items():
            times[name].append(seconds(command, env))
    return times


def table(title: str, times: dict[str, list[float]], baseline: str) -> None:
    base = statistics.median(times[baseline])
    print(f"\n{title}")
    print(f"| contender | median s | vs {baseline} |")
    print("|---|---|---|")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.3f} | {median / base:.3f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--imports", type=int, default=7)
    parser.add_argument("--jobs", type=int, default=5)
    parser.add_argument("--batches", type=int, default=8)
    args = parser.parse_args()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    print(
        f"python {sys.version.split()[0]}; transformers installed: "
        f"{importlib.util.find_spec('transformers') is not None}"
    )

    if args.imports > 0:
        _imports(args.imports, env)
    if args.jobs > 0:
        _jobs(args.jobs, args.batches, env)


def _imports(runs: int, env: dict[str, str]) -> None:
    imports = alternate(
        {
            "import torch": [sys.executable, "-c", "import torch"],
            "import hapi": [sys.executable, "-c", "import hapi"],
        },
        runs,
        env,
    )
    table(f"import time, fresh interpreters, {runs} runs each", imports, "import torch")


def _jobs(runs: int, batches: int, env: dict[str, str]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        scripts = {}
        for name, text in (("hand", HAND_JOB), ("hapi", HAPI_JOB)):
            scripts[name] = os.path.join(folder, f"{name}_job.py")
            with open(scripts[name], "w") as file:
                file.write(text)
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        torchrun += ["--nproc_per_node=2"]
        jobs = alternate(
            {
                "hand DDP script": torchrun + [scripts["hand"], str(batches)],
                "Model.fit": torchrun + [scripts["hapi"], str(batches)],
            },
            runs,
            env,
        )
    table(
        f"tiny job: torchrun, 2 processes, {batches} batches of 64 each, {runs} runs",
        jobs,
        "hand DDP script",
    )


if __name__ == "__main__":
    main()
