"""Mixed precision: ``prepare(amp=...)`` read into what the steps need.

``amp`` takes torch-hapi's short names and Paddle's ``amp_configs`` alike:

* ``None``, ``"bf16"``, ``"fp16"``: float32; bfloat16 autocast; float16
  autocast with a gradient scaler (torch's defaults, which are Paddle's).
* Paddle's levels ``"O0"`` (float32) and ``"O1"`` (float16 autocast with a
  gradient scaler, the same as ``"fp16"``).
* A dict of Paddle's keys: ``level`` (default ``"O1"``, as in Paddle),
  ``dtype`` (``"float16"``, the default, or ``"bfloat16"``) and the loss
  scaler's ``init_loss_scaling``, ``incr_ratio``, ``decr_ratio``,
  ``incr_every_n_steps``, ``decr_every_n_nan_or_inf`` and
  ``use_dynamic_loss_scaling``, mapped onto ``torch.amp.GradScaler``'s
  ``init_scale``, ``growth_factor``, ``backoff_factor`` and
  ``growth_interval``; ``use_dynamic_loss_scaling=False`` keeps the scale at
  ``init_loss_scaling`` (steps with inf/NaN gradients are still skipped, as
  Paddle skips them).

What torch has no equivalent for is refused with a ``ValueError`` that says
why and what to use instead, rather than accepted and silently ignored:
``"O2"`` (Paddle's pure float16: torch has no switch that casts a network to
float16 while the optimizer keeps float32 master weights), per-op lists
(``custom_white_list``/``custom_black_list``: ``torch.autocast`` picks each
op's dtype from fixed lists), ``decr_every_n_nan_or_inf`` other than 1 (torch's
scaler backs off at every inf/NaN step), and Paddle's static-graph keys.
Unknown keys are refused too, as in Paddle.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from hapi.checkpoint.errors import refuse

# torch-hapi's names of the autocast dtypes; the steps and strategies read these.
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_LEVELS = ("O0", "O1", "O2")
# Paddle's loss-scaling key -> (torch.amp.GradScaler's keyword, the open range of its values,
# what they are).
_SCALER_KEYS = {
    "init_loss_scaling": ("init_scale", 0, math.inf, "a positive finite number (default 65536)"),
    "incr_ratio": ("growth_factor", 1, math.inf, "greater than 1 (the scale grows by it)"),
    "decr_ratio": ("backoff_factor", 0, 1, "between 0 and 1 (the scale shrinks by it)"),
    "incr_every_n_steps": ("growth_interval", 0, math.inf, "a positive int"),
}
_STEP_COUNTS = ("growth_interval", "_growth_tracker")  # ints in GradScaler's state
_LOSS_SCALING = (*_SCALER_KEYS, "decr_every_n_nan_or_inf", "use_dynamic_loss_scaling")
_OP_LISTS = ("custom_white_list", "custom_black_list", "custom_black_varnames")
_ACCEPTED_KEYS = ("level", "dtype", *_LOSS_SCALING, *_OP_LISTS, "use_fp16_guard")


class AmpSetting(NamedTuple):
    """What ``prepare(amp=...)`` chose, in torch's terms.

    ``name`` is ``None``, ``"bf16"`` or ``"fp16"`` (what the steps and the
    FSDP policy read); ``scaler_options`` are ``torch.amp.GradScaler``
    keywords, used with ``"fp16"`` only; ``dynamic_scaling=False`` keeps the
    scale fixed.
    """

    name: str | None = None
    scaler_options: dict[str, Any] = {}  # never mutated: passed as **kwargs
    dynamic_scaling: bool = True


class FixedScaleGradScaler(torch.amp.GradScaler):
    """A ``GradScaler`` whose scale never moves: Paddle's ``use_dynamic_loss_scaling=False``.

    Gradients are still checked: a step with inf/NaN gradients is skipped,
    as Paddle's scaler skips it, but the scale stays where it is.
    """

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        if new_scale is None and self._enabled and self._scale is not None:
            new_scale = self._scale  # keep it (a tensor: no device sync)
        super().update(new_scale)


def parse_amp(amp: Any) -> AmpSetting:
    """``prepare``'s ``amp``: a name, a Paddle level or a Paddle ``amp_configs`` dict.

    Raises:
        ValueError: an unknown value or key, or a Paddle setting torch has no
            equivalent for; the message says what to use instead.
    """
    if amp is None or (isinstance(amp, str) and amp in AMP_DTYPES):
        return AmpSetting(amp)
    if isinstance(amp, Mapping) or (isinstance(amp, str) and amp in _LEVELS):
        level = isinstance(amp, str)
        return _from_configs({"level": amp} if level else amp, "amp" if level else "amp['level']")
    raise ValueError(
        f"amp must be None, 'bf16' or 'fp16'; received {amp!r}. ('fp16' adds a gradient scaler.) "
        "Paddle's levels 'O0'/'O1' and a dict of its amp_configs keys are accepted too, e.g. "
        "{'level': 'O1', 'init_loss_scaling': 1024}."
    )


def _from_configs(configs: Mapping, where: str) -> AmpSetting:
    """A Paddle level (``where`` names it in a message) with Paddle's other amp_configs keys."""
    unknown = [key for key in configs if key not in _ACCEPTED_KEYS]
    if "use_pure_fp16" in unknown:
        raise ValueError(
            "amp['use_pure_fp16'] is not a key: as in Paddle, the level alone chooses the kind of "
            "mixed precision; give amp={'level': 'O1'}."
        )
    if unknown:
        raise ValueError(
            f"amp has unknown key(s) {unknown!r}. Accepted keys (Paddle's amp_configs): "
            f"{', '.join(_ACCEPTED_KEYS)}."
        )
    level = configs.get("level", "O1")  # Paddle: a dict without 'level' means O1
    if level not in _LEVELS:
        raise ValueError(
            f"amp['level'] must be 'O0', 'O1' or 'O2' (Paddle's levels); received {level!r}."
        )
    if level == "O0" or not configs:  # Paddle: float32, whatever the other keys say
        return AmpSetting()
    if level == "O2":
        raise ValueError(
            f"{where}={level!r} is Paddle's pure float16 training (float16 weights, float32 "
            "master copies); torch has no such switch and torch-hapi does not fake one. Use 'O1' "
            "(or 'fp16'/'bf16'): autocast's low-dtype matmuls give most of O2's speed."
        )
    if "use_fp16_guard" in configs:
        raise ValueError(
            "amp['use_fp16_guard'] belongs to Paddle's static-graph mode (Paddle refuses it in "
            "dynamic mode too); remove the key."
        )
    for key in _OP_LISTS:
        if configs.get(key):
            raise ValueError(
                f"amp[{key!r}]={configs[key]!r}: torch.autocast has no per-op lists. Remove the "
                "key; to keep a part in float32, run it under torch.autocast(device_type, "
                "enabled=False) in your forward and cast its inputs with .float()."
            )
    dtype = configs.get("dtype", "float16")
    name = {"float16": "fp16", "bfloat16": "bf16"}.get(str(dtype).removeprefix("torch."))
    if name is None or not isinstance(dtype, (str, torch.dtype)):
        raise ValueError(f"amp['dtype'] must be 'float16' or 'bfloat16'; received {dtype!r}.")
    scaling = [k for k in _LOSS_SCALING if k in configs]
    if name == "bf16" and scaling:
        raise ValueError(
            f"amp has dtype 'bfloat16' and loss-scaling key(s) {scaling!r}, but bfloat16 needs no "
            "loss scaler (it has float32's range). Remove those keys, or use dtype 'float16'."
        )
    decr = configs.get("decr_every_n_nan_or_inf", 1)
    if isinstance(decr, bool) or decr != 1:
        raise ValueError(
            f"amp['decr_every_n_nan_or_inf']={decr!r}: torch.amp.GradScaler shrinks the scale at "
            "every inf/NaN step, as Paddle's default 1 does. Remove the key; a gentler back-off "
            "is amp['decr_ratio'] closer to 1."
        )
    options = {}
    for key, (option, low, high, meaning) in _SCALER_KEYS.items():
        value = configs.get(key, math.nan)
        if key in configs and not _fits(option, value, low, high):
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            raise ValueError(
                f"amp[{key!r}] must be {meaning if number else 'a number'}; received {value!r}."
            )
        if key in configs:
            options[option] = value if option in _STEP_COUNTS else float(value)
    dynamic = configs.get("use_dynamic_loss_scaling", True)
    if not isinstance(dynamic, bool):
        raise ValueError(
            f"amp['use_dynamic_loss_scaling'] must be True or False; received {dynamic!r}."
        )
    return AmpSetting(name, options, dynamic)


def _fits(option: str, value: Any, low: float, high: float) -> bool:
    """``value`` is a number (an int for a step count) in the open range ``(low, high)``."""
    kinds = int if option in _STEP_COUNTS else (int, float)
    return not isinstance(value, bool) and isinstance(value, kinds) and low < value < high


def check_scaler_state(file: str, saved: Any) -> None:
    """A saved ``GradScaler.state_dict()`` holds what a scaler writes, or a CheckpointError names it.

    A scale of 0 or NaN, or a tracker at its interval, loads without complaint
    and then skips every update or never grows the scale again: training
    silently goes wrong instead of failing.
    """
    if not isinstance(saved, dict):
        refuse(file, "'scaler'", saved, "a GradScaler's state dict")
    # The state names GradScaler's init_scale "scale", its other keywords as they are.
    ranges = {option.replace("init_", ""): rest for option, *rest in _SCALER_KEYS.values()}
    ranges["_growth_tracker"] = [-1, math.inf, "an int of at least 0"]
    for key, value in saved.items():
        if key in ranges and not _fits(key, value, *ranges[key][:2]):
            refuse(file, f"'scaler'[{key!r}]", value, ranges[key][2])
    tracker, interval = saved.get("_growth_tracker", 0), saved.get("growth_interval", 2**31)
    if tracker >= min(interval, 2**31):  # the tracker is an int32 tensor
        refuse(file, "'scaler'['_growth_tracker']", tracker, f"below {interval}, its interval")


def make_scaler(setting: AmpSetting, device: torch.device) -> torch.amp.GradScaler | None:
    """fp16 needs loss scaling against gradient underflow; bf16 and float32 do not."""
    if setting.name != "fp16":
        return None
    kind = torch.amp.GradScaler if setting.dynamic_scaling else FixedScaleGradScaler
    return kind(device.type, **setting.scaler_options)
