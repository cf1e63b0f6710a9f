"""Model.fit / evaluate / predict and the one-batch API on one process."""

from __future__ import annotations

import traceback

import pytest
import torch
import torchmetrics
from conftest import TinyNet, make_tiny_data
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from hapi import Model
from hapi.metrics import Accuracy


def prepared(net=None, lr=0.05, metrics=None, **kwargs):
    torch.manual_seed(0)
    model = Model(net or TinyNet(), **kwargs)
    model.prepare(
        torch.optim.Adam(model.parameters(), lr=lr),
        nn.CrossEntropyLoss(),
        metrics if metrics is not None else Accuracy(),
    )
    return model


def test_fit_learns_and_history_has_one_value_per_epoch(tiny_data):
    model = prepared()
    history = model.fit(tiny_data, eval_data=tiny_data, batch_size=16, epochs=4, verbose=0)
    assert set(history.history) == {"loss", "acc", "val_loss", "val_acc", "lr"}
    assert all(len(values) == 4 for values in history.history.values())
    assert history.epoch == [0, 1, 2, 3]
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert history.history["val_acc"][-1] > 0.8
    assert all(isinstance(v, float) for values in history.history.values() for v in values)


def test_evaluate_returns_means_over_the_whole_set_not_the_last_batch(tiny_data):
    model = prepared()
    model.fit(tiny_data, batch_size=16, epochs=1, verbose=0)
    x, y = tiny_data
    results = model.evaluate((x, y), batch_size=7, verbose=0)  # 96 = 13 batches of 7 + 5
    with torch.no_grad():
        scores = model.network(x)
    expected_loss = nn.functional.cross_entropy(scores, y).item()
    expected_acc = (scores.argmax(1) == y).sum().item() / len(y)
    assert set(results) == {"loss", "acc"}
    assert all(isinstance(v, float) for v in results.values())
    assert results["loss"] == pytest.approx(expected_loss, rel=1e-5)
    assert results["acc"] == pytest.approx(expected_acc, abs=1e-9)


def test_predict_returns_outputs_in_dataset_order(tiny_data):
    model = prepared()
    x, y = tiny_data
    batches = model.predict((x, y), batch_size=10, verbose=0)
    assert len(batches) == 1 and len(batches[0]) == 10  # one output, 10 batches
    stacked = model.predict((x, y), batch_size=10, stack_outputs=True, verbose=0)
    with torch.no_grad():
        expected = model.network(x)
    torch.testing.assert_close(stacked[0], expected)
    torch.testing.assert_close(torch.cat(batches[0]), expected)


def test_predict_needs_no_prepare_and_accepts_inputs_only():
    model = Model(TinyNet())
    x = torch.randn(20, 4)
    out = model.predict(TensorDataset(x), batch_size=8, stack_outputs=True, verbose=0)
    torch.testing.assert_close(out[0], model.network(x).detach())


def test_multiple_outputs_are_returned_per_output():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 3)
            self.b = nn.Linear(4, 1)

        def forward(self, x):
            return self.a(x), self.b(x)

    model = Model(TwoHeads())
    outs = model.predict((torch.randn(12, 4),), batch_size=5, stack_outputs=True, verbose=0)
    assert [tuple(o.shape) for o in outs] == [(12, 3), (12, 1)]


class TwoInputNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(2, 3)

    def forward(self, x1, x2):
        return self.a(x1) + self.b(x2)


def test_several_inputs_use_the_default_split():
    x1, x2, y = torch.randn(32, 4), torch.randn(32, 2), torch.randint(0, 3, (32,))
    model = prepared(TwoInputNet())
    history = model.fit((x1, x2, y), batch_size=8, verbose=0)
    assert len(history.history["loss"]) == 1


def test_inputs_and_labels_override_the_split():
    """Two labels: the loss receives (output, label_a, label_b)."""
    x, y = make_tiny_data(40)
    weights = torch.rand(40)
    received = []

    def weighted_loss(output, label, weight):
        received.append((label.shape, weight.shape))
        return (nn.functional.cross_entropy(output, label, reduction="none") * weight).mean()

    torch.manual_seed(0)
    model = Model(TinyNet(), inputs=1, labels=["label", "weight"])
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), weighted_loss)
    model.fit((x, y, weights), batch_size=10, verbose=0)
    assert received[0] == (torch.Size([10]), torch.Size([10]))
    out = model.predict((x, y, weights), batch_size=40, stack_outputs=True, verbose=0)
    assert out[0].shape == (40, 3)


class MapData(Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i].numpy(), int(self.y[i])


class StreamData(IterableDataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __iter__(self):
        return iter(zip(self.x, self.y))


@pytest.mark.parametrize("kind", ["tensors", "numpy", "map", "iterable", "loader"])
def test_every_kind_of_data_gives_the_same_evaluation(kind, tiny_data):
    x, y = tiny_data
    data = {
        "tensors": (x, y),
        "numpy": (x.numpy(), y.numpy()),
        "map": MapData(x, y),
        "iterable": StreamData(x, y),
        "loader": DataLoader(TensorDataset(x, y), batch_size=16),
    }[kind]
    model = prepared()
    results = model.evaluate(data, batch_size=16, verbose=0)
    reference = prepared().evaluate((x, y), batch_size=96, verbose=0)
    assert results["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    assert results["acc"] == pytest.approx(reference["acc"])


def test_fit_on_iterable_data_runs_every_batch(tiny_data, recorder):
    x, y = tiny_data
    prepared().fit(StreamData(x, y), batch_size=32, verbose=0, log_freq=100, callbacks=[recorder])
    ends = [c for c in recorder.calls if c[0] == "on_train_batch_end"]
    assert [c[1] for c in ends] == [0, 1, 2]
    assert "loss" in ends[-1][2]  # figures on the last step even without a length


def _sgd_weights_after(batch_size, accumulate, x, y):
    torch.manual_seed(0)
    model = Model(TinyNet())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    model.fit(
        (x, y), batch_size=batch_size, shuffle=False, accumulate_grad_batches=accumulate, verbose=0
    )
    return model


def test_accumulated_batches_train_like_one_large_batch():
    x, y = make_tiny_data(48)
    small = _sgd_weights_after(4, 3, x, y)  # 12 batches of 4, updates every 3
    large = _sgd_weights_after(12, 1, x, y)  # 4 batches of 12
    assert small.step == large.step == 4
    for a, b in zip(small.parameters(), large.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_accumulation_averages_a_short_last_group():
    x, y = make_tiny_data(40)
    small = _sgd_weights_after(4, 3, x, y)  # 10 batches: groups of 3, 3, 3, 1
    assert small.step == 4
    # The last group (one batch of 4) must step like a plain batch of 4.
    reference = _sgd_weights_after(12, 1, x[:36], y[:36])
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    loss = nn.functional.cross_entropy(reference.network(x[36:]), y[36:])
    loss.backward()
    opt.step()
    for a, b in zip(small.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_num_iters_caps_training_batches(tiny_data, recorder):
    model = prepared()
    model.fit(tiny_data, batch_size=16, epochs=5, num_iters=9, verbose=0, callbacks=[recorder])
    assert model.step == 9
    epochs = [c[1] for c in recorder.calls if c[0] == "on_epoch_begin"]
    assert epochs == [0, 1]  # 6 batches per epoch: 6 + 3


def test_evaluate_num_iters_limits_batches(tiny_data, recorder):
    prepared().evaluate(tiny_data, batch_size=16, num_iters=2, verbose=0, callbacks=[recorder])
    assert [c[1] for c in recorder.calls if c[0] == "on_eval_batch_end"] == [0, 1]


def test_eval_freq_follows_paddle(tiny_data):
    history = prepared().fit(
        tiny_data, eval_data=tiny_data, batch_size=32, epochs=5, eval_freq=2, verbose=0
    )
    assert len(history.history["loss"]) == 5
    assert len(history.history["val_loss"]) == 3  # epochs 0, 2, 4


def test_save_dir_and_save_freq_write_paddle_named_checkpoints(tiny_data, tmp_path):
    prepared().fit(
        tiny_data, batch_size=32, epochs=3, save_dir=str(tmp_path), save_freq=2, verbose=0
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.pt", "2.pt", "final.pt"]


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_mixed_precision_trains_on_cpu(amp, tiny_data, tmp_path):
    model = prepared(lr=0.05)
    model.prepare(
        torch.optim.Adam(model.parameters(), lr=0.05), nn.CrossEntropyLoss(), Accuracy(), amp=amp
    )
    history = model.fit(tiny_data, batch_size=16, epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    model.save(tmp_path / "amp")
    state = torch.load(tmp_path / "amp.pt", weights_only=True)
    assert (state["scaler"] is not None) == (amp == "fp16")  # fp16 uses a gradient scaler


def test_train_eval_predict_batch(tiny_data):
    model = prepared()
    x, y = tiny_data
    first = model.train_batch([x[:16]], [y[:16]])
    assert set(first) == {"loss", "acc"} and isinstance(first["loss"], float)
    for _ in range(30):
        model.train_batch(x[:16], y[:16])
    assert model.step == 31
    after = model.eval_batch(x[:16].numpy(), y[:16].numpy())
    assert after["loss"] < first["loss"]
    outputs = model.predict_batch(x[:5])
    assert len(outputs) == 1 and outputs[0].shape == (5, 3) and outputs[0].device.type == "cpu"


def test_train_batch_without_update_accumulates(tiny_data):
    x, y = tiny_data
    model = Model(TinyNet())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    before = [p.detach().clone() for p in model.parameters()]
    model.train_batch(x[:8], y[:8], update=False)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    model.train_batch(x[8:16], y[8:16])
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_metric_names_from_list_dict_and_collection(tiny_data):
    multiclass = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro")
    named = prepared(metrics={"acc": multiclass}).evaluate(tiny_data, verbose=0)
    assert set(named) == {"loss", "acc"}
    derived = prepared(
        metrics=[
            torchmetrics.classification.MulticlassAccuracy(num_classes=3),
            Accuracy(topk=(1, 2)),
        ]
    ).evaluate(tiny_data, verbose=0)
    assert set(derived) == {"loss", "multiclass_accuracy", "acc_top1", "acc_top2"}
    collection = torchmetrics.MetricCollection(
        {
            "f1": torchmetrics.classification.MulticlassF1Score(num_classes=3),
            "recall": torchmetrics.classification.MulticlassRecall(num_classes=3),
        }
    )
    from_collection = prepared(metrics=collection).evaluate(tiny_data, verbose=0)
    assert set(from_collection) == {"loss", "f1", "recall"}


def test_no_host_sync_per_step(monkeypatch):
    """Loss and metrics stay on the device between log points: the number of
    reads does not grow with the number of steps.

    SGD, because Adam itself reads its step counter with .item() (a CPU
    tensor, so no device sync, but it would hide ours).
    """
    calls = []
    real_item = torch.Tensor.item

    def counting_item(self):
        if "/hapi/" in traceback.extract_stack()[-2].filename:  # called by hapi itself
            calls.append(1)
        return real_item(self)

    monkeypatch.setattr(torch.Tensor, "item", counting_item)
    counts = []
    for samples in (400, 800):  # 100 and 200 steps
        model = Model(TinyNet())
        model.prepare(
            torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), Accuracy()
        )
        calls.clear()
        model.fit(make_tiny_data(samples), batch_size=4, epochs=1, log_freq=1000, verbose=0)
        counts.append(len(calls))
    assert counts[0] == counts[1] <= 4


def test_summary_counts_parameters_and_shapes(capsys):
    model = Model(TinyNet())
    info = model.summary((None, 4))
    printed = capsys.readouterr().out
    assert info == {
        "total_params": 4 * 16 + 16 + 16 * 3 + 3,
        "trainable_params": 4 * 16 + 16 + 16 * 3 + 3,
    }
    assert "[1, 16]" in printed and "[1, 3]" in printed and "Total params: 131" in printed


def test_network_stays_the_users_module():
    net = TinyNet()
    model = Model(net)
    assert model.network is net
    assert [p.data_ptr() for p in model.parameters()] == [p.data_ptr() for p in net.parameters()]


def test_early_stop_flag_stops_fit(tiny_data):
    from callbacks import Callback

    class StopAfterTwo(Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                self.model.stop_training = True

    history = prepared().fit(
        tiny_data, batch_size=32, epochs=10, verbose=0, callbacks=StopAfterTwo()
    )
    assert history.epoch == [0, 1]


# torch.compile's first call imports torch._inductor, which imports torch.utils.mkldnn, whose classes use
# @torch.jit.script_method: torch 2.13 warns 14 times from its own code, not from hapi's
# (prepare(compile=True) is the public torch.compile). Ignore exactly that warning, here only.
@pytest.mark.filterwarnings(r"ignore:`torch\.jit\.script_method` is:DeprecationWarning")
def test_compile_trains_and_keeps_the_plain_module(tiny_data, tmp_path):
    model = Model(TinyNet())
    model.prepare(
        torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), Accuracy(), compile=True
    )
    history = model.fit(tiny_data, batch_size=32, epochs=2, verbose=0)
    assert history.history["loss"][1] < history.history["loss"][0]
    assert type(model.network) is TinyNet
    model.save(tmp_path / "compiled")
    plain = Model(TinyNet())
    plain.prepare(torch.optim.SGD(plain.parameters(), lr=0.1), nn.CrossEntropyLoss(), Accuracy())
    plain.load(tmp_path / "compiled")  # plain keys: loads into an uncompiled model
    compiled_eval, plain_eval = (
        model.evaluate(tiny_data, verbose=0),
        plain.evaluate(tiny_data, verbose=0),
    )
    assert compiled_eval["acc"] == plain_eval["acc"]
    assert compiled_eval["loss"] == pytest.approx(plain_eval["loss"], rel=1e-5)


def test_get_weights_is_a_cpu_copy_and_set_weights_puts_it_back():
    from conftest import TinyNet, make_tiny_data

    model = Model(TinyNet())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.5), torch.nn.CrossEntropyLoss())
    before = model.get_weights()
    assert set(before) == set(model.network.state_dict())
    assert all(t.device.type == "cpu" for t in before.values())
    model.fit(make_tiny_data(16), batch_size=8, verbose=0)
    after = model.network.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # a copy: training moved on
    model.set_weights(before)
    assert all(torch.equal(before[k], v) for k, v in model.network.state_dict().items())
    with pytest.raises(ValueError, match="do not fit TinyNet.*get_weights"):
        model.set_weights({k: v for k, v in list(before.items())[1:]})
    with pytest.raises(TypeError, match="dict of tensors"):
        model.set_weights(list(before.values()))


def test_get_weights_copies_a_modules_extra_state_too():
    class WithExtra(nn.Linear):
        def get_extra_state(self):
            return {"scale": 3}

        def set_extra_state(self, state):
            self.scale = state["scale"]

    model = Model(nn.Sequential(WithExtra(3, 2)))
    weights = model.get_weights()
    assert weights["0._extra_state"] == {"scale": 3}
    model.set_weights(weights)
    assert model.network[0].scale == 3
