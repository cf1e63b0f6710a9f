"""The resume matrix's training runs: which sample ids each process trained, per epoch and step.

python resume_matrix_script.py OUT_DIR PHASE[+PHASE] CELL[,CELL...] runs each cell's
PHASE (``crash+resume``: every cell's crash, then every cell's resume):

* ``crash``: the cell's uninterrupted reference run (when the resumed run keeps the
  number of processes), then the run that calls ``os._exit(17)`` at the cell's kill point
  after creating ``OUT_DIR/<cell>/killed``;
* ``resume``: the cell started again on the same backup directory, so
  ``BackupAndRestore`` resumes it.

Each phase runs on the cell's number of processes (before the crash, or after it),
forked from this script so that torch and hapi are imported once, each with the
environment torchrun gives its workers (RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...); when
one process fails the others are killed, as torchrun does. Under torchrun itself
(WORLD_SIZE set) the phase runs in the launched processes instead, one crash per
invocation. Everything the processes print goes to stderr, after a line
``=== <cell> <phase> ===``.

Every sample carries its id as an extra input column; :class:`IdNet` strips it and,
while training, appends ``"epoch step id id ..."`` (``step``: ``model.step`` before the
batch, so a backup at optimizer step S covers exactly the lines with step < S) to
``OUT_DIR/<cell>/<run>.rank<R>.log``, written and closed at once: a kill leaves nothing
buffered. Each finished run writes ``OUT_DIR/<cell>/<run>.rank<R>.json``: final weights
(gathered, also under FSDP), ``History.evaluations``, where the run started (epoch,
step, batch: a resume's restored position), the backup's optimizer step as the file
said before the run, and the error if fit raised.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import pathlib
import random
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    RandomSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import hapi.distributed  # noqa: E402
from callbacks import BackupAndRestore, Callback  # noqa: E402
from hapi import Model  # noqa: E402

SAMPLES = 23  # odd: 2 and 3 processes pad their shards
BATCH = 2  # per process
EPOCHS = 3
SUBSET = [i for i in range(SAMPLES) if i % 4 != 3]  # 17 ids: SubsetRandomSampler's share
EVAL_SAMPLES = 9


@dataclass(frozen=True)
class Cell:
    """One point of the matrix.

    Rank ``kill_rank`` exits once ``model.step`` is ``kill_step``, at the point
    ``crash`` names (see :class:`Recorder`); BackupAndRestore backs up every
    ``save_freq`` optimizer steps.
    """

    data: str  # tensors, dataset, loader_shuffle, subset, subset_gen, batch_sampler, weighted,
    # torch_batch_sampler (torch's BatchSampler given as batch_sampler=: read in samples)
    before: int  # processes of the crashed run
    after: int  # processes of the resumed run
    crash: str  # mid_epoch, mid_accumulation, eval_boundary, after_save, epoch1
    save_freq: int  # BackupAndRestore's, in optimizer steps
    kill_step: int
    kill_rank: int = 0
    workers: int = 0
    accumulate: int = 1
    eval_steps: int | None = None
    strategy: str | None = None  # None: DDP (the default); "fsdp"
    # A second crash before the resume: the resumed run, on ``after`` processes, is killed
    # (rank 0) when ``model.step`` reaches ``again``, and resumed once more on ``after``.
    again: int | None = None
    # Every process on a stream of its own (hapi.seed_everything(0, per_process=True)): a resume
    # must give each its own random state back. The backup directory named relative to the
    # working directory, as a user writes it ("backup").
    per_process: bool = False

    @property
    def mid_accumulation(self) -> bool:
        return self.crash == "mid_accumulation"

    @property
    def expected_ids(self) -> list[int]:
        return SUBSET if self.data.startswith("subset") else list(range(SAMPLES))

    @property
    def padding_unit(self) -> int:
        """Samples one padding item holds: the user's batch sampler's items are whole batches."""
        return BATCH if self.data == "batch_sampler" else 1


# Steps per epoch (23 samples, 2 per process per batch): 12 batches on one process,
# 6 per process on two, 4 on three; the 17-id subset: 9 on one, 5 on two. The comments
# say where the backup a resume starts from lies ("ep 0 @ 6": epoch 0, 6 batches done).
CELLS = {
    # 1 -> 1
    "tensors-1to1-mid_epoch": Cell("tensors", 1, 1, "mid_epoch", 3, 8),  # ep 0 @ 6
    "loader_shuffle-w2-1to1-after_save": Cell(
        "loader_shuffle", 1, 1, "after_save", 4, 4, workers=2
    ),  # ep 0 @ 4, killed as batch 4 begins
    "batch_sampler-1to1-mid_epoch": Cell("batch_sampler", 1, 1, "mid_epoch", 3, 8),  # ep 0 @ 6
    "weighted-1to1-eval_boundary": Cell(
        "weighted", 1, 1, "eval_boundary", 3, 6, eval_steps=2
    ),  # ep 0 @ 6, killed as the evaluation at step 6 begins
    # 2 -> 2
    "dataset-w2-2to2-mid_accumulation": Cell(
        "dataset", 2, 2, "mid_accumulation", 2, 5, kill_rank=1, workers=2, accumulate=2
    ),  # 3 updates an epoch; ep 1 @ 2, killed after batch 4 (the first of its group)
    "batch_sampler-2to2-eval_boundary": Cell(
        "batch_sampler", 2, 2, "eval_boundary", 2, 4, eval_steps=2
    ),  # ep 0 @ 4, killed as the evaluation at step 4 begins
    "tensors-own_streams-2to2-mid_epoch": Cell(
        "tensors", 2, 2, "mid_epoch", 3, 4, kill_rank=1, per_process=True
    ),  # ep 0 @ 3; dropout differs between the processes
    "tensors-fsdp-2to2-after_save": Cell(
        "tensors", 2, 2, "after_save", 3, 3, kill_rank=1, strategy="fsdp"
    ),  # ep 0 @ 3, killed as batch 3 begins
    # 2 -> 1
    "subset-2to1-mid_epoch": Cell("subset", 2, 1, "mid_epoch", 2, 3),  # ep 0 @ 2
    "dataset-fsdp-2to1-mid_accumulation": Cell(
        "dataset", 2, 1, "mid_accumulation", 2, 2, kill_rank=1, accumulate=2, strategy="fsdp"
    ),  # ep 0 @ 4, killed after batch 4 (the first of its group)
    # 1 -> 2
    "subset_gen-1to2-epoch1": Cell("subset_gen", 1, 2, "epoch1", 3, 14),  # ep 1 @ 3
    "torch_batch_sampler-1to2-mid_epoch": Cell("torch_batch_sampler", 1, 2, "mid_epoch", 3, 8),
    "tensors-w2-1to2-mid_accumulation": Cell(
        "tensors", 1, 2, "mid_accumulation", 2, 3, workers=2, accumulate=2
    ),  # 6 updates an epoch; ep 0 @ 4, killed after batch 6 (the first of its group)
    # 2 -> 3
    "weighted-2to3-mid_epoch": Cell("weighted", 2, 3, "mid_epoch", 2, 5),  # ep 0 @ 4
    "loader_shuffle-2to3-epoch1": Cell("loader_shuffle", 2, 3, "epoch1", 2, 9, kill_rank=1),
    # 2 -> 1, killed again, -> 1: a resume on as many processes after one on another number,
    # in the same epoch (the rest of epoch 0 is 8 batches on one process: steps 3..10)
    "tensors-2to1to1-mid_epoch": Cell("tensors", 2, 1, "mid_epoch", 2, 3, kill_rank=1, again=7),
    "loader_shuffle-2to1to1-mid_epoch": Cell(
        "loader_shuffle", 2, 1, "mid_epoch", 2, 3, kill_rank=1, again=7
    ),  # ep 0 @ 2 (of 2 processes); then ep 0 @ 6, 4 batches into the rest on one process
    "torch_batch_sampler-2to1to1-mid_epoch": Cell(
        "torch_batch_sampler", 2, 1, "mid_epoch", 2, 3, kill_rank=1, again=7
    ),
    # ep 1 @ 2
}


class Trace:
    """Where the running fit is, for IdNet's log lines (one fit at a time per process)."""

    log: pathlib.Path | None = None
    epoch = 0
    step = 0


class IdNet(nn.Module):
    """TinyNet with dropout (a resume must restore the RNG); the last input column is the id."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(4, 16)
        self.drop = nn.Dropout(0.3)
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, x = x[:, -1], x[:, :-1]
        if self.training and Trace.log is not None:
            line = " ".join(map(str, [Trace.epoch, Trace.step, *ids.long().tolist()]))
            with open(Trace.log, "a") as handle:
                handle.write(line + "\n")
        return self.out(self.drop(torch.relu(self.hidden(x))))


def samples() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 4, generator=generator)
    ids = torch.arange(SAMPLES, dtype=torch.float32).unsqueeze(1)
    return torch.cat([x, ids], dim=1), x[:, :3].argmax(dim=1)


class Samples(Dataset):
    """A map-style data set of (features + id, label)."""

    def __init__(self) -> None:
        self.x, self.y = samples()

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]


class UserBatches:
    """A user's batch sampler: batches of a permutation drawn from torch's global generator."""

    def __init__(self, samples: int, batch: int) -> None:
        self.samples, self.batch = samples, batch

    def __iter__(self):
        order = torch.randperm(self.samples).tolist()
        for start in range(0, self.samples, self.batch):
            yield order[start : start + self.batch]

    def __len__(self) -> int:
        return -(-self.samples // self.batch)


def train_data(cell: Cell):
    """What the cell passes to fit, and fit's own shuffle/num_workers for tensors and data sets."""
    if cell.data == "tensors":
        return samples()
    dataset = Samples()
    if cell.data == "dataset":
        return dataset
    options = {"num_workers": cell.workers}
    if cell.data == "loader_shuffle":
        return DataLoader(dataset, batch_size=BATCH, shuffle=True, **options)
    if cell.data == "subset":
        return DataLoader(dataset, batch_size=BATCH, sampler=SubsetRandomSampler(SUBSET), **options)
    if cell.data == "subset_gen":
        sampler = SubsetRandomSampler(SUBSET, generator=torch.Generator().manual_seed(5))
        return DataLoader(dataset, batch_size=BATCH, sampler=sampler, **options)
    if cell.data == "batch_sampler":
        return DataLoader(dataset, batch_sampler=UserBatches(SAMPLES, BATCH), **options)
    if cell.data == "torch_batch_sampler":
        batches = BatchSampler(RandomSampler(dataset), BATCH, drop_last=False)
        return DataLoader(dataset, batch_sampler=batches, **options)
    if cell.data == "weighted":
        weights = torch.linspace(1.0, 3.0, SAMPLES)
        # Without replacement, every sample is drawn once an epoch, in a weighted order.
        sampler = WeightedRandomSampler(weights, num_samples=SAMPLES, replacement=False)
        return DataLoader(dataset, batch_size=BATCH, sampler=sampler, **options)
    raise ValueError(f"unknown data kind {cell.data!r}")


class Recorder(Callback):
    """Keeps Trace current, notes where the fit started, and kills the process on cue.

    The kill comes after every process waited for the background backups
    (``model.wait_for_saves()``, collective), so which backup survives is fixed: the
    last one at or before the kill step. Where it comes depends on the crash point:

    * at the batch end where ``model.step`` reaches ``kill_step`` (mid-epoch, epoch 1;
      this callback's batch end runs before BackupAndRestore's, which fit puts last);
    * mid-accumulation: at the next batch end, a batch that did not update;
    * after a save: at the next batch's begin, once BackupAndRestore has backed up
      ``kill_step`` at the batch end before;
    * at an ``eval_steps`` boundary: as the evaluation after step ``kill_step`` begins,
      BackupAndRestore having backed up that step at the batch end before it.
    """

    def __init__(self, cell: Cell, kill: pathlib.Path | None) -> None:
        super().__init__()
        self.cell, self.kill = cell, kill  # kill: the marker file to create before exiting
        self.start: dict | None = None
        self._last_step: int | None = None

    def on_epoch_begin(self, epoch, logs=None):
        Trace.epoch = epoch
        if self.start is None:  # BackupAndRestore has restored the position by now
            model = self.model
            self.start = {"epoch": epoch, "step": model.step, "batch": model.epoch_step}

    def on_train_batch_begin(self, step, logs=None):
        Trace.step = self.model.step
        if self.cell.crash == "after_save":
            self._maybe_kill()

    def on_train_batch_end(self, step, logs=None):
        updated = self._last_step is None or self.model.step != self._last_step
        self._last_step = self.model.step
        if self.cell.crash in ("mid_epoch", "epoch1") or (
            self.cell.crash == "mid_accumulation" and not updated
        ):
            self._maybe_kill()

    def on_eval_begin(self, logs=None):
        if self.cell.crash == "eval_boundary":
            self._maybe_kill()

    def _maybe_kill(self) -> None:
        if self.kill is None:
            return
        first = self.kill.name == "killed"
        kill_step, kill_rank = (
            (self.cell.kill_step, self.cell.kill_rank) if first else (self.cell.again, 0)
        )
        if self.model.step != kill_step:
            return
        marker, self.kill = self.kill, None
        self.model.wait_for_saves()  # collective: every process, before the kill
        if self.params["rank"] == kill_rank:
            marker.touch()
            os._exit(17)  # no cleanup, no exception: like a kill


def backup_step(backup: pathlib.Path) -> int | None:
    """The optimizer step of the backup a resume will start from, read from the file."""
    for file in (backup / "backup.pt", backup / "backup" / "checkpoint.pt"):  # FSDP: sharded
        if file.exists():
            return int(torch.load(file, weights_only=True)["step"])
    return None


def run(
    cell: Cell, out: pathlib.Path, name: str, backup: pathlib.Path, kill: pathlib.Path | None
) -> dict:
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    if cell.per_process:
        hapi.seed_everything(0, per_process=True)
        os.chdir(backup.parent)
        backup = pathlib.Path(backup.name)
    result: dict = {"backup_step": backup_step(backup), "error": None}
    Trace.log, Trace.epoch, Trace.step = out / f"{name}.rank{rank}.log", 0, 0
    model = Model(IdNet())
    model.prepare(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        nn.CrossEntropyLoss(),
        strategy=cell.strategy,
    )
    recorder = Recorder(cell, kill)
    eval_data = None
    if cell.eval_steps is not None:
        x, y = samples()
        eval_data = (x[:EVAL_SAMPLES], y[:EVAL_SAMPLES])
    try:
        history = model.fit(
            train_data(cell),
            eval_data=eval_data,
            batch_size=BATCH,
            epochs=EPOCHS,
            shuffle=True,
            verbose=0,
            num_workers=cell.workers,
            accumulate_grad_batches=cell.accumulate,
            eval_steps=cell.eval_steps,
            callbacks=[BackupAndRestore(str(backup), save_freq=cell.save_freq), recorder],
        )
    except Exception:  # noqa: BLE001 -- reported by the test, and the next cell still runs
        result["error"] = traceback.format_exc(limit=-4)
        return result
    finally:
        Trace.log = None
    state = get_model_state_dict(model.network, options=StateDictOptions(full_state_dict=True))
    result["weights"] = torch.cat([v.detach().float().flatten() for v in state.values()]).tolist()
    result["evaluations"] = [
        {"step": e["step"], "epoch": e["epoch"], "loss": e["loss"]} for e in history.evaluations
    ]
    result["start"] = recorder.start
    return result


def phase_of_cell(out: pathlib.Path, phase: str, name: str) -> int:
    """This process's part of one cell's phase; returns its exit code."""
    rank = os.environ.get("RANK", "0")
    cell, directory = CELLS[name], out / name
    directory.mkdir(parents=True, exist_ok=True)
    if phase == "again":
        if cell.again is not None:
            step = backup_step(directory / "backup")  # the backup this run resumes from
            (directory / "again_backup_step.json").write_text(json.dumps(step))
            run(cell, directory, "crashed_again", directory / "backup", directory / "killed_again")
        return 3
    if phase == "crash":
        if cell.before == cell.after:
            result = run(cell, directory, "reference", directory / "reference_backup", None)
            (directory / f"reference.rank{rank}.json").write_text(json.dumps(result))
        result = run(cell, directory, "crashed", directory / "backup", directory / "killed")
        if not (directory / "killed").exists():  # not a survivor whose collective failed
            print(f"{name}: the run ended without its kill: {result['error']}", file=sys.stderr)
        return 3
    result = run(cell, directory, "resumed", directory / "backup", None)
    (directory / f"resumed.rank{rank}.json").write_text(json.dumps(result))
    return 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(out: pathlib.Path, phase: str, name: str, rank: int, processes: int, port: int):
    """A forked child: one process of the job, as torchrun would start it; never returns."""
    os.setpgid(0, 0)  # its DataLoader workers with it, for the launcher to kill at the end
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the launcher
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # one stream, in order
    code = 1
    try:
        if processes > 1:
            os.environ.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(processes),
                LOCAL_WORLD_SIZE=str(processes),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
        code = phase_of_cell(out, phase, name)
        hapi.distributed.group.teardown()  # what atexit would do; os._exit skips it
    except BaseException:  # noqa: BLE001 -- reported through the exit code
        traceback.print_exc()
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)


def launch(out: pathlib.Path, phase: str, name: str, processes: int, timeout: float) -> list:
    """One cell's phase on ``processes`` processes forked from this one (torch and hapi are
    imported once), with torchrun's environment; when one fails, the others (blocked in
    a collective) are killed, as torchrun does. Returns the exit codes by rank."""
    port = _free_port()
    sys.stdout.flush(), sys.stderr.flush()
    children = {}
    for rank in range(processes):
        pid = os.fork()
        if pid == 0:
            _worker(out, phase, name, rank, processes, port)
        children[pid] = rank
    codes: list = [None] * processes
    deadline = time.monotonic() + timeout
    while any(code is None for code in codes):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if time.monotonic() > deadline:
                codes = [code if code is not None else "timed out" for code in codes]
                break
            time.sleep(0.02)
            continue
        codes[children[pid]] = os.waitstatus_to_exitcode(status)
        if codes[children[pid]] != 0:
            break  # the others wait for it in a collective: end them
    for pid in children:  # the survivors and every DataLoader worker
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    for pid, rank in children.items():
        with contextlib.suppress(ChildProcessError):
            _, status = os.waitpid(pid, 0)
            if codes[rank] is None:
                codes[rank] = os.waitstatus_to_exitcode(status)
    return codes


def main(out: pathlib.Path, phases: list[str], names: list[str]) -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: one crash per invocation
        for name in names:
            phase_of_cell(out, phases[0], name)
        return
    for phase in phases:
        for name in names:
            cell = CELLS[name]
            processes = cell.before if phase == "crash" else cell.after
            if phase == "again" and cell.again is None:
                continue
            print(f"=== {name} {phase} ===", file=sys.stderr, flush=True)
            began = time.perf_counter()
            codes = launch(out, phase, name, processes, timeout=120)
            print(
                f"{name}: {phase} on {processes} process(es) exited with {codes} "
                f"in {time.perf_counter() - began:.1f} s",
                file=sys.stderr,
            )


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]), sys.argv[2].split("+"), sys.argv[3].split(","))
