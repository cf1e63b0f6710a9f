"""What each process holds under DDP and under FSDP, 2 processes, a model of 25 M parameters.

Each contender trains a few Adam steps through ``Model.fit`` under torchrun
(2 CPU processes, Gloo); just before each optimizer step every process adds up
the bytes it holds of the parameters, of their gradients and of the optimizer
state (its shards only, under FSDP). Also printed: each process's peak
resident memory, which includes everything else (DDP's gradient buckets, the
activations, torch itself). Target: FSDP's total <= 0.55x DDP's.

    python benchmarks/bench_fsdp_memory.py [--width 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent


def child(strategy: str, width: int, out: str) -> None:
    """One process of the torchrun job: train, measure, write OUT.rank<R>.json."""
    import torch
    from torch import nn

    sys.path.insert(0, str(HERE.parent))
    from common import wide_mlp  # imports torch: only in the children, as the parent needs none

    from hapi import Model
    from hapi.distributed.fsdp import local_bytes

    torch.manual_seed(0)
    model = Model(wide_mlp(width))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    model.prepare(optimizer, nn.CrossEntropyLoss(), strategy=strategy)
    held: dict[str, int] = {}

    def measure(optimizer, args, kwargs):  # gradients exist (and are synchronised) only here
        params = [p for group in optimizer.param_groups for p in group["params"]]
        held.update(
            parameters=local_bytes(params),
            gradients=local_bytes(p.grad for p in params),
            optimizer=local_bytes(
                v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
            ),
            count=sum(p.numel() for p in params),
        )

    optimizer.register_step_pre_hook(measure)
    x = torch.randn(64 * 4, 1024)
    y = torch.randint(0, 10, (64 * 4,))
    model.fit((x, y), batch_size=32, epochs=1, verbose=0)
    held["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    pathlib.Path(f"{out}.rank{os.environ['RANK']}.json").write_text(json.dumps(held))


def run(strategy: str, width: int, directory: str) -> list[dict]:
    out = os.path.join(directory, strategy)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            __file__,
            "--child",
            strategy,
            "--width",
            str(width),
            "--out",
            out,
        ],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    return [json.loads(pathlib.Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--child")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.width, args.out)
        return
    mib = 2**20
    with tempfile.TemporaryDirectory() as directory:
        results = {strategy: run(strategy, args.width, directory) for strategy in ("ddp", "fsdp")}
    count = results["ddp"][0]["count"]
    print(f"## Bytes held per process, 2 processes, {count / 1e6:.1f} M parameters, Adam\n")
    print(
        "| strategy | rank | parameters MiB | gradients MiB | optimizer MiB | total MiB | "
        "total vs DDP | peak RSS MiB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    ddp_total = max(r["parameters"] + r["gradients"] + r["optimizer"] for r in results["ddp"])
    for strategy, ranks in results.items():
        for rank, held in enumerate(ranks):
            total = held["parameters"] + held["gradients"] + held["optimizer"]
            print(
                f"| {strategy} | {rank} | {held['parameters'] / mib:.1f} | {held['gradients'] / mib:.1f} | "
                f"{held['optimizer'] / mib:.1f} | {total / mib:.1f} | {total / ddp_total:.3f} | "
                f"{held['peak_rss'] / mib:.0f} |"
            )


if __name__ == "__main__":
    main()
