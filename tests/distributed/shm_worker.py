"""The shared-memory gradient average on several processes (torchrun, or started by hand).

Usage: python shm_worker.py SCENARIO OUT_DIR. Each rank writes
OUT_DIR/<scenario>.rank<R>.json; tests/distributed/test_shm_torchrun.py reads them.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import sys

import torch
from torch import nn

# The repository first, so that the folder tests/callbacks (no __init__.py)
# cannot pass for the callbacks package; then tests/ for the shared fixtures.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

from conftest import TinyNet, make_tiny_data  # noqa: E402

from hapi import Model, distributed  # noqa: E402
from hapi.distributed import ddp, shared_memory  # noqa: E402

TRAIN_SAMPLES = 64
ORDER_CALLS = 4
_reasons: list[str | None] = []  # why each wrap kept Gloo (None: the hook is installed)


def _recording(decide):
    def record(wrapped, trained):
        _reasons.append(decide(wrapped, trained))
        return _reasons[-1]

    return record


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def order_values(rank: int, call: int) -> list[float]:
    """Rank ``rank``'s gradient at backward call ``call``: per element, three values whose
    float32 sum depends on the order they are added in (1e8 + 1 rounds back to 1e8)."""
    patterns = [
        [1e8, 1.0, -1e8],
        [1.0, 1e8, -1e8],
        [-1e8, 1e8, 1.0],
        [1e8, -1e8, 1.0],
        [3.0, 1e8, -1e8],
        [0.5, 0.25, 0.125],
    ]
    return [
        pattern[(rank + call) % 3] * (1 + element % 2) for element, pattern in enumerate(patterns)
    ]


class Vector(nn.Module):
    """One parameter whose gradient is whatever coefficients the forward is given."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))

    def forward(self, coefficients: torch.Tensor) -> torch.Tensor:
        return (self.weight * coefficients).sum()


class SparseBag(nn.Module):
    """Tokens -> classes through an embedding with sparse gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(12, 4, sparse=True)
        self.out = nn.Linear(4, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.embedding(tokens).mean(dim=1))


def token_data(n: int = TRAIN_SAMPLES) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 12, (n, 5), generator=generator)
    return tokens, tokens[:, 0] % 3


def tiny_model() -> Model:
    torch.manual_seed(0)
    model = Model(TinyNet())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    return model


def sparse_model() -> Model:
    torch.manual_seed(0)
    model = Model(SparseBag())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.5), nn.CrossEntropyLoss())
    return model


def flat(model: nn.Module | Model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def hooks(model: Model) -> list[str]:
    return [hook.__name__ for hook, _ in model._wrapped._comm_hooks]


def memfd_links() -> tuple[list[str], int]:
    """This process's descriptors and mappings of a hapi buffer."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    maps = pathlib.Path("/proc/self/maps").read_text().count("memfd:hapi-allreduce")
    return [link for link in fds if "hapi-allreduce" in link], maps


def scenario_order(out: pathlib.Path) -> dict:
    """Gradients whose sum depends on the order, averaged by the hook on every rank."""
    distributed.init("cpu")
    network = Vector(len(order_values(0, 0)))
    wrapped = ddp.wrap(network, torch.device("cpu"))
    grads = []
    for call in range(ORDER_CALLS):
        network.weight.grad = None
        wrapped(torch.tensor(order_values(distributed.rank(), call))).backward()
        grads.append(network.weight.grad.numpy().tobytes().hex())
    return {
        "grads": grads,
        "comm_hooks": [hook.__name__ for hook, _ in wrapped._comm_hooks],
        "reasons": _reasons,
    }


def scenario_fit(out: pathlib.Path) -> dict:
    x, y = make_tiny_data(TRAIN_SAMPLES)
    model = tiny_model()
    model.fit((x, y), batch_size=8, epochs=2, shuffle=True, verbose=0)
    descriptors, mappings = memfd_links()
    return {
        "weights_hex": flat(model).numpy().tobytes().hex(),
        "weights": flat(model).tolist(),
        "comm_hooks": hooks(model),
        "reasons": _reasons,
        "memfd_descriptors": descriptors,
        "memfd_mappings": mappings,
    }


def scenario_sparse(out: pathlib.Path) -> dict:
    tokens, labels = token_data()
    model = sparse_model()
    model.fit((tokens, labels), batch_size=8, epochs=2, shuffle=False, verbose=0)
    return {"weights": flat(model).tolist(), "comm_hooks": hooks(model), "reasons": _reasons}


def _without(module, name: str):
    saved = getattr(module, name)
    delattr(module, name)
    return lambda: setattr(module, name, saved)


def _machine(name: str):
    saved = platform.machine
    platform.machine = lambda: name
    return lambda: setattr(platform, "machine", saved)


def _environment(name: str, value: str):
    os.environ[name] = value
    return lambda: os.environ.pop(name)


# One process's view differs from the others'; each case trains a fresh model.
DISAGREEMENTS = {
    "HAPI_SHM_ALLREDUCE=0 on rank 1": (1, lambda: _environment("HAPI_SHM_ALLREDUCE", "0")),
    "aarch64 on rank 0": (0, lambda: _machine("aarch64")),
    "no posix_fallocate on rank 0": (0, lambda: _without(os, "posix_fallocate")),
    "no sched_yield on rank 1": (1, lambda: _without(os, "sched_yield")),
    "no memfd_create on rank 0": (0, lambda: _without(os, "memfd_create")),
    "aarch64 everywhere": (None, lambda: _machine("aarch64")),
}


def scenario_disagree(out: pathlib.Path) -> dict:
    x, y = make_tiny_data(TRAIN_SAMPLES)
    results = {}
    for case, (where, make_different) in DISAGREEMENTS.items():
        restore = make_different() if where in (None, rank()) else (lambda: None)
        try:
            model = tiny_model()
            model.fit((x, y), batch_size=8, epochs=2, shuffle=False, verbose=0)
        finally:
            restore()
        results[case] = {
            "weights": flat(model).tolist(),
            "comm_hooks": hooks(model),
            "reason": _reasons[-1],
        }
    return results


def scenario_crash_after_reserve(out: pathlib.Path) -> dict:
    """Rank 0 dies right after making the buffer, before anyone maps it."""
    reserve = shared_memory.reserve

    def reserve_then_die(*args, **kwargs):
        made = reserve(*args, **kwargs)
        (out / "reserved").write_text(repr(made))
        os._exit(3)

    shared_memory.reserve = reserve_then_die
    x, y = make_tiny_data(TRAIN_SAMPLES)
    tiny_model().fit((x, y), batch_size=8, epochs=1, verbose=0)
    return {}


def scenario_attach_error(out: pathlib.Path) -> dict:
    """Rank 1 fails to map the buffer with an unexpected error: every rank raises, none waits."""
    if rank() == 1:

        def broken(*args, **kwargs):
            raise ValueError("injected on rank 1")

        shared_memory.SharedMemoryAllReduce = broken
    x, y = make_tiny_data(TRAIN_SAMPLES)
    try:
        tiny_model().fit((x, y), batch_size=8, epochs=1, verbose=0)
    except RuntimeError as error:
        return {"error": str(error)}
    return {"error": None}


def scenario_until_killed(out: pathlib.Path) -> dict:
    """Trains until a peer is killed; says when both are well into training (no callback,
    so no collective runs mid-epoch: the survivor waits in the gradient average). One long
    epoch (62,500 steps): an epoch's end reduces the figures over Gloo, and a kill landing
    there would be reported by Gloo instead of the average."""
    steps = {"n": 0}

    def loss(output, label):
        steps["n"] += 1
        if steps["n"] == 20:
            (out / f"ready.rank{rank()}").write_text(json.dumps(hooks(model)))
        return nn.functional.cross_entropy(output, label)

    x, y = make_tiny_data(1_000_000)
    torch.manual_seed(0)
    model = Model(TinyNet())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.01), loss)
    model.fit((x, y), batch_size=8, epochs=1, verbose=0)
    return {}


SCENARIOS = {
    "order": scenario_order,
    "fit": scenario_fit,
    "sparse": scenario_sparse,
    "disagree": scenario_disagree,
    "crash_after_reserve": scenario_crash_after_reserve,
    "attach_error": scenario_attach_error,
    "until_killed": scenario_until_killed,
}


def main(scenario: str, out_dir: str) -> None:
    out = pathlib.Path(out_dir)
    ddp._average_through_shared_memory = _recording(ddp._average_through_shared_memory)
    results = SCENARIOS[scenario](out)
    (out / f"{scenario}.rank{rank()}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
