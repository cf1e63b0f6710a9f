"""A training script run by the distributed tests under torchrun / hapi.spawn.

Usage: python worker.py SCENARIO OUT_DIR. Each rank writes OUT_DIR/<scenario>.rank<R>.json;
the tests compare those files with a single-process run.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, TensorDataset

# The repository first, so that the folder tests/callbacks (no __init__.py)
# cannot pass for the callbacks package; then tests/ for the shared fixtures.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

from conftest import TinyNet, make_tiny_data  # noqa: E402

from callbacks import Callback, CSVLogger, EarlyStopping, ModelCheckpoint, TerminateOnNaN, VisualDL  # noqa: E402
from hapi import Model  # noqa: E402
from hapi.metrics import Accuracy  # noqa: E402

TRAIN_SAMPLES = 64
EVAL_SAMPLES = 1001


def sgd_model(lr: float = 0.1) -> Model:
    torch.manual_seed(0)
    model = Model(TinyNet())
    model.prepare(torch.optim.SGD(model.parameters(), lr=lr), nn.CrossEntropyLoss(), Accuracy())
    return model


def flat_weights(model: Model) -> list[float]:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


class DoublingEval(Model):
    """A step of one's own that logs a figure besides the loss."""

    def eval_step(self, batch):
        x, y = batch
        loss = nn.functional.cross_entropy(self.network(x), y)
        return {"loss": loss, "doubled": 2 * loss}


class IndexedData(Dataset):
    """Records which sample indices this process reads."""

    def __init__(self, x, y):
        self.x, self.y = x, y
        self.seen: list[int] = []

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.seen.append(int(i))
        return self.x[i], self.y[i]


class EpochMarks(Callback):
    def __init__(self, data: IndexedData):
        super().__init__()
        self.data, self.per_epoch = data, []

    def on_epoch_end(self, epoch, logs=None):
        self.per_epoch.append(list(self.data.seen))
        self.data.seen.clear()


class StopOnRank1(Callback):
    def on_epoch_end(self, epoch, logs=None):
        if self.params["rank"] == 1:
            self.model.stop_training = True


def nan_on_rank1_from_step(step: int):
    """A loss that turns NaN on rank 1 only, from its `step`-th call."""
    calls = {"n": 0}

    def loss(output, label):
        calls["n"] += 1
        value = nn.functional.cross_entropy(output, label)
        rank1 = os.environ.get("RANK") == "1"
        return value * float("nan") if rank1 and calls["n"] >= step else value

    return loss


class StopAtStep(Callback):
    """A batch callback that asks to stop at ``step`` of the first epoch."""

    def __init__(self, step: int):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, step, logs=None):
        if step == self.step:
            self.model.stop_training = True


class FailOnRank1(Callback):
    def on_train_batch_end(self, step, logs=None):
        if self.params["rank"] == 1 and step == 2:
            raise ValueError("boom on rank 1 at step 2")


def train_equivalence() -> dict:
    """Training results that must equal one process at the global batch size."""
    x, y = make_tiny_data(TRAIN_SAMPLES)
    results = {}
    model = sgd_model()
    model.fit((x, y), batch_size=8, epochs=2, shuffle=False, verbose=2, log_freq=2)
    results["dataset"] = flat_weights(model)
    results["network_type"] = type(model.network).__name__
    results["comm_hooks"] = [hook.__name__ for hook, _ in model._wrapped._comm_hooks]
    model = sgd_model()
    model.fit(DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False), epochs=2, verbose=0)
    results["loader"] = flat_weights(model)
    model = sgd_model()
    sampler = DistributedSampler(TensorDataset(x, y), shuffle=False)
    model.fit(DataLoader(TensorDataset(x, y), batch_size=8, sampler=sampler), epochs=2, verbose=0)
    results["loader_with_sampler"] = flat_weights(model)
    model = sgd_model()  # Paddle's DistributedBatchSampler idea, built from torch's parts
    batches = BatchSampler(
        DistributedSampler(TensorDataset(x, y), shuffle=False), 8, drop_last=False
    )
    model.fit(DataLoader(TensorDataset(x, y), batch_sampler=batches), epochs=2, verbose=0)
    results["loader_with_batch_sampler"] = flat_weights(model)
    model = sgd_model()
    model.fit((x, y), batch_size=4, accumulate_grad_batches=2, epochs=2, shuffle=False, verbose=0)
    results["accumulate"] = flat_weights(model)
    return results


def scenario_train(out: pathlib.Path) -> dict:
    results = train_equivalence()
    x, y = make_tiny_data(TRAIN_SAMPLES)

    data = IndexedData(x, y)
    marks = EpochMarks(data)
    model = sgd_model()
    history = model.fit(data, batch_size=8, epochs=2, shuffle=True, verbose=0, callbacks=[marks])
    results["shuffled_indices"] = marks.per_epoch
    results["shuffled_weights"] = flat_weights(model)
    results["shuffled_history"] = history.history

    history = sgd_model().fit((x, y), batch_size=8, epochs=5, verbose=0, callbacks=[StopOnRank1()])
    results["stopped_epochs"] = history.epoch

    # A batch callback given to rank 0 only: the other rank still joins the
    # figure reads and the stop check it causes, so nobody hangs and all stop at once.
    model = sgd_model()
    rank0_only = [StopAtStep(1)] if os.environ.get("RANK") == "0" else []
    history = model.fit((x, y), batch_size=8, epochs=3, log_freq=2, verbose=0, callbacks=rank0_only)
    results["rank0_callback_stop"] = {
        "epochs": history.epoch,
        "step": model.step,
        "loss": history.history["loss"],
    }

    model = sgd_model(lr=0.0)  # flat val_loss: early stopping must decide alike everywhere
    history = model.fit(
        (x, y),
        eval_data=(x[:21], y[:21]),
        batch_size=8,
        epochs=6,
        verbose=0,
        callbacks=[
            EarlyStopping(patience=1, verbose=0),
            VisualDL(out / "vdl"),
            CSVLogger(out / "log.csv"),
            ModelCheckpoint(out / "ckpt"),
        ],
    )
    results["early_stop_epochs"] = history.epoch
    results["val_history"] = history.history
    model.save(out / "final")
    results["saved_weights"] = flat_weights(model)
    results["evaluate_21"] = model.evaluate((x[:21], y[:21]), batch_size=4, verbose=2)

    torch.manual_seed(0)
    model = Model(TinyNet())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), nan_on_rank1_from_step(3))
    history = model.fit(
        (x, y), batch_size=8, epochs=3, log_freq=1, verbose=0, callbacks=[TerminateOnNaN()]
    )
    results["nan_stop"] = {"epochs": history.epoch, "step": model.step}
    return results


def scenario_train_small(out: pathlib.Path) -> dict:
    return train_equivalence()


def scenario_eval(out: pathlib.Path) -> dict:
    x, y = make_tiny_data(EVAL_SAMPLES)
    model = sgd_model()
    logs = model.evaluate((x, y), batch_size=3, log_freq=5, verbose=0)
    predictions = model.predict((x, y), batch_size=3, stack_outputs=True, verbose=0)[0]
    batches = model.predict((x, y), batch_size=3, verbose=0)[0]
    # Fewer samples than processes: one shard is empty; every rank still gets the figures.
    tiny_logs = model.evaluate((x[:2], y[:2]), batch_size=3, verbose=0)
    # ... also the figures of a step of one's own, which that shard never logged.
    own = DoublingEval(model.network)
    own.prepare(loss=nn.CrossEntropyLoss())
    own_tiny_logs = own.evaluate((x[:2], y[:2]), batch_size=3, verbose=0)
    tiny_predictions = model.predict((x[:2], y[:2]), batch_size=3, stack_outputs=True, verbose=0)[0]
    # An evaluation loader on a rank-aware batch sampler is re-split without its padding.
    padded = BatchSampler(
        DistributedSampler(TensorDataset(x, y), shuffle=False), 3, drop_last=False
    )
    batch_sampler_logs = model.evaluate(
        DataLoader(TensorDataset(x, y), batch_sampler=padded), verbose=0
    )
    # Training on three processes (more than this machine's cores): 48 samples at 8 per
    # process must equal one process at 24, through the shared-memory average.
    trained = sgd_model()
    trained.fit((x[:48], y[:48]), batch_size=8, epochs=2, shuffle=False, verbose=0)
    # Rank 0's bytes reach everyone (as a backup does), here in 15 pieces, the last short.
    from hapi import distributed
    from hapi.distributed import collectives

    collectives._PIECE_BYTES = 7
    main = os.environ.get("RANK") == "0"
    broadcast = distributed.broadcast_bytes(bytes(range(100)) if main else None)
    nothing = distributed.broadcast_bytes(None if main else b"ignored")
    from_rank_2 = distributed.broadcast_bytes(
        b"from 2" if os.environ.get("RANK") == "2" else None, 2
    )
    return {
        "evaluate": logs,
        "evaluate_batch_sampler": batch_sampler_logs,
        "predict": predictions.tolist(),
        "predict_batches_rows": sum(len(b) for b in batches),
        "evaluate_2": tiny_logs,
        "evaluate_2_own_step": own_tiny_logs,
        "predict_2": tiny_predictions.tolist(),
        "trained_48": flat_weights(trained),
        "broadcast": list(broadcast),
        "broadcast_nothing": nothing,
        "broadcast_from_2": from_rank_2.decode(),
        "freshest": _freshest_copies(out),
        "comm_hooks": [hook.__name__ for hook, _ in trained._wrapped._comm_hooks],
    }


def _freshest_copies(out: pathlib.Path) -> dict:
    """What load_freshest_state gives when each rank's folder stands for a machine of its own."""
    from hapi import checkpoint, distributed

    rank = distributed.rank()
    folder = out / f"machine{rank}"
    folder.mkdir()
    os.environ["LOCAL_RANK"] = "0"  # every rank plays local rank 0 of its machine
    results = {}
    try:
        try:
            checkpoint.load_freshest_state(folder / "backup")
        except FileNotFoundError as error:
            results["none"] = str(error)
        # Rank 0 (now on a machine that never held it) has none; rank 1 has the latest.
        step = {1: 6, 2: 3}.get(rank)
        if step is not None:
            torch.save(
                {
                    "format": checkpoint.FORMAT,
                    "network": {},
                    "step": step,
                    "epoch": 1,
                    "epoch_step": step,
                    "from_rank": rank,
                },
                folder / "backup.pt",
            )
        _, state = checkpoint.load_freshest_state(folder / "backup")
        results["latest"] = [state["step"], state["from_rank"]]
        if rank == 2:
            (folder / "backup.pt").write_bytes(b"not a checkpoint")
        try:
            checkpoint.load_freshest_state(folder / "backup")
        except checkpoint.CheckpointError as error:
            results["damaged"] = str(error)
    finally:
        os.environ["LOCAL_RANK"] = str(rank)
    return results


def scenario_fail(out: pathlib.Path) -> dict:
    x, y = make_tiny_data(TRAIN_SAMPLES * 4)
    sgd_model().fit((x, y), batch_size=4, epochs=50, verbose=0, callbacks=[FailOnRank1()])
    return {}


def scenario_user_group(out: pathlib.Path) -> dict:
    """The user created the process group: hapi uses it and leaves it to the user."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    group = dist.group.WORLD
    x, y = make_tiny_data(TRAIN_SAMPLES)
    model = sgd_model()
    model.fit((x, y), batch_size=8, epochs=2, shuffle=False, verbose=0)
    from hapi.distributed import group as hapi_group

    hapi_group.teardown()  # what hapi runs at exit: must not destroy the user's group
    result = {
        "weights": flat_weights(model),
        "same_group": dist.group.WORLD is group,
        "still_initialized": dist.is_initialized(),
    }
    del model  # as a careful DDP user does: the wrapper's reducer goes while Python can free it,
    import gc  # then leave together (destroying while a peer still talks to the group can
    # abort a finished process in Gloo)

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return result


SCENARIOS = {
    "train": scenario_train,
    "train_small": scenario_train_small,
    "user_group": scenario_user_group,
    "eval": scenario_eval,
    "fail": scenario_fail,
}


def _no_room_in_shared_memory(descriptor, offset, length):
    raise OSError(28, "No space left on device")  # what a 64 MB /dev/shm answers a big model


def main(scenario: str, out_dir: str) -> None:
    out = pathlib.Path(out_dir)
    if os.environ.get("WORKER_SHM_FULL") and os.environ.get("RANK") == "0":
        os.posix_fallocate = _no_room_in_shared_memory  # only rank 0 reserves the pages
    results = SCENARIOS[scenario](out)
    rank = int(os.environ.get("RANK", "0"))
    (out / f"{scenario}.rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
