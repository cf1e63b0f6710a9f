"""A Model's files: checkpoints (plain, sharded, in the background), loading and resuming, export.

:class:`ModelFiles` is a part of :class:`hapi.Model` (a mixin): it reads and
writes the model's state through :mod:`hapi.checkpoint` (files) and
:mod:`hapi.distributed` (which process writes, shards); the rest of the Model
never touches a file.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any

import torch

from hapi import checkpoint, distributed
from hapi import resume as resuming  # load() has an argument named resume
from hapi.amp import check_scaler_state
from hapi.checkpoint import matching as state_match
from hapi.rng import global_state

# The position of a file written before torch-hapi recorded the epoch's order.
_UNKNOWN_POSITION = {"kind": "unknown"}
_PLAIN = (type(None), bool, int, float, str)


class ModelFiles:
    """``save``, ``load``, ``wait_for_saves``, ``sharded`` and ``export`` of :class:`hapi.Model`."""

    @property
    def sharded(self) -> bool:
        """Whether each process holds only a shard of the weights (FSDP on several processes).

        A callback that saves often reads it to choose ``save(..., sharded=True)``
        (``BackupAndRestore`` does), which spares gathering the whole model.
        """
        return self._strategy._shards_weights

    def save(
        self,
        path: str | os.PathLike,
        training: bool = True,
        resumable: bool = False,
        sharded: bool = False,
        wait: bool = True,
    ) -> str:
        """Write a checkpoint, atomically: a crash never leaves a half-written file.

        Every process must call it (it is collective); only the main process
        writes, so never put it under ``if is_main``. What is written is what
        every process evaluates.

        Args:
            path: the file to write; ``.pt`` is added unless it ends in ``.pt``
                or ``.pth``.
            training: ``True``: the network, optimizer(s), gradient scaler,
                epoch/step counters and RNG states, to continue training;
                ``False``: only the network's weights, for inference, as the
                network's plain ``state_dict`` (full tensors under every
                strategy), which ``net.load_state_dict(torch.load(path,
                weights_only=True))`` reads with no torch-hapi, and
                :meth:`load` too.
            resumable: during ``fit``, also what ``load(..., resume=True)``
                needs to continue that fit exactly (each process's RNG states
                and running figures, the data order, every callback's
                ``state_dict``); ``BackupAndRestore`` saves this way.
            sharded: write a directory ``path`` through torch's distributed
                checkpoint (DCP) instead: every process writes the shards it
                holds, in parallel (the directory must be one that every
                process sees, as on a shared file system); :meth:`load` reads
                it on any number of processes, under any strategy.
            wait: ``False`` returns as soon as the state is copied to CPU
                memory; the file is written in the background and replaces the
                previous one only once complete. The next save or load,
                :meth:`wait_for_saves` and the end of the script wait for it,
                Ctrl-C included (the interrupt is delivered once the file is
                whole). The CPU copy is reused by the next background save.

        Returns:
            The file written (``path`` + ``.pt``), or the directory when
            ``sharded``.

        Raises:
            ValueError: ``sharded=True`` with several optimizers.
            hapi.checkpoint.CheckpointError: the state holds an object the
                safe loader would refuse (the message names the entry), or the
                file could not be written, now or in the background (a full or
                read-only disk: also an ``OSError`` with its ``errno``); the
                previous file is left as it was.
        """
        distributed.sync_from_main(self._network)  # what is written is what every process evaluates
        state: dict[str, Any] = {"format": checkpoint.FORMAT, "version": checkpoint.VERSION}
        if not sharded:
            state["network"] = self._strategy._full_state_dict(self._network)
        if training:
            optimizer_state, optimizer_type = (
                (
                    None
                    if sharded
                    else self._strategy._full_optimizer_state(self._network, self._optimizer),
                    type(self._optimizer).__name__,
                )
                if self._optimizer is not None
                else self._pending_optimizer or (None, None)
            )
            state.update(
                {
                    "optimizer": optimizer_state,
                    "optimizer_type": optimizer_type,
                    "scaler": self._scaler.state_dict()
                    if self._scaler is not None
                    else self._pending_scaler_state,
                    "epoch": self.epoch,
                    "epoch_step": self.epoch_step,
                    "step": self.step,
                    "rng": global_state(),
                }
            )
            if (
                len(self._optimizers) > 1
            ):  # a train_step of the user's own: every optimizer, by name
                if sharded:
                    raise ValueError(
                        "save(sharded=True) holds one optimizer; this Model has "
                        f"{len(self._optimizers)}. Save with sharded=False."
                    )
                state.update(
                    optimizer=None,
                    optimizer_type=None,
                    optimizers={
                        name: self._strategy._full_optimizer_state(self._network, optimizer)
                        for name, optimizer in self._optimizers.items()
                    },
                    optimizer_types={
                        name: type(o).__name__ for name, o in self._optimizers.items()
                    },
                )
            if resumable and self._fit_run is not None:
                run = self._fit_run
                state["fit"] = resuming.fit_state(
                    run.data_seed,
                    run.train_data.position(self.epoch_step),
                    state["rng"],
                    self._metrics,
                    run.callbacks,
                    resuming.step_state(self),
                )
        if not (training or sharded):  # the plain state_dict: loads with no torch-hapi
            return checkpoint.save_state(path, state["network"], wait=wait)
        if sharded:
            optimizer = self._optimizer if training else None
            return checkpoint.save_sharded(
                path,
                state,
                functools.partial(
                    checkpoint.save_shards, network=self._network, optimizer=optimizer
                ),
                wait=wait,
            )
        return checkpoint.save_state(path, state, wait=wait)

    def wait_for_saves(self) -> None:
        """Return once every ``save(..., wait=False)`` is on disk; raise if one failed.

        Call it before reading a background-saved file from elsewhere, or to
        learn of a failed write early. Every process must call it (it is
        collective, like ``save``). It also frees the CPU copy of the state
        that background saves keep for reuse.

        Raises:
            hapi.checkpoint.CheckpointError: a background write failed.
        """
        checkpoint.wait_for_writes()
        checkpoint.release_staging()

    def load(
        self,
        path: str | os.PathLike,
        skip_mismatch: bool = False,
        reset_optimizer: bool = False,
        resume: bool = False,
    ) -> None:
        """Restore a checkpoint written by :meth:`save` (or a plain ``state_dict`` file).

        Loading never runs code from the file (``weights_only``), and a
        network of another architecture is refused with the keys that differ.
        The optimizer's per-parameter state (momentum, Adam's moments, step
        counts) is restored, now or at the next ``prepare``; its settings
        (``lr``, ``betas``, ``weight_decay``, ...) stay those of the optimizer
        given to ``prepare``, whichever came first, and a warning names any
        the file had otherwise. The epoch and step counters are restored. Every
        process calls it; a sharded directory loads on any number of processes.

        Args:
            path: the file (``.pt`` may be left out) or sharded directory.
            skip_mismatch: load only tensors whose names and shapes match,
                warning about the rest, instead of raising (fine-tuning a
                network whose head changed).
            reset_optimizer: leave the optimizer's current state as it is.
            resume: also restore what continuing an interrupted ``fit`` needs
                -- RNG states, the data order and position in the epoch, the
                running figures, the optimizer's settings (a schedule may have
                changed them) and every callback's state -- from a file saved
                with ``resumable=True``. Only while ``fit`` restores an
                interrupted run, before its first batch (``fit(resume_from=)``
                and ``callbacks.BackupAndRestore.restore_backup`` call it), on
                every process: each gets the copy furthest into training among
                the machines, so no shared file system is needed, even when a
                restart gives rank 0 to another machine.

        Raises:
            FileNotFoundError: no file at ``path`` / ``path.pt`` (with
                ``resume``: on no machine; raised on every process).
            hapi.checkpoint.CheckpointError: the file is damaged, carries code,
                or belongs to another architecture (the error names the keys).
        """
        if resume:
            run = self._fit_run  # checked before the collective
            resuming.check_fitting(run is not None and run.restoring)
            file, state = checkpoint.load_freshest_state(path)
            resuming.check_resumable(file, state)
        else:
            file, state = checkpoint.load_state(path)
        # The counters first: a value no run writes is refused before anything is changed.
        epoch = resuming.count(file, state, "epoch", self._fit_run.epochs if resume else None)
        epoch_step, step = (resuming.count(file, state, key) for key in ("epoch_step", "step"))
        if state.get("optimizer_type") is not None:
            resuming.check_like(file, state["optimizer_type"], "", "'optimizer_type'")
        if not (reset_optimizer or skip_mismatch):  # else not restored, or only if it fits
            self._check_optimizer_states(file, state)
        skipped = (
            self._load_shards(file, state, skip_mismatch)
            if "shards" in state
            else self._load_weights(file, state, skip_mismatch)
        )
        if skipped:
            warnings.warn(
                f"Loaded {file!r} partially; skipped {len(skipped)} tensors whose name or "
                f"shape do not match this network: {skipped}.",
                stacklevel=2,
            )
        optimizer_state, optimizer_shards = state.get("optimizer"), state.get("optimizer_shards")
        if (optimizer_state is not None or optimizer_shards is not None) and not reset_optimizer:
            if skipped:
                warnings.warn(
                    "The optimizer state in the checkpoint was not loaded because the "
                    "network's weights did not match it.",
                    stacklevel=2,
                )
            elif self._optimizer is not None:
                with resuming.restoring(file, "'optimizer'"):
                    self._restore_optimizer(file, state, keep_hyperparameters=not resume)
            elif optimizer_shards is None:
                self._pending_optimizer = (optimizer_state, state.get("optimizer_type"))
            else:  # shards are read into the optimizer's own (sharded) state: it must exist
                warnings.warn(
                    f"The optimizer state in the sharded checkpoint {file!r} was not loaded: "
                    "this Model has no optimizer yet. Call prepare(optimizer=...) before load() "
                    "to restore it.",
                    stacklevel=2,
                )
        if state.get("optimizers") is not None and not reset_optimizer and not skipped:
            with resuming.restoring(file, "'optimizers'"):
                self._restore_optimizers(file, state, keep_hyperparameters=not resume)
        if state.get("scaler") is not None:
            check_scaler_state(file, state["scaler"])
            if self._scaler is not None:
                with resuming.restoring(file, "'scaler'"):
                    self._scaler.load_state_dict(state["scaler"])
            else:
                self._pending_scaler_state = state["scaler"]
        self.epoch, self.epoch_step, self.step = epoch, epoch_step, step
        if resume:
            self._resume_fit(file, state)

    def _load_weights(self, file: str, state: dict, skip_mismatch: bool) -> list[str]:
        network = state.get("network")
        resuming.check_like(file, network, {}, "'network'")
        for key, value in network.items():
            if not (torch.is_tensor(value) or str(key).endswith("_extra_state")):
                resuming.refuse(file, f"'network'[{key!r}]", value, "a tensor")
        weights, skipped = state_match.match_state_dict(self._network, network, file, skip_mismatch)
        self._strategy._load_state_dict(self._network, weights, strict=not skipped)
        return skipped

    def _load_shards(self, file: str, state: dict, skip_mismatch: bool) -> list[str]:
        """A sharded checkpoint's weights, resharded for this run (collectives)."""
        directory = checkpoint.shards_directory(file, state)
        saved = {
            key: torch.empty(shape, device="meta")
            for key, shape in checkpoint.saved_shapes(directory).items()
        }
        weights, skipped = state_match.match_state_dict(self._network, saved, file, skip_mismatch)
        checkpoint.load_shards(directory, self._network, set(weights))
        return skipped

    def _check_optimizer_states(self, file: str, state: dict) -> None:
        """Each saved optimizer state of the layout torch writes, its tensors of their parameters'
        shapes, its settings of this optimizer's types; refused with the entry before any is used."""
        named = [
            ("'optimizer'", state.get("optimizer"), self._optimizer),
            ("'optimizer_shards'", state.get("optimizer_shards"), self._optimizer),
        ]
        if isinstance(state.get("optimizers"), dict):
            named += [
                (f"'optimizers'[{name!r}]", saved, self._optimizers.get(name))
                for name, saved in state["optimizers"].items()
            ]
        refuse = functools.partial(resuming.refuse, file)
        for where, saved, optimizer in named:
            if saved is None:
                continue
            resuming.check_like(file, saved, {"state": {}, "param_groups": []}, where)
            if optimizer is None:
                continue
            groups, params = optimizer.state_dict()["param_groups"], optimizer.param_groups
            shapes = [tuple(p.shape) for group in params for p in group["params"]]
            for index, group in enumerate(saved.get("param_groups", [])):
                resuming.check_like(file, group, groups[0], f"{where}['param_groups'][{index}]")
                for name, value in group.items():  # a setting torch leaves None: a plain value
                    if groups[0].get(name, 0) is None and not isinstance(value, _PLAIN):
                        refuse(
                            f"{where}['param_groups'][{index}][{name!r}]", value, "a plain value"
                        )
            # torch's optimizers keep tensors per parameter (and a step count); LBFGS and
            # optimizers of other libraries may keep numbers and lists of tensors too.
            lenient = isinstance(optimizer, torch.optim.LBFGS) or not type(
                optimizer
            ).__module__.startswith("torch.optim")
            for key, entry in saved.get("state", {}).items():
                resuming.check_like(file, entry, {}, f"{where}['state'][{key!r}]")
                shape = shapes[key] if isinstance(key, int) and 0 <= key < len(shapes) else None
                for name, value in entry.items():
                    at = f"{where}['state'][{key!r}][{name!r}]"
                    items = value if lenient and isinstance(value, (list, tuple)) else [value]
                    plain = lenient or name == "step"
                    if not all(
                        torch.is_tensor(v) or v is None or (plain and isinstance(v, _PLAIN))
                        for v in items
                    ):
                        refuse(at, value, "a tensor" + (", a number or a list" if lenient else ""))
                    if shape and torch.is_tensor(value) and value.dim() and value.shape != shape:
                        refuse(at, value, f"a tensor of the parameter's shape {shape}")

    def _restore_optimizer(self, file: str, state: dict, keep_hyperparameters: bool) -> None:
        """The checkpoint's optimizer state into this Model's optimizer: from the file, or its shards.

        ``keep_hyperparameters``: the settings given to prepare() win (a load);
        a resume takes the file's too, schedules having changed them.
        """
        shards = state.get("optimizer_shards")
        if shards is None:
            self._load_optimizer_state(
                state["optimizer"],
                state.get("optimizer_type"),
                source=file,
                keep_hyperparameters=keep_hyperparameters,
            )
            return
        directory = checkpoint.shards_directory(file, state)
        state_match.load_optimizer_state(
            self._optimizer,
            {"param_groups": shards["param_groups"]},
            state.get("optimizer_type"),
            file,
            load=lambda _: _load_optimizer_shards(
                directory, self._network, self._optimizer, shards
            ),
            keep_hyperparameters=keep_hyperparameters,
        )

    def _restore_optimizers(self, file: str, state: dict, keep_hyperparameters: bool) -> None:
        """Several optimizers (a train_step of the user's own), matched by name."""
        saved = state["optimizers"]
        if sorted(saved) != sorted(self._optimizers):
            warnings.warn(
                f"{file!r} holds the states of optimizers {sorted(saved)}, but this Model was prepared "
                f"with {sorted(self._optimizers) or 'none'}; they were not loaded. Call prepare() with "
                "the same optimizers (a list in the same order, or a dict with the same names) before "
                "load().",
                stacklevel=3,
            )
            return
        for name, optimizer_state in saved.items():
            self._load_optimizer_state(
                optimizer_state,
                state["optimizer_types"][name],
                source=f"{file} ({name!r})",
                keep_hyperparameters=keep_hyperparameters,
                optimizer=self._optimizers[name],
            )

    def _resume_fit(self, file: str, state: dict) -> None:
        """Put the running fit back where the file left it.

        Each process restores its own part of the file: one refused on one
        process is raised on every process (one collective), none left waiting.
        """
        run, saved, failure = self._fit_run, state["fit"], None
        try:
            own, first_rank = resuming.restore_fit(saved, file, self._metrics, run.callbacks)
            run.data_seed = run.train_data.seed = saved["data_seed"]
            with resuming.restoring(file, "'step_state'"):
                resuming.restore_step_state(self, own, file)
            with resuming.restoring(file, "the data position ('data')"):
                self.epoch_step, outcome, reason = run.train_data.resume(
                    saved.get("data") or _UNKNOWN_POSITION,
                    None if own is None else own.get("data"),
                    first_rank.get("data") or {"generators": {}},
                    self.epoch,
                    self.epoch_step,
                )
        except checkpoint.CheckpointError as error:
            failure = error
        refused = [
            message for message in distributed.gather_objects(failure and str(failure)) if message
        ]
        if refused:
            raise failure or checkpoint.CheckpointError(refused[0])
        resuming.warn_resume(file, len(saved["per_rank"]), outcome, reason)

    def _load_optimizer_state(
        self,
        optimizer_state: dict,
        saved_type: str | None,
        *,
        source: str,
        keep_hyperparameters: bool,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        """A saved state into ``optimizer`` (default: the Model's), the strategy's way."""
        optimizer = self._optimizer if optimizer is None else optimizer
        state_match.load_optimizer_state(
            optimizer,
            optimizer_state,
            saved_type,
            source,
            load=functools.partial(self._strategy._load_optimizer_state, self._network, optimizer),
            keep_hyperparameters=keep_hyperparameters,
        )

    def export(
        self, path: str | os.PathLike, example_inputs: Any, dynamic_batch: bool = True
    ) -> str:
        """Write the network for inference through ``torch.export``, to run with no torch-hapi.

        ``torch.export.load(path).module()`` runs it anywhere torch runs: no
        Python class of yours and no torch-hapi needed. The network is exported
        in eval mode. Every process calls it; rank 0 writes. Under FSDP on
        several processes every process first gathers the full weights and
        rank 0 exports a plain copy of the network holding them; the copy costs
        rank 0 the memory of the whole model once, as ``save`` does.

        Args:
            path: the file to write; ``.pt2`` is added when missing.
            example_inputs: an input the network accepts (a tensor, or a tuple
                of them for several inputs), used to trace it.
            dynamic_batch: let the exported program take any batch size, not
                only the example's.

        Returns:
            The file written (``path`` + ``.pt2``).

        Raises:
            RuntimeError: rank 0 could not export (its error says why).
        """
        from hapi.export import export_network, export_path  # torch.export only when exporting

        network = self._strategy._inference_network(self._network)  # a collective under FSDP
        distributed.on_main(  # every process calls it, rank 0 writes (like save)
            lambda: export_network(network(), path, example_inputs, dynamic_batch=dynamic_batch),
            lambda: RuntimeError(
                f"Rank 0 could not export to {export_path(path)!r}; see its error."
            ),
        )
        return export_path(path)


def _load_optimizer_shards(directory: str, network: Any, optimizer: Any, shards: dict) -> None:
    """A sharded checkpoint's optimizer state, once its groups hold as many parameters as this
    optimizer's: torch's ``load_state_dict`` refuses others, its sharded loader takes them."""
    sizes = [len(group["params"]) for group in shards["param_groups"]]
    if sizes != [len(group["params"]) for group in optimizer.param_groups]:
        raise ValueError(
            f"its parameter groups hold {sizes} parameters, this optimizer's "
            f"{[len(group['params']) for group in optimizer.param_groups]}"
        )
    checkpoint.load_optimizer_shards(directory, network, optimizer, shards)
