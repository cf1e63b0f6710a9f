"""RayTrainReport: each epoch's figures and checkpoint, reported to Ray Train (and Ray Tune).

``ray[train]`` is an optional dependency (``pip install "ray[train]"``, or ``pip
install "torch-hapi[ray]"``). Importing Ray takes seconds, so neither ``import
callbacks`` nor ``import hapi`` loads it: the constructor does, inside the Ray
worker where the callback is built, and says how to install it if it is missing.
"""

from __future__ import annotations

import os
import tempfile

from .base import Callback


class RayTrainReport(Callback):
    """Reports each epoch's figures to Ray Train, with the model's checkpoint.

    Use it in ``Model.fit`` inside ``ray.train.torch.TorchTrainer``'s
    ``train_loop_per_worker``. At every epoch's end it calls
    ``ray.train.report(metrics, checkpoint=...)`` on every worker, as Ray
    requires, with ``metrics`` the dict ``on_epoch_end`` gets (the training
    figures and the evaluation's ``val_*`` figures, reduced over every worker,
    as Python floats). So ``trainer.fit()``'s result (``result.metrics``),
    Ray Tune's schedulers and searchers, and Ray's own checkpoint bookkeeping
    see them.

    The checkpoint is a ``ray.train.Checkpoint`` of a directory holding
    ``model.pt``, written by ``model.save(path, resumable=True)``: every
    worker takes part (saving is collective), the first one writes. Ray Train
    2.x keeps ``result.metrics`` only from reports that carry a checkpoint, so
    with ``checkpoint=False`` Tune sees the figures but ``result.metrics`` does
    not. Load the file with ``model.load(os.path.join(directory, "model.pt"))``;
    after a failure, Ray starts the workers again and ``ray.train.get_checkpoint()``
    returns the last one: pass its ``model.pt`` to ``fit(resume_from=...)`` to
    continue the interrupted fit exactly.

    Args:
        checkpoint: report the model's checkpoint with the figures; ``False``
            reports the figures only (no file is written).

    Attributes:
        checkpoint: whether each report carries the model's checkpoint.
        FILE: the checkpoint's file name in the reported directory, ``"model.pt"``.

    Raises:
        ImportError: Ray Train is not installed; the message says how to
            install it.
    """

    FILE = "model.pt"  # the checkpoint's file inside the reported directory

    def __init__(self, checkpoint: bool = True) -> None:
        super().__init__()
        try:
            import ray.train  # noqa: F401  (the hooks use it: found, and loaded, here)
        except ImportError as error:
            raise ImportError(
                f"callbacks.RayTrainReport reports to Ray Train, which is not installed ({error}). "
                'Install it with: pip install "ray[train]" (or pip install "torch-hapi[ray]")'
            ) from error
        self.checkpoint = bool(checkpoint)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        import ray.train  # loaded by the constructor: a dictionary look-up

        metrics = {name: float(value) for name, value in (logs or {}).items()}
        if not self.checkpoint:
            ray.train.report(metrics)
            return
        with tempfile.TemporaryDirectory(prefix="hapi-ray-") as directory:
            # Collective: every worker saves, the first one writes; Ray copies the
            # directory into its storage before report returns.
            self.model.save(os.path.join(directory, self.FILE), resumable=True)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))
