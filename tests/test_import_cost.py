"""`import hapi` is paid by every process of every launch: heavy, optional parts load on first use.

Each module below cost a measurable share of a second at `import hapi` before it was made lazy
(benchmarks/bench_startup.py measures the whole): a new eager import of one of them fails here,
named, instead of showing up weeks later as a slower start.
"""

import json
import subprocess
import sys

import pytest

# Loaded only by the feature that needs it: sharded checkpoints, FSDP, DTensor (with sympy), the
# metrics (torchmetrics, which loads matplotlib where installed and transformers where installed),
# the dashboards' writers, Ray (callbacks.RayTrainReport).
LAZY = [
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "sympy",
    "torchmetrics",
    "matplotlib",
    "transformers",
    "visualdl",
    "torch.utils.tensorboard",
    "wandb",
    "ray",
]


def _imported_after(statement: str) -> set[str]:
    probe = f"import sys, json; {statement}; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("statement", ["import hapi", "import callbacks", "from hapi import Model"])
def test_importing_the_package_leaves_heavy_optional_parts_unloaded(statement):
    loaded = _imported_after(statement)
    eager = [name for name in LAZY if name in loaded]
    assert eager == [], f"`{statement}` imported {eager}; import them where they are first used"
