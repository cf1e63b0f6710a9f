"""TensorBoard: the VisualDL callback's curves, for the TensorBoard dashboard.

For users whose runs already live in TensorBoard (``tensorboard --logdir``).
The scalars, their tags and their steps are exactly VisualDL's, because both
callbacks inherit the same bookkeeping (``callbacks.visualdl._ScalarLogger``);
only the writer differs: ``torch.utils.tensorboard.SummaryWriter``.

``tensorboard`` is an optional dependency (``pip install
"torch-hapi[tensorboard]"``), so this module does not import it: ``import
callbacks`` works without it. The constructor imports it, so that a missing
package is reported when the callback is built, not an epoch into training.
"""

from __future__ import annotations

import os
from typing import Any

from .visualdl import AUTO, Version, _ScalarLogger


class TensorBoard(_ScalarLogger):
    """Writes scalars with ``torch.utils.tensorboard.SummaryWriter`` into one directory per run.

    The same scalars, tags (``train/<name>``, ``train/lr``, ``eval/<name>``)
    and steps as :class:`callbacks.VisualDL`, whose docstring lists them, and
    the same run directories: ``<log_dir>/version_<N>`` by default, so that
    ``tensorboard --logdir log_dir`` shows each run as its own curve. In a
    ``fit(eval_steps=N)`` every evaluation is plotted at the global batch
    number it follows, on the ``train/*`` curves' axis; otherwise at the
    epoch index during ``fit`` (details in :class:`callbacks.VisualDL`).

    Only the main process writes; other ranks create no file or directory.
    Everything goes to one ``events.out.tfevents.*`` file per callback, in
    :attr:`run_dir`: the writer is flushed (not closed) at the end of training
    and after a standalone evaluation, so the file is complete when the call
    returns, and the same callback given to a later ``evaluate`` adds its
    ``eval/*`` scalars to that file. It is closed by :meth:`close` or at
    interpreter exit.

    Args:
        log_dir: the directory to point ``tensorboard --logdir`` at; created
            on the first write by the main process.
        version: the run's subdirectory of ``log_dir``: ``"auto"`` (default)
            ``version_<N>``, N one more than the largest there (0 for the
            first); an int N ``version_<N>``; a str that name; ``None`` or
            ``False`` ``log_dir`` itself. As :class:`callbacks.VisualDL`.

    Raises:
        TypeError: ``log_dir`` is not a path, or ``version`` is of another type.
        ValueError: ``version`` is a negative int or not a subdirectory name.
        ImportError: the ``tensorboard`` package is missing; the message says
            how to install it.
    """

    def __init__(self, log_dir: str | os.PathLike, version: Version = AUTO) -> None:
        super().__init__(log_dir, version)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise ImportError(
                "callbacks.TensorBoard writes through torch.utils.tensorboard, which needs the "
                f"'tensorboard' package ({error}). Install it with: "
                'pip install "torch-hapi[tensorboard]"'
            ) from error
        self._summary_writer = SummaryWriter

    def _open_writer(self) -> Any:
        return self._summary_writer(log_dir=self.run_dir)
