"""Callbacks for torch-hapi: the Keras/Paddle hook protocol and the built-ins.

This package never imports ``hapi``: a callback knows the model only through
its documented public API and the ``logs`` dicts (see ``callbacks.base``).
"""

from .base import Callback, CallbackList  # noqa: F401 (CallbackList: the loop's dispatcher)
from .checkpoint import BackupAndRestore, ModelCheckpoint
from .csv_logger import CSVLogger
from .early_stopping import EarlyStopping
from .ema import EMA
from .history import History
from .lambda_callback import LambdaCallback
from .lr import LRScheduler, ReduceLROnPlateau
from .monitor import MonitorNameWarning
from .nan import TerminateOnNaN
from .progbar import ProgBarLogger
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
    "ReduceLROnPlateau",
    "TensorBoard",
    "TerminateOnNaN",
    "VisualDL",
    "WandbCallback",
]
