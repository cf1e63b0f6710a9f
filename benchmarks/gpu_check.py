"""Every GPU path of torch-hapi in one run, each against the PyTorch code a user would write by hand.

    PYTHONPATH=. python3 benchmarks/gpu_check.py [--device cuda|cpu] [--quick] [--out FILE] [--checks a,b]

Prints one JSON line per check, ``{"check": name, "ok": true|false, ...figures}``,
then one summary line, and exits 1 when a check failed. ``--out`` also writes
the lines to a file. The default device is ``cuda`` when one is available; with
``--device cpu`` the same code runs on the CPU with Gloo (the test suite runs it
that way with ``--quick``), so no check is ever skipped.

The data are made here, Fashion-MNIST-sized (60,000 images of 1x28x28) and
CIFAR-sized (3x32x32), and kept on the device: the run needs no download and no
file outside the repository. Weights are compared after training the same
batches in the same order; the checks that time run each contender after a
warm-up, and a ratio is Model.fit's time over the hand loop's.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import pathlib
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

# Deterministic cuBLAS, so that two runs of the same batches give the same weights.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from hapi import Model  # noqa: E402
from hapi.models import LeNet  # noqa: E402

TOLERANCE = 1e-5  # largest difference of any weight that still counts as equal
LENET_BATCH = 64


class Setup:
    """The device and the sizes of one run (``--quick`` shrinks the data, not the code)."""

    def __init__(self, device: str, quick: bool) -> None:
        self.device = torch.device(device)
        self.quick = quick
        self.lenet_samples = 256 if quick else 60_000
        self.resnet_samples = 16 if quick else 50_000
        self.resnet_batch = 8 if quick else 128
        self.repeats = 1 if quick else 3
        self._lenet_data: tuple[torch.Tensor, torch.Tensor] | None = None
        self.launched: dict[str, dict] = {}  # strategy -> what its torchrun worker saved

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def lenet_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Fashion-MNIST-sized images whose labels a linear rule decides (so the loss can fall)."""
        if self._lenet_data is None:
            self._lenet_data = labelled_images(self.lenet_samples, (1, 28, 28), self.device)
        return self._lenet_data

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def timed(self, run: Callable[[], Any]) -> float:
        """Seconds ``run`` takes, the device's queued work included."""
        self.sync()
        started = time.perf_counter()
        run()
        self.sync()
        return time.perf_counter() - started


def labelled_images(count: int, shape: tuple[int, ...], device: torch.device, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    images = torch.rand(count, *shape, generator=generator)
    rule = torch.randn(images[0].numel(), 10, generator=generator)
    labels = (images.flatten(1) - 0.5).matmul(rule).argmax(dim=1)
    return images.to(device), labels.to(device)


def batches(images: torch.Tensor, labels: torch.Tensor, size: int):
    """The batches ``Model.fit(..., shuffle=False)`` trains on, in its order."""
    for start in range(0, len(images), size):
        yield images[start : start + size], labels[start : start + size]


def lenet(setup: Setup, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    network = LeNet().to(setup.device)
    return network, torch.optim.Adam(network.parameters(), lr=1e-3)


def hand_epoch(
    network: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: tuple[torch.Tensor, torch.Tensor],
    batch: int = LENET_BATCH,
    amp: torch.dtype | None = None,
    scaler: torch.amp.GradScaler | None = None,
    on_step: Callable[[], None] = lambda: None,
) -> None:
    """The loop a user writes by hand: autocast and a GradScaler as torch's AMP recipe has them."""
    network.train()
    device_type = next(network.parameters()).device.type
    for images, labels in batches(*data, batch):
        with torch.autocast(device_type, dtype=amp or torch.float32, enabled=amp is not None):
            loss = F.cross_entropy(network(images), labels)
        optimizer.zero_grad(set_to_none=True)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        on_step()


def fitted(
    setup: Setup,
    network: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    amp: str | None = None,
    compile: bool = False,
    strategy: str | None = None,
) -> Model:
    model = Model(network, device=setup.device)
    model.prepare(optimizer, nn.CrossEntropyLoss(), amp=amp, compile=compile, strategy=strategy)
    return model


def fit_epoch(model: Model, data: Any, batch: int = LENET_BATCH, **options: Any) -> None:
    model.fit(data, batch_size=batch, epochs=1, shuffle=False, verbose=0, **options)


def weights_of(source: Model | nn.Module | dict) -> dict[str, torch.Tensor]:
    if isinstance(source, Model):
        source = source.network  # on one process it holds the full weights
    state = source.state_dict() if isinstance(source, nn.Module) else source
    return {name: tensor.detach().cpu().clone() for name, tensor in state.items()}


def max_difference(a: Any, b: Any) -> float:
    """The largest absolute difference of any weight (``inf`` when the names differ)."""
    a, b = weights_of(a), weights_of(b)
    if a.keys() != b.keys():
        return float("inf")
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def peak_memory_mb(setup: Setup) -> float:
    """The device's peak allocation, or this process's peak resident memory on the CPU."""
    if setup.cuda:
        return torch.cuda.max_memory_allocated(setup.device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---- the checks: each returns its figures, with "ok" ----


def check_fit_vs_hand_loop(setup: Setup) -> dict:
    """One epoch of LeNet on device-resident data: Model.fit against the hand loop, interleaved."""
    data = setup.lenet_data()
    hand_net, hand_opt = lenet(setup)
    model = fitted(setup, *lenet(setup))
    hand_times, fit_times = [], []
    for round_ in range(1 + setup.repeats):  # round 0 warms both up
        hand = setup.timed(lambda: hand_epoch(hand_net, hand_opt, data))
        fit = setup.timed(lambda: fit_epoch(model, data))
        if round_:
            hand_times.append(hand)
            fit_times.append(fit)
    difference = max_difference(model, hand_net)
    ratio = statistics.median(fit_times) / statistics.median(hand_times)
    return {
        "ok": difference <= TOLERANCE,
        "epochs": 1 + setup.repeats,
        "max_weight_difference": difference,
        "hand_s": statistics.median(hand_times),
        "fit_s": statistics.median(fit_times),
        "time_ratio": ratio,
        "samples_per_s_fit": len(data[0]) / statistics.median(fit_times),
    }


def _amp_check(setup: Setup, amp: str, dtype: torch.dtype) -> dict:
    images, labels = setup.lenet_data()
    poisoned = images.clone()
    poisoned[2 * LENET_BATCH : 3 * LENET_BATCH] *= 1e6  # float16 overflows: the scaler skips
    data = (poisoned, labels)
    hand_net, hand_opt = lenet(setup)
    scaler = torch.amp.GradScaler(setup.device.type) if amp == "fp16" else None
    scales: list[float] = []
    hand_s = setup.timed(
        lambda: hand_epoch(
            hand_net,
            hand_opt,
            data,
            amp=dtype,
            scaler=scaler,
            on_step=lambda: scales.append(scaler.get_scale()) if scaler else None,
        )
    )
    model = fitted(setup, *lenet(setup), amp=amp)
    fit_s = setup.timed(lambda: fit_epoch(model, data))
    difference = max_difference(model, hand_net)
    figures = {"max_weight_difference": difference, "hand_s": hand_s, "fit_s": fit_s}
    ok = difference <= TOLERANCE
    if scaler is not None:
        with tempfile.TemporaryDirectory() as folder:
            saved = torch.load(model.save(f"{folder}/amp"), weights_only=True)
        skipped = sum(after < before for before, after in zip([65536.0] + scales, scales))
        figures.update(
            hand_scale=scaler.get_scale(), fit_scale=saved["scaler"]["scale"], skipped_steps=skipped
        )
        ok = ok and figures["hand_scale"] == figures["fit_scale"] and skipped >= 1
    return {"ok": ok, **figures}


def check_amp_fp16(setup: Setup) -> dict:
    """prepare(amp="fp16") against autocast + GradScaler, over a batch that overflows float16."""
    return _amp_check(setup, "fp16", torch.float16)


def check_amp_bf16(setup: Setup) -> dict:
    """prepare(amp="bf16") against autocast to bfloat16 (no scaler)."""
    return _amp_check(setup, "bf16", torch.bfloat16)


def check_pinned_workers(setup: Setup) -> dict:
    """Host data through 2 workers (pinned memory on CUDA), and host data fit copies to the
    device once, against data already on the device: the same weights."""
    images, labels = setup.lenet_data()
    host = (images.cpu(), labels.cpu())
    resident = fitted(setup, *lenet(setup))
    resident_s = setup.timed(lambda: fit_epoch(resident, (images, labels)))
    copied = fitted(setup, *lenet(setup))
    copied_s = setup.timed(lambda: fit_epoch(copied, host))
    workers = fitted(setup, *lenet(setup))
    workers_s = setup.timed(lambda: fit_epoch(workers, host, num_workers=2))
    difference = max(max_difference(workers, resident), max_difference(copied, resident))
    return {
        "ok": difference <= TOLERANCE,
        "max_weight_difference": difference,
        "resident_s": resident_s,
        "copied_once_s": copied_s,
        "workers_s": workers_s,
    }


def check_background_save(setup: Setup) -> dict:
    """save(wait=False) of device weights while training goes on: the file holds the moment of the call."""
    data = setup.lenet_data()
    model = fitted(setup, *lenet(setup))
    fit_epoch(model, data)
    at_call = weights_of(model)
    with tempfile.TemporaryDirectory() as folder:
        started = time.perf_counter()
        path = model.save(f"{folder}/background", wait=False)
        returned_s = time.perf_counter() - started
        fit_epoch(model, data)  # changes the weights in place while the file is written
        model.wait_for_saves()
        reloaded = Model(lenet(setup, seed=1)[0], device=setup.device)
        reloaded.load(path)
    from_call = max_difference(reloaded, at_call)
    from_now = max_difference(reloaded, model)
    return {
        "ok": from_call == 0.0 and from_now > 0.0,
        "difference_from_call": from_call,
        "difference_from_trained_on": from_now,
        "save_returned_s": returned_s,
    }


def check_export(setup: Setup) -> dict:
    """model.export on the device: the exported program's outputs equal predict's."""
    images, labels = setup.lenet_data()
    model = fitted(setup, *lenet(setup))
    fit_epoch(model, (images, labels))
    test = (images[:512], labels[:512])
    predicted = model.predict(test, batch_size=128, stack_outputs=True, verbose=0)[0]
    with tempfile.TemporaryDirectory() as folder:
        program = torch.export.load(model.export(f"{folder}/lenet", images[:8])).module()
        with torch.no_grad():
            exported = program(test[0]).cpu()
    difference = (exported - predicted).abs().max().item()
    return {
        "ok": exported.shape == predicted.shape and difference <= TOLERANCE,
        "max_output_difference": difference,
        "outputs": list(exported.shape),
    }


def _launched(setup: Setup, strategy: str) -> dict:
    """Run this file's worker under ``torchrun --nproc_per_node=1``; its figures and weights."""
    if strategy in setup.launched:
        return setup.launched[strategy]
    with tempfile.TemporaryDirectory() as folder:
        result = pathlib.Path(folder) / "result.pt"
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=1",
            __file__,
            "--worker",
            strategy,
            "--result",
            str(result),
            "--device",
            setup.device.type,
        ] + (["--quick"] if setup.quick else [])
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        }
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"torchrun exited {done.returncode}: {done.stderr[-2000:]}")
        setup.launched[strategy] = torch.load(result, weights_only=True)
    return setup.launched[strategy]


def _plain_run(setup: Setup) -> dict[str, torch.Tensor]:
    """One epoch of Model.fit in this process, no launcher: what the launched runs must equal."""
    model = fitted(setup, *lenet(setup))
    fit_epoch(model, setup.lenet_data())
    return weights_of(model)


def check_ddp_one_process(setup: Setup) -> dict:
    """torchrun --nproc_per_node=1 with NCCL (Gloo on CPU): Model.fit and hand DDP equal the plain run."""
    launched = _launched(setup, "ddp")
    plain = _plain_run(setup)
    hapi_difference = max_difference(launched["hapi"], plain)
    hand_difference = max_difference(launched["hand"], plain)
    return {
        "ok": max(hapi_difference, hand_difference) <= TOLERANCE,
        "backend": launched["backend"],
        "difference_from_plain_run": hapi_difference,
        "hand_ddp_difference_from_plain_run": hand_difference,
        "peak_memory_mb": launched["peak_memory_mb"],
    }


def check_fsdp_one_process(setup: Setup) -> dict:
    """strategy="fsdp" under the same launch equals DDP; hand FSDP2 (fully_shard) alike."""
    fsdp, ddp = _launched(setup, "fsdp"), _launched(setup, "ddp")
    difference = max_difference(fsdp["hapi"], ddp["hapi"])
    hand_difference = max_difference(fsdp["hand"], ddp["hapi"])
    return {
        "ok": max(difference, hand_difference) <= TOLERANCE,
        "backend": fsdp["backend"],
        "difference_from_ddp": difference,
        "hand_fsdp_difference_from_ddp": hand_difference,
        "peak_memory_mb": fsdp["peak_memory_mb"],
        "ddp_peak_memory_mb": ddp["peak_memory_mb"],
    }


def worker(setup: Setup, strategy: str, result: str) -> None:
    """The process torchrun starts: a user's group first (hapi joins it), then hapi and the hand code."""
    import torch.distributed as dist

    local_rank = int(os.environ["LOCAL_RANK"])
    if setup.cuda:
        setup.device = torch.device("cuda", local_rank)
        torch.cuda.set_device(setup.device)
    dist.init_process_group("nccl" if setup.cuda else "gloo")
    data = setup.lenet_data()
    if setup.cuda:
        torch.cuda.reset_peak_memory_stats(setup.device)
    model = fitted(setup, *lenet(setup), strategy=strategy)
    fit_epoch(model, data)
    peak = peak_memory_mb(setup)
    network, _ = lenet(setup)
    if strategy == "ddp":
        ids = [local_rank] if setup.cuda else None
        wrapped: nn.Module = nn.parallel.DistributedDataParallel(network, device_ids=ids)
    else:
        from torch.distributed.fsdp import fully_shard

        for child in network.children():
            fully_shard(child)
        wrapped = fully_shard(network)
    optimizer = torch.optim.Adam(wrapped.parameters(), lr=1e-3)
    hand_epoch(wrapped, optimizer, data)
    hand = {
        name: (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().cpu()
        for name, tensor in network.state_dict().items()
    }
    figures = {
        "backend": dist.get_backend(),
        "hapi": weights_of(model),
        "hand": hand,
        "peak_memory_mb": peak,
    }
    if dist.get_rank() == 0:
        torch.save(figures, result)
    dist.destroy_process_group()


class BasicBlock(nn.Module):
    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.shortcut = nn.Sequential()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(
                nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def resnet18(classes: int = 10) -> nn.Module:
    """ResNet-18 for 32x32 images: a 3x3 stem and no max-pool, as CIFAR recipes have it."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 3, 1, 1, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(),
    ]
    width = 64
    for outputs, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(width, outputs, stride), BasicBlock(outputs, outputs, 1)]
        width = outputs
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes)]
    return nn.Sequential(*layers)


def _resnet_and_sgd(setup: Setup) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    network = resnet18().to(setup.device)
    return network, torch.optim.SGD(network.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)


def _lightning_epochs(setup: Setup, batch: int) -> Callable[[Any], None] | None:
    """One Lightning ``Trainer.fit`` epoch per call over the given batches, when Lightning is installed."""
    try:
        import lightning as L
    except ImportError:
        return None
    from torch.utils.data import DataLoader

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.network, self.optimizer = _resnet_and_sgd(setup)

        def training_step(self, pair, index):
            return F.cross_entropy(self.network(pair[0]), pair[1])

        def configure_optimizers(self):
            return self.optimizer

    module = Lit()

    def epoch(data: tuple[torch.Tensor, torch.Tensor]) -> None:
        images, labels = data
        loader = DataLoader(  # the same slices as the hand loop, no per-sample collate
            range(-(-len(images) // batch)),
            batch_size=None,
            collate_fn=lambda i: (
                images[i * batch : (i + 1) * batch],
                labels[i * batch : (i + 1) * batch],
            ),
        )
        L.Trainer(
            max_epochs=1,
            accelerator="gpu" if setup.cuda else "cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        ).fit(module, loader)

    return epoch


def check_resnet18_epoch(setup: Setup) -> dict:
    """A CIFAR-sized ResNet-18 epoch: Model.fit, the hand loop and Lightning, in samples per second.

    Each contender first trains on batches of every shape the epoch has (cuDNN picks its
    kernels per shape), then the timed epochs run in turns, the order reversed each round.
    """
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, True
    try:
        data = labelled_images(setup.resnet_samples, (3, 32, 32), setup.device)
        batch = setup.resnet_batch
        warm_count = min(len(data[0]), 10 * batch + len(data[0]) % batch)
        warm = (data[0][:warm_count], data[1][:warm_count])
        hand_net, hand_opt = _resnet_and_sgd(setup)
        model = fitted(setup, *_resnet_and_sgd(setup))
        contenders = {
            "hand": lambda part: hand_epoch(hand_net, hand_opt, part, batch),
            "fit": lambda part: fit_epoch(model, part, batch),
        }
        lightning = _lightning_epochs(setup, batch)
        if lightning is not None:
            contenders["lightning"] = lightning
        for run in contenders.values():
            run(warm)
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for round_ in range(2):
            for name in list(contenders)[:: 1 if round_ == 0 else -1]:
                times[name].append(setup.timed(lambda: contenders[name](data)))
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    seconds = {name: statistics.median(values) for name, values in times.items()}
    samples = len(data[0])
    return {
        "ok": all(torch.isfinite(p).all().item() for p in model.network.parameters()),
        "samples": samples,
        "batch": batch,
        "hand_samples_per_s": samples / seconds["hand"],
        "fit_samples_per_s": samples / seconds["fit"],
        "fit_over_hand_time": seconds["fit"] / seconds["hand"],
        "lightning_samples_per_s": samples / seconds["lightning"] if lightning else None,
        "lightning_over_hand_time": seconds["lightning"] / seconds["hand"] if lightning else None,
        "runs_s": times,
    }


def check_compile(setup: Setup) -> dict:
    """prepare(compile=True) against the hand loop over torch.compile(network): weights and time.

    Under deterministic algorithms: without them, the kernels torch.compile generates for
    the GPU add with atomics, and two runs of the same hand loop end apart (0.084 in a
    LeNet weight after one epoch on an H100), so equality would prove nothing.
    """
    data = setup.lenet_data()
    torch.use_deterministic_algorithms(True)
    try:
        hand_net, hand_opt = lenet(setup)
        # Each contender starts from an empty compile cache: otherwise the second reuses what
        # the first learnt (a batch dimension already seen to vary is compiled dynamic at once).
        torch._dynamo.reset()
        compiled = torch.compile(hand_net)
        hand_warm_s = setup.timed(lambda: hand_epoch(compiled, hand_opt, data))
        hand_s = setup.timed(lambda: hand_epoch(compiled, hand_opt, data))
        torch._dynamo.reset()
        model = fitted(setup, *lenet(setup), compile=True)
        fit_warm_s = setup.timed(lambda: fit_epoch(model, data))
        fit_s = setup.timed(lambda: fit_epoch(model, data))
    finally:
        torch.use_deterministic_algorithms(False)
    difference = max_difference(model, hand_net)
    return {
        "ok": difference <= TOLERANCE,
        "max_weight_difference": difference,
        "hand_first_epoch_s": hand_warm_s,
        "fit_first_epoch_s": fit_warm_s,
        "hand_s": hand_s,
        "fit_s": fit_s,
        "time_ratio": fit_s / hand_s,
    }


CHECKS: dict[str, Callable[[Setup], dict]] = {
    "fit_vs_hand_loop": check_fit_vs_hand_loop,
    "amp_fp16": check_amp_fp16,
    "amp_bf16": check_amp_bf16,
    "pinned_workers": check_pinned_workers,
    "background_save": check_background_save,
    "export": check_export,
    "ddp_one_process": check_ddp_one_process,
    "fsdp_one_process": check_fsdp_one_process,
    "resnet18_epoch": check_resnet18_epoch,
    "compile": check_compile,
}


def run_check(name: str, setup: Setup) -> dict:
    """One check's line: its figures, or ``ok: false`` with the error that stopped it."""
    started = time.perf_counter()
    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the JSON lines
            figures = CHECKS[name](setup)
    except Exception as error:  # a failed check is reported, and the next one runs
        figures = {
            "ok": False,
            "error": f"{type(error).__name__}: {error}"[:2000],
            "where": traceback.format_exc().splitlines()[-3:],
        }
    return {"check": name, **figures, "seconds": round(time.perf_counter() - started, 2)}


def summary(setup: Setup, lines: list[dict], seconds: float) -> dict:
    failed = [line["check"] for line in lines if not line["ok"]]
    return {
        "summary": "all passed" if not failed else f"{len(failed)} failed",
        "passed": len(lines) - len(failed),
        "failed": failed,
        "device": str(setup.device),
        "card": torch.cuda.get_device_name(setup.device) if setup.cuda else platform.machine(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "quick": setup.quick,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(seconds, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--quick", action="store_true", help="small data: a few minutes on a CPU")
    parser.add_argument("--out", help="also write the JSON lines to this file")
    parser.add_argument("--checks", help=f"a comma-separated subset of: {', '.join(CHECKS)}")
    parser.add_argument("--worker", choices=("ddp", "fsdp"), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(
            "--device cuda, but torch.cuda.is_available() is False here; use --device cpu."
        )
    names = list(CHECKS) if args.checks is None else args.checks.split(",")
    unknown = [name for name in names if name not in CHECKS]
    if unknown:
        parser.error(f"unknown check(s) {', '.join(unknown)}; choose from {', '.join(CHECKS)}.")
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    setup = Setup(args.device, args.quick)
    if args.worker:
        worker(setup, args.worker, args.result)
        return 0
    started = time.perf_counter()
    lines: list[dict] = []
    out = open(args.out, "w") if args.out else None

    def emit(line: dict) -> None:
        text = json.dumps(line)
        print(text, flush=True)
        if out:
            out.write(text + "\n")
            out.flush()

    for name in names:
        lines.append(run_check(name, setup))
        emit(lines[-1])
    emit(summary(setup, lines, time.perf_counter() - started))
    if out:
        out.close()
    return 0 if all(line["ok"] for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
