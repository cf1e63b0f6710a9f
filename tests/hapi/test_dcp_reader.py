"""SafeFileSystemReader: real sharded checkpoints load; ones that could run code are refused.

Each attack is also read with torch's plain FileSystemReader as a control, so a
test shows that the planted file would really run code (or reach
torch.load(weights_only=False)) without the safe reader.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import TinyNet, make_tiny_data
from torch.distributed.checkpoint import FileSystemReader

import hapi
from hapi.checkpoint import CheckpointError
from hapi.checkpoint.dcp_io import SafeFileSystemReader

REFUSED = "torch-hapi refuses to run code from checkpoint files"
# dcp.save/load warn that no process group exists, even with no_dist=True.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def tensors() -> dict[str, Any]:
    """A state dict of the dtypes and shapes a model and its optimizer hold, nested one level."""
    torch.manual_seed(0)
    return {
        "weight": torch.randn(3, 4),
        "half": torch.randn(5, dtype=torch.bfloat16),
        "index": torch.arange(6).view(2, 3),
        "step": torch.tensor(7),
        "loss": torch.tensor(0.25),
        "image": torch.randn(1, 2, 3, 3),
        "optim": {"exp_avg": torch.randn(4), "count": torch.tensor(3, dtype=torch.int64)},
    }


def zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return {
        k: zeros_like(v) if isinstance(v, dict) else torch.zeros_like(v) for k, v in state.items()
    }


def saved(directory: Path, state: dict[str, Any] | None = None) -> Path:
    dcp.save(tensors() if state is None else state, checkpoint_id=directory, no_dist=True)
    return directory


def rewrite_metadata(directory: Path, change: Callable[[Any], None]) -> None:
    """Apply ``change`` to the real Metadata object of ``directory`` and write it back."""
    file = directory / ".metadata"
    metadata = pickle.loads(file.read_bytes())
    change(metadata)
    file.write_bytes(pickle.dumps(metadata))


class WritesMarker:
    """Unpickling this runs ``call(argument)``, which creates a marker file."""

    def __init__(self, call: Callable[[str], Any], argument: str) -> None:
        self.call, self.argument = call, argument

    def __reduce__(self) -> tuple[Any, ...]:
        return self.call, (self.argument,)


def payloads(marker: Path) -> dict[str, WritesMarker]:
    found = {"exec": WritesMarker(exec, f"open({str(marker)!r}, 'w').close()")}
    if os.name == "posix":
        command = (
            f"{shlex.quote(sys.executable)} -c {shlex.quote(f'open({str(marker)!r}, chr(119))')}"
        )
        found["os.system"] = WritesMarker(os.system, command)
    return found


def test_real_checkpoint_loads_with_equal_tensors(tmp_path: Path) -> None:
    directory = saved(tmp_path / "ckpt")
    state = zeros_like(tensors())
    dcp.load(state, storage_reader=SafeFileSystemReader(directory), no_dist=True)
    expected = tensors()
    assert torch.equal(state["optim"]["count"], expected["optim"]["count"])
    for key in ("weight", "half", "index", "step", "loss", "image"):
        assert state[key].dtype == expected[key].dtype and torch.equal(state[key], expected[key]), (
            key
        )
    assert torch.equal(state["optim"]["exp_avg"], expected["optim"]["exp_avg"])


def test_rank_metadata_path_and_load_id(tmp_path: Path) -> None:
    directory = saved(tmp_path / "ckpt")
    (directory / "__1.metadata").write_bytes((directory / ".metadata").read_bytes())
    (directory / ".metadata").unlink()
    reader = SafeFileSystemReader(directory)
    metadata = reader.read_metadata(rank=1)
    assert set(metadata.state_dict_metadata) >= {"weight", "optim.exp_avg"}
    assert metadata.storage_meta.load_id == reader.load_id


@pytest.mark.parametrize("kind", ["exec", "os.system"])
@pytest.mark.parametrize("where", ["whole file", "inside real metadata"])
def test_metadata_that_runs_code_is_refused_and_never_run(
    tmp_path: Path, kind: str, where: str
) -> None:
    marker = tmp_path / "pwned"
    if kind not in payloads(marker):
        pytest.skip("os.system payload is written for a POSIX shell")
    directory = saved(tmp_path / "ckpt")
    if where == "whole file":
        (directory / ".metadata").write_bytes(pickle.dumps(payloads(marker)[kind]))
    else:
        rewrite_metadata(directory, lambda md: setattr(md, "planner_data", payloads(marker)[kind]))
    module = {"exec": "builtins.exec", "os.system": f"{os.system.__module__}.system"}[kind]

    with pytest.raises(CheckpointError, match=f"asks to import {module}.*{REFUSED}.*sharded=True"):
        SafeFileSystemReader(directory).read_metadata()
    # dcp.load (torch 2.13) catches read_metadata's error and raises its own
    # CheckpointException (a BaseException) that quotes it.
    with pytest.raises((CheckpointError, dcp.CheckpointException), match=REFUSED):
        dcp.load(
            zeros_like(tensors()), storage_reader=SafeFileSystemReader(directory), no_dist=True
        )
    assert not marker.exists()

    with contextlib.suppress(AttributeError):  # the whole-file payload unpickles to None
        FileSystemReader(directory).read_metadata()  # control: torch's own reader runs it
    assert marker.exists()


def test_non_tensor_entry_is_refused(tmp_path: Path) -> None:
    # dcp.save stores a non-tensor value (here a float) as BytesStorageMetadata; loading it
    # goes through torch.load(weights_only=False).
    directory = saved(tmp_path / "ckpt", {"weight": torch.ones(2), "lr": 0.1})
    with pytest.raises(CheckpointError, match=rf"non-tensor entries \['lr'\].*{REFUSED}"):
        SafeFileSystemReader(directory).read_metadata()
    state: dict[str, Any] = {"weight": torch.zeros(2), "lr": 0.0}
    dcp.load(state, storage_reader=FileSystemReader(directory), no_dist=True)  # control
    assert state["lr"] == 0.1


@pytest.mark.parametrize(
    "field, value, found",
    [
        ("relative_path", "../x.distcp", "outside the checkpoint directory"),
        ("relative_path", "/etc/passwd", "outside the checkpoint directory"),
        ("relative_path", "sub/__0_0.distcp", "outside the checkpoint directory"),
        ("relative_path", "..\\x.distcp", "outside the checkpoint directory"),
        ("relative_path", "C:x.distcp", "outside the checkpoint directory"),
        ("relative_path", "..", "outside the checkpoint directory"),
        ("transform_descriptors", ["zstd"], r"stream transforms \['zstd'\]"),
    ],
)
def test_storage_entry_outside_directory_or_transformed_is_refused(
    tmp_path: Path, field: str, value: Any, found: str
) -> None:
    directory = saved(tmp_path / "ckpt")

    def change(metadata: Any) -> None:
        item = next(iter(metadata.storage_data.values()))
        setattr(item, field, value)

    rewrite_metadata(directory, change)
    FileSystemReader(directory).read_metadata()  # control: torch accepts it as is
    with pytest.raises(CheckpointError, match=f"{found}.*{REFUSED}"):
        SafeFileSystemReader(directory).read_metadata()


def test_metadata_of_another_type_is_refused(tmp_path: Path) -> None:
    directory = saved(tmp_path / "ckpt")
    (directory / ".metadata").write_bytes(pickle.dumps({"weight": [1, 2]}))
    with pytest.raises(CheckpointError, match=f"holds a dict, not DCP Metadata.*{REFUSED}"):
        SafeFileSystemReader(directory).read_metadata()


@pytest.mark.parametrize("cut", ["half", "empty", "garbage"])
def test_damaged_metadata(tmp_path: Path, cut: str) -> None:
    directory = saved(tmp_path / "ckpt")
    file = directory / ".metadata"
    raw = file.read_bytes()
    file.write_bytes(
        {"half": raw[: len(raw) // 2], "empty": b"", "garbage": b"\x80\x04not a pickle"}[cut]
    )
    with pytest.raises(CheckpointError, match=r"is damaged.*\.metadata.*bytes.*sharded=True"):
        SafeFileSystemReader(directory).read_metadata()


def test_every_cut_of_every_shard_is_a_checkpoint_error(tmp_path: Path) -> None:
    """A truncated shard file: torch raises its CheckpointException, a BaseException that
    ``except Exception`` misses; a load gives a CheckpointError naming the shards instead."""

    def model() -> hapi.Model:
        built = hapi.Model(TinyNet())
        built.prepare(torch.optim.Adam(built.parameters()), torch.nn.CrossEntropyLoss())
        return built

    trained = model()
    trained.fit(make_tiny_data(32), batch_size=8, verbose=0)
    trained.save(tmp_path / "ckpt", sharded=True)
    shards = next((tmp_path / "ckpt").glob("shards-*"))
    assert issubclass(CheckpointError, Exception)
    tried = 0
    for file in sorted(shards.glob("*.distcp")):
        raw = file.read_bytes()
        for cut in (0, 1, len(raw) // 2, len(raw) - 1):
            file.write_bytes(raw[:cut])
            with pytest.raises(CheckpointError, match=f"read the shards directory '{shards}'"):
                model().load(tmp_path / "ckpt")
            tried += 1
        file.write_bytes(raw)
    assert tried >= 4
    model().load(tmp_path / "ckpt")  # whole again: loads


def test_a_missing_metadata_file_is_named_by_the_load(tmp_path: Path) -> None:
    """A sharded checkpoint copied without its dot file: the load says which file is missing."""
    model = hapi.Model(TinyNet(), device="cpu")
    model.save(tmp_path / "ckpt", sharded=True)
    (metadata,) = (tmp_path / "ckpt").glob("shards-*/.metadata")
    metadata.unlink()
    with pytest.raises(CheckpointError, match=r"is incomplete: its metadata file .*\.metadata"):
        hapi.Model(TinyNet(), device="cpu").load(tmp_path / "ckpt")
