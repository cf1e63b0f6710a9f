"""torch-hapi: Keras/Paddle-hapi style training on PyTorch.

``Model`` wraps an ``nn.Module`` with prepare/fit/evaluate/predict;
``hapi.metrics`` holds Paddle's ``Accuracy`` on torchmetrics;
``hapi.datasets`` reads MNIST-style IDX files; ``flops`` counts a network's
FLOPs as ``paddle.flops`` does; ``spawn`` starts a training
function on several local processes. ``hapi.callbacks`` is torch-hapi's
``callbacks`` package (Paddle's ``paddle.callbacks``), reachable by that name
even where a ``callbacks.py`` of the user's hides the top-level one.
"""

# First: every hapi module imports its callbacks as ``hapi.callbacks``, which this provides.
from hapi._callbacks import callbacks  # isort: skip
from hapi import metrics
from hapi.distributed.strategies import DDP, FSDP
from hapi.launch import spawn
from hapi.model import Model
from hapi.rng import seed_everything
from hapi.summary import flops

__all__ = ["Model", "DDP", "FSDP", "flops", "seed_everything", "spawn", "callbacks", "metrics"]
__all__ += ["datasets"]  # imported on first use (module __getattr__ below)
__version__ = "0.1.0"


def __getattr__(name: str):
    # Imported on first use: most scripts that never read a data set skip it.
    if name == "datasets":
        import hapi.datasets

        return hapi.datasets
    raise AttributeError(f"module 'hapi' has no attribute {name!r}")
