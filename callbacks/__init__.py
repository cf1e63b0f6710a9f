"""Callbacks for torch-hapi: the Keras/Paddle hook protocol and the built-ins.

This package never imports ``hapi``: a callback knows the model only through
its documented public API and the ``logs`` dicts (see ``callbacks.base``).
"""

from callbacks.base import Callback, CallbackList
from callbacks.checkpoint import BackupAndRestore, ModelCheckpoint
from callbacks.csv_logger import CSVLogger
from callbacks.ema import EMA
from callbacks.early_stopping import EarlyStopping
from callbacks.history import History
from callbacks.lr import LRScheduler, ReduceLROnPlateau
from callbacks.monitor import MonitorNameWarning
from callbacks.nan import TerminateOnNaN
from callbacks.progbar import ProgBarLogger
from callbacks.tensorboard import TensorBoard
from callbacks.visualdl import VisualDL

__all__ = [
    "BackupAndRestore",
    "Callback",
    "CallbackList",
    "CSVLogger",
    "EarlyStopping",
    "EMA",
    "History",
    "LRScheduler",
    "ModelCheckpoint",
    "MonitorNameWarning",
    "ProgBarLogger",
    "ReduceLROnPlateau",
    "TensorBoard",
    "TerminateOnNaN",
    "VisualDL",
]
