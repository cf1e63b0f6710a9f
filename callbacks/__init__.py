"""Callbacks for torch-hapi: the Keras/Paddle hook protocol and the built-ins.

A callback knows the model only through its documented public API and the
``logs`` dicts (see ``callbacks.base``); of ``hapi`` this package imports only the
public names of :mod:`hapi.checkpoint`, which owns every file written, renamed,
linked or deleted, and the argument checks of :mod:`hapi.messages`.
"""

from .base import Callback, CallbackList  # noqa: F401 (CallbackList: the loop's dispatcher)
from .history import History

# hapi loads every module of this package and takes the names above from it: a plain
# `import callbacks` loads hapi here, before a module of ours imports hapi.checkpoint
# halfway through this file.
import hapi.checkpoint  # noqa: F401  # isort: skip
from .checkpoint import BackupAndRestore, ModelCheckpoint
from .csv_logger import CSVLogger
from .early_stopping import EarlyStopping
from .ema import EMA
from .lambda_callback import LambdaCallback
from .lr import LRScheduler, ReduceLROnPlateau
from .monitor import MonitorNameWarning
from .nan import TerminateOnNaN
from .progbar import ProgBarLogger
from .ray_train import RayTrainReport  # imports ray only when built
from .tensorboard import TensorBoard
from .visualdl import VisualDL
from .wandb import WandbCallback

__all__ = [
    "BackupAndRestore",
    "Callback",
    "CSVLogger",
    "EarlyStopping",
    "EMA",
    "History",
    "LambdaCallback",
    "LRScheduler",
    "ModelCheckpoint",
    "MonitorNameWarning",
    "ProgBarLogger",
    "RayTrainReport",
    "ReduceLROnPlateau",
    "TensorBoard",
    "TerminateOnNaN",
    "VisualDL",
    "WandbCallback",
]
