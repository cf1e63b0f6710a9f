"""Model.save / Model.load and hapi.checkpoint: what is written, what comes back, and atomicity."""

from __future__ import annotations

import copy
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest
import torch
from conftest import TinyNet, make_tiny_data
from torch import nn

import hapi.checkpoint
from hapi import Model


def trained_model(seed: int = 0, epochs: int = 2) -> Model:
    """A TinyNet trained with Adam for `epochs` epochs of 3 batches: epoch and step are non-zero."""
    torch.manual_seed(seed)
    model = Model(TinyNet(), device="cpu")
    model.prepare(
        optimizer=torch.optim.Adam(model.parameters(), lr=0.01), loss=nn.CrossEntropyLoss()
    )
    model.fit(make_tiny_data(), batch_size=32, epochs=epochs, verbose=0, shuffle=False)
    return model


def fresh_model(seed: int = 1, prepare: bool = True) -> Model:
    torch.manual_seed(seed)
    model = Model(TinyNet(), device="cpu")
    if prepare:
        model.prepare(
            optimizer=torch.optim.Adam(model.parameters(), lr=0.01), loss=nn.CrossEntropyLoss()
        )
    return model


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def assert_same_weights_dict(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def assert_same_optimizer_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa.keys() == sb.keys() and sa, (
        "optimizer states differ in their parameters (or are empty)"
    )
    for index in sa:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(
                torch.as_tensor(sa[index][name]), torch.as_tensor(sb[index][name])
            ), (index, name)


# -- what save writes ---------------------------------------------------------------


def test_save_adds_pt_suffix_and_creates_directories(tmp_path):
    model = trained_model()
    written = model.save(tmp_path / "ckpt" / "final")
    assert written == str(tmp_path / "ckpt" / "final.pt")
    assert os.listdir(tmp_path / "ckpt") == ["final.pt"]


def test_save_keeps_a_pt_suffix(tmp_path):
    model = trained_model()
    written = model.save(tmp_path / "weights.pt")
    assert written == str(tmp_path / "weights.pt")
    assert os.listdir(tmp_path) == ["weights.pt"]


def test_load_restores_weights_optimizer_epoch_and_step(tmp_path):
    source = trained_model()
    assert (source.epoch, source.step) == (2, 6)
    source.save(tmp_path / "ckpt")

    target = fresh_model()
    with pytest.raises(AssertionError):
        assert_same_weights(
            source.network, target.network
        )  # the test starts from different weights
    target.load(tmp_path / "ckpt")

    assert_same_weights(source.network, target.network)
    assert_same_optimizer_state(source.optimizer, target.optimizer)
    assert (target.epoch, target.step) == (source.epoch, source.step)
    # Resuming is exact: one more identical step on both gives identical weights.
    x, y = make_tiny_data(seed=5)
    source.train_batch(x[:32], y[:32])
    target.train_batch(x[:32], y[:32])
    assert_same_weights(source.network, target.network)
    assert target.step == source.step == 7


def test_training_false_writes_the_plain_state_dict(tmp_path):
    """Loadable with torch alone, as upstream scripts load weights: net.load_state_dict(torch.load())."""
    source = trained_model()
    file = source.save(tmp_path / "weights", training=False)
    state = torch.load(file, weights_only=True)
    assert sorted(state) == sorted(source.network.state_dict())  # no optimizer, rng, format
    assert_same_weights_dict(state, source.network.state_dict())
    plain = fresh_model().network
    plain.load_state_dict(torch.load(file, weights_only=True))
    assert_same_weights(source.network, plain)

    target = fresh_model()
    x, y = make_tiny_data(seed=5)
    target.train_batch(x[:32], y[:32])
    before = {k: v.clone() for k, v in target.optimizer.state_dict()["state"][0].items()}
    target.load(file)
    assert_same_weights(source.network, target.network)
    after = target.optimizer.state_dict()["state"][0]
    assert all(
        torch.equal(torch.as_tensor(before[k]), torch.as_tensor(after[k])) for k in before
    ), "loading a weights-only file changed the optimizer state"


def test_plain_state_dict_file_loads(tmp_path):
    torch.manual_seed(3)
    net = TinyNet()
    torch.save(net.state_dict(), tmp_path / "plain.pth")
    model = fresh_model()
    model.load(tmp_path / "plain.pth")
    assert_same_weights(net, model.network)
    assert (model.epoch, model.step) == (0, 0)


# -- load before prepare, reset_optimizer ---------------------------------------------------


def test_load_before_prepare_applies_optimizer_state_at_prepare(tmp_path):
    source = trained_model()
    source.save(tmp_path / "ckpt")
    target = fresh_model(prepare=False)
    target.load(tmp_path / "ckpt")
    assert_same_weights(source.network, target.network)
    target.prepare(
        optimizer=torch.optim.Adam(target.parameters(), lr=0.01), loss=nn.CrossEntropyLoss()
    )
    assert_same_optimizer_state(source.optimizer, target.optimizer)


@pytest.mark.parametrize("order", ["load_then_prepare", "prepare_then_load"])
def test_the_settings_given_to_prepare_win_over_the_files_and_a_warning_says_so(tmp_path, order):
    """Fine-tuning at 1e-4 from a checkpoint trained at 1e-2 trains at 1e-4 (the moments still load)."""
    source = trained_model()  # Adam, lr=0.01
    source.save(tmp_path / "ckpt")
    target = fresh_model(prepare=False)

    def prepare():
        target.prepare(
            optimizer=torch.optim.Adam(target.parameters(), lr=1e-4, betas=(0.8, 0.99)),
            loss=nn.CrossEntropyLoss(),
        )

    with pytest.warns(UserWarning) as caught:
        if order == "load_then_prepare":
            target.load(tmp_path / "ckpt")
            prepare()
        else:
            prepare()
            target.load(tmp_path / "ckpt")
    message = " ".join(str(w.message) for w in caught)
    assert (
        "lr=0.01 in the file, 0.0001 given" in message
        and "betas=(0.9, 0.999) in the file" in message
    )
    assert target.optimizer.param_groups[0]["lr"] == 1e-4
    assert target.optimizer.param_groups[0]["betas"] == (0.8, 0.99)
    assert_same_optimizer_state(source.optimizer, target.optimizer)
    # The next step is Adam's at 1e-4 and (0.8, 0.99) from the loaded moments.
    expected = copy.deepcopy(source.network)
    optimizer = torch.optim.Adam(expected.parameters(), lr=1e-4, betas=(0.8, 0.99))
    optimizer.load_state_dict(source.optimizer.state_dict())
    for group in optimizer.param_groups:
        group.update(lr=1e-4, betas=(0.8, 0.99))
    x, y = make_tiny_data(8)
    nn.CrossEntropyLoss()(expected(x), y).backward()
    optimizer.step()
    target.train_batch(x, y)
    assert_same_weights(expected, target.network)


def test_a_load_with_the_same_settings_does_not_warn(tmp_path):
    source = trained_model()
    source.save(tmp_path / "ckpt")
    target = fresh_model(prepare=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        target.prepare(
            optimizer=torch.optim.Adam(target.parameters(), lr=0.01), loss=nn.CrossEntropyLoss()
        )
        target.load(tmp_path / "ckpt")
    assert target.optimizer.param_groups[0]["lr"] == 0.01


@pytest.mark.parametrize("order", ["load_then_prepare", "prepare_then_load"])
def test_reset_optimizer_keeps_the_fresh_optimizer(tmp_path, order):
    source = trained_model()
    source.save(tmp_path / "ckpt")
    target = fresh_model(prepare=False)

    def prepare():
        target.prepare(
            optimizer=torch.optim.Adam(target.parameters(), lr=0.5), loss=nn.CrossEntropyLoss()
        )

    if order == "load_then_prepare":
        target.load(tmp_path / "ckpt", reset_optimizer=True)
        prepare()
    else:
        prepare()
        target.load(tmp_path / "ckpt", reset_optimizer=True)
    assert_same_weights(source.network, target.network)
    assert target.optimizer.state_dict()["state"] == {}
    assert target.optimizer.param_groups[0]["lr"] == 0.5


def test_load_restores_the_fp16_gradient_scaler(tmp_path):
    x, y = make_tiny_data()

    def amp_model(seed):
        torch.manual_seed(seed)
        model = Model(TinyNet(), device="cpu")
        model.prepare(
            optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
            loss=nn.CrossEntropyLoss(),
            amp="fp16",
        )
        return model

    source = amp_model(0)
    for _ in range(3):
        source.train_batch(x[:32], y[:32])
    source.save(tmp_path / "source")
    target = amp_model(1)
    target.load(tmp_path / "source")
    for model in (source, target):
        model.train_batch(x[32:64], y[32:64])
    saved = [
        torch.load(m.save(tmp_path / name), weights_only=True)["scaler"]
        for m, name in ((source, "a"), (target, "b"))
    ]
    assert saved[0] is not None and saved[0]["_growth_tracker"] == 4
    assert saved[1] == saved[0]


# -- skip_mismatch ----------------------------------------------------------------------------


class WiderNet(TinyNet):
    """Another architecture: 5 input features (hidden.weight reshaped) and an extra layer."""

    def __init__(self) -> None:
        super().__init__(in_features=5)
        self.extra = nn.Linear(3, 3)


def test_skip_mismatch_loads_matching_tensors_and_warns(tmp_path):
    torch.manual_seed(7)
    other = WiderNet()
    Model(other, device="cpu").save(tmp_path / "other")
    target = fresh_model()
    hidden_before = target.network.hidden.weight.detach().clone()

    with pytest.warns(UserWarning, match="skipped") as caught:
        target.load(tmp_path / "other", skip_mismatch=True)

    message = " ".join(str(w.message) for w in caught)
    for key in ("hidden.weight", "extra.weight", "extra.bias"):
        assert key in message
    for key in ("hidden.bias", "out.weight", "out.bias"):
        assert key not in message
        assert torch.equal(target.network.state_dict()[key], other.state_dict()[key]), key
    assert torch.equal(target.network.hidden.weight, hidden_before)


# -- atomic writes -----------------------------------------------------------------------------


def test_save_leaves_no_temporary_files(tmp_path):
    model = trained_model()
    for _ in range(3):
        model.save(tmp_path / "ckpt")
        model.save(tmp_path / "weights", training=False)
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "weights.pt"]


@pytest.fixture
def umask():
    """A setter for the process umask; the umask the test found is restored afterwards."""
    previous = os.umask(0o022)
    os.umask(previous)
    yield os.umask
    os.umask(previous)


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o002])
def test_saved_file_permissions_follow_umask(tmp_path, umask, mask):
    umask(mask)
    file = Model(TinyNet(), device="cpu").save(tmp_path / "ckpt")
    with open(tmp_path / "reference", "wb"):
        pass
    mode = os.stat(file).st_mode & 0o777
    assert mode == os.stat(tmp_path / "reference").st_mode & 0o777 == 0o666 & ~mask
    assert mode != 0o600


def test_saving_never_touches_the_process_umask(tmp_path, monkeypatch):
    # Setting the umask, even briefly, loosens the permissions of any file another
    # thread creates at that moment: the writer must ask for its mode instead.
    calls = []
    real_umask = os.umask
    monkeypatch.setattr(os, "umask", lambda mask: calls.append(mask) or real_umask(mask))
    Model(TinyNet(), device="cpu").save(tmp_path / "ckpt")
    from hapi.checkpoint import atomic_write

    with atomic_write(tmp_path / "log.csv", "w") as handle:
        handle.write("epoch\n0\n")
    assert calls == []
    assert (tmp_path / "log.csv").read_text() == "epoch\n0\n"


def test_failed_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    first = trained_model(epochs=1)
    first.save(tmp_path / "ckpt")
    expected = {k: v.clone() for k, v in first.network.state_dict().items()}

    def broken_save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hapi.checkpoint.state.torch, "save", broken_save)
    second = trained_model(seed=4, epochs=2)
    with pytest.raises(OSError, match="No space left"):
        second.save(tmp_path / "ckpt")
    monkeypatch.undo()

    assert os.listdir(tmp_path) == ["ckpt.pt"]
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert_same_weights_dict(state["network"], expected)
    assert state["epoch"] == 1
    restored = fresh_model()
    restored.load(tmp_path / "ckpt")
    assert_same_weights_dict(restored.network.state_dict(), expected)


CHILD = textwrap.dedent("""
    import sys
    import torch
    from torch import nn
    from hapi import Model

    path, progress = sys.argv[1], sys.argv[2]
    net = nn.Linear(3600, 3600)  # about 52 MB of float32 weights
    model = Model(net, device="cpu")
    version = 0
    with torch.no_grad():
        while True:
            version += 1
            net.weight.fill_(version)
            net.bias.fill_(version)
            model.save(path, training=False)
            with open(progress, "a") as handle:
                handle.write(f"{version}\\n")
""")


def test_sigkill_during_save_leaves_a_whole_checkpoint(tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    progress = tmp_path / "progress"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(ckpt_dir / "big"), str(progress)], stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 60
        while not (progress.exists() and progress.read_text().strip()):
            assert child.poll() is None, f"saver died: {child.stderr.read().decode()}"
            assert time.monotonic() < deadline, "the first save never completed"
            time.sleep(0.01)
        delay = random.uniform(0.0, 0.6)  # one save of 52 MB takes a few tenths of a second
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL, child.stderr.read().decode()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stderr.close()

    completed = int(progress.read_text().split()[-1])
    state = torch.load(ckpt_dir / "big.pt", weights_only=True)
    weight, bias = state["weight"], state["bias"]  # save(training=False): the plain state_dict
    version = weight[0, 0].item()
    assert weight.shape == (3600, 3600)
    assert torch.all(weight == version) and torch.all(bias == version), (
        f"mixed versions (delay {delay:.3f}s)"
    )
    # The last save whose completion was recorded, or the next one if the kill hit between
    # its rename and its progress line; never an older one.
    assert version in (completed, completed + 1), (version, completed, delay)
    leftovers = [name for name in os.listdir(ckpt_dir) if name != "big.pt"]
    assert all(name.startswith(".") and name.endswith(".tmp") for name in leftovers), leftovers


# -- random number generators --------------------------------------------------------------


def draw() -> tuple:
    return (
        torch.rand(5).tolist(),
        torch.randn(3).tolist(),
        np.random.rand(5).tolist(),
        np.random.randn(3).tolist(),
        [random.random() for _ in range(5)],
        random.gauss(0, 1),
    )


@pytest.fixture
def keep_rng():
    """Leaves the global generators as this test found them."""
    saved = hapi.rng.global_state()
    yield
    hapi.rng.set_global_state(saved)


def test_rng_state_round_trips(keep_rng):
    random.gauss(0, 1)  # leaves a cached Gaussian in `random`
    np.random.randn()  # and one in NumPy (odd count)
    state = hapi.rng.global_state()
    first = draw()
    second_without_restore = draw()
    hapi.rng.set_global_state(state)
    assert draw() == first
    assert first != second_without_restore


def test_rng_state_round_trips_through_a_saved_checkpoint(tmp_path, keep_rng):
    np.random.randn()
    file = trained_model().save(tmp_path / "ckpt")  # captures the generators now
    first = draw()
    draw()
    state = torch.load(file, weights_only=True)
    hapi.rng.set_global_state(state["rng"])
    assert draw() == first


# -- every file torch-hapi writes, it reads back --------------------------------------


class Settings:
    """A user's class: pickle writes it, the safe loader refuses it."""


def numpy_scaled_model(seed: int = 0) -> Model:
    """The scaling recipe lr = base * sqrt(world): NumPy scalars in the optimizer's settings."""
    torch.manual_seed(seed)
    model = Model(TinyNet(), device="cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * np.sqrt(4), momentum=np.float32(0.9))
    model.prepare(optimizer=optimizer, loss=nn.CrossEntropyLoss())
    return model


def test_numpy_scalars_in_the_optimizer_save_as_numbers_and_load_back(tmp_path):
    model = numpy_scaled_model()
    model.fit(make_tiny_data(), batch_size=32, verbose=0)
    file = model.save(tmp_path / "scaled")
    saved = torch.load(file, weights_only=True)["optimizer"]["param_groups"][
        0
    ]  # the safe loader accepts it
    assert saved["lr"] == pytest.approx(0.1) and type(saved["lr"]) is float
    assert saved["momentum"] == pytest.approx(0.9) and type(saved["momentum"]) is float
    restored = numpy_scaled_model(seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same settings, as numbers: nothing to warn about
        restored.load(tmp_path / "scaled")
    assert_same_weights(restored.network, model.network)


def test_a_backup_with_numpy_scalars_resumes(tmp_path):
    from callbacks import BackupAndRestore, Callback

    class Crash(Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                raise KeyboardInterrupt  # the run dies after its first epoch's backup

    data = make_tiny_data()
    with pytest.raises(KeyboardInterrupt):
        numpy_scaled_model().fit(
            data,
            batch_size=32,
            epochs=2,
            verbose=0,
            callbacks=[BackupAndRestore(tmp_path), Crash()],
        )

    class Epochs(Callback):
        begun: list = []

        def on_epoch_begin(self, epoch, logs=None):
            self.begun.append(epoch)

    resumed = numpy_scaled_model()
    resumed.fit(
        data, batch_size=32, epochs=2, verbose=0, callbacks=[Epochs(), BackupAndRestore(tmp_path)]
    )
    assert Epochs.begun == [1]  # epoch 0 came from the backup
    reference = numpy_scaled_model()
    reference.fit(data, batch_size=32, epochs=2, verbose=0)
    assert_same_weights(resumed.network, reference.network)


def test_a_state_the_safe_loader_would_refuse_is_not_saved(tmp_path):
    first = trained_model(epochs=1)
    first.save(tmp_path / "ckpt")
    before = (tmp_path / "ckpt.pt").read_bytes()

    second = trained_model(seed=4)
    second.optimizer.param_groups[0]["schedule"] = Settings()  # a user's object in the settings
    with pytest.raises(
        hapi.checkpoint.CheckpointError,
        match=r"Not saving .*ckpt\.pt.*\['optimizer'\]\['param_groups'\]\[0\]\['schedule'\] "
        r"is a .*Settings, which torch\.load\(weights_only=True\) refuses",
    ):
        second.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt.pt").read_bytes() == before  # the previous file is untouched
    assert os.listdir(tmp_path) == ["ckpt.pt"]


def test_loads_that_need_no_optimizer_check_and_optimizers_that_keep_numbers(tmp_path):
    """A fine-tuning load into another head skips the old optimizer state; an optimizer may
    keep numbers and lists of tensors per parameter (LBFGS does): both load."""
    from torch.utils.data import TensorDataset

    def model(outputs, optimizer=torch.optim.Adam):
        net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, outputs))
        m = Model(net)
        m.prepare(optimizer(net.parameters(), lr=0.1), nn.MSELoss())
        return m

    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 3))
    pretrained = model(3)
    pretrained.fit(data, batch_size=8, verbose=0)
    pretrained.save(tmp_path / "pre")
    head = model(2)
    with pytest.warns(UserWarning, match="skipped 2 tensors"):
        head.load(tmp_path / "pre", skip_mismatch=True, reset_optimizer=True)
    assert torch.equal(head.network[0].weight, pretrained.network[0].weight)

    class Counting(torch.optim.SGD):  # keeps a number and a list per parameter, as LBFGS does
        def step(self, closure=None):
            super().step(closure)
            for group in self.param_groups:
                for p in group["params"]:
                    state = self.state[p]
                    state["updates"] = state.get("updates", 0) + 1
                    state["history"] = [p.detach().clone()]

    counting = model(3, Counting)
    counting.fit(data, batch_size=8, verbose=0)
    counting.save(tmp_path / "counting")
    again = model(3, Counting)
    again.load(tmp_path / "counting")
    assert again.optimizer.state_dict()["state"][0]["updates"] == 2


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_an_optimizer_state_with_other_keys_is_refused_naming_them(tmp_path, kind):
    """A damaged or crafted file whose per-parameter state lacks a key (Adam's exp_avg_sq) or
    holds another (SGD's momentum buffer replaced by a step count) is refused at load, not
    loaded to fail at the first update or to restart the momentum silently."""

    def prepared() -> Model:
        model = Model(nn.Linear(4, 2), device="cpu")
        optimizer = (
            torch.optim.Adam(model.parameters())
            if kind == "adam"
            else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        )
        model.prepare(optimizer, nn.CrossEntropyLoss())
        return model

    source = prepared()
    source.train_batch(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    file = source.save(tmp_path / "ckpt")
    state = torch.load(file, weights_only=True)
    for entry in state["optimizer"]["state"].values():
        if kind == "adam":
            del entry["exp_avg_sq"]
        else:
            entry["step"] = entry.pop("momentum_buffer").new_tensor(1.0)
    torch.save(state, file)
    with pytest.raises(hapi.checkpoint.CheckpointError, match=r"per-parameter state holds .*reset"):
        prepared().load(file)


def test_the_plain_weights_of_a_network_without_parameters_load_back(tmp_path):
    """Its plain state_dict is empty: load refused it as 'not a state_dict'."""
    model = Model(nn.Sequential(nn.Flatten(), nn.ReLU()), device="cpu")
    model.load(model.save(tmp_path / "weights", training=False))
    assert torch.load(tmp_path / "weights.pt", weights_only=True) == {}
