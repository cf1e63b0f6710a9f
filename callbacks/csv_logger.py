"""CSVLogger: one row of epoch figures per epoch, in a file any tool can read.

The whole file is rewritten atomically at every epoch end instead of appending
a line: a crash never leaves a half-written row, and a key that first appears
later (``val_*`` with ``eval_freq > 1``) still gets a proper column, with empty
cells for the epochs that lack it. Rewriting costs nothing measurable at one
write per epoch.
"""

from __future__ import annotations

import csv
import os
from typing import Any

from hapi.checkpoint import atomic_write, cause_in_words

from .base import Callback, as_path


class CSVLogger(Callback):
    """Writes ``epoch`` and every figure of ``on_epoch_end``'s logs to a CSV file.

    A plain file any spreadsheet or ``pandas.read_csv`` opens, for runs with
    no dashboard. Columns are ``epoch`` (0-based, as Keras writes it)
    followed by the union of all keys seen so far, sorted. Only the main
    process writes.

    Args:
        filename: path of the CSV file; its directory is created if needed.
        separator: the one-character field delimiter.
        append: keep the rows of an existing file (e.g. when resuming)
            instead of starting a new file.

    Raises:
        TypeError: ``filename`` is not a path.
        ValueError: ``separator`` is not one character.
        OSError: at an epoch end, when the file cannot be written (a full
            disk, say): its ``errno``, naming the file and the cause.
    """

    def __init__(
        self, filename: str | os.PathLike, separator: str = ",", append: bool = False
    ) -> None:
        super().__init__()
        self.filename = as_path("CSVLogger", "filename", filename, "file", "log/train.csv")
        if not isinstance(separator, str) or len(separator) != 1:
            raise ValueError(
                f"CSVLogger: separator must be a single character; received {separator!r}. "
                "Pass e.g. separator=',' or separator='\\t'."
            )
        self.separator = separator
        self.append = bool(append)
        self.rows: list[dict[str, str]] = []
        self.keys: set[str] = set()

    def state_dict(self) -> dict[str, Any]:
        return {"rows": [dict(row) for row in self.rows], "keys": sorted(self.keys)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rows = [dict(row) for row in state["rows"]]
        self.keys = set(state["keys"])

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.rows = []
        self.keys = set()
        if self.append and self.is_main and os.path.exists(self.filename):
            with open(self.filename, newline="", encoding="utf-8") as handle:
                reader = csv.DictReader(handle, delimiter=self.separator)
                self.keys.update(name for name in reader.fieldnames or () if name != "epoch")
                self.rows.extend(dict(row) for row in reader)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if not self.is_main:
            return
        logs = logs or {}
        self.keys.update(logs)
        self.rows.append({"epoch": str(epoch), **{key: str(value) for key, value in logs.items()}})
        columns = ["epoch", *sorted(self.keys)]
        try:
            with atomic_write(self.filename, "w") as handle:
                writer = csv.writer(handle, delimiter=self.separator, lineterminator="\n")
                writer.writerow(columns)
                writer.writerows([row.get(key, "") for key in columns] for row in self.rows)
        except OSError as error:  # a bare "[Errno 28] No space left on device" names no file
            raise OSError(
                error.errno,
                f"CSVLogger could not write {self.filename!r}: {cause_in_words(error)}. The file "
                "there is unchanged; or pass CSVLogger another filename.",
            ) from error
