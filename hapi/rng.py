"""Random streams that depend only on what they are named after.

Data loading may draw random numbers (augmentation in ``__getitem__``, a
user's sampler shuffling). For a resumed run to equal an uninterrupted one,
and for every process to agree on a sampler's order, those draws must
depend only on (seed, epoch, batch position, rank) -- not on how many draws
came before them, which a restart, a look-ahead fetch or another worker
assignment changes. :func:`seeded_streams` gives a block of code fresh
streams seeded that way and hands torch's previous one back afterwards, so
the model's own draws (dropout) are never shifted by loading.

``hapi.seed_everything`` lives here too: one call that makes a run reproducible, with a
stream per process (see :func:`seed_everything`).
"""

from __future__ import annotations

import contextlib
import random
from typing import Any, Callable, Iterator

import numpy as np
import torch

from hapi import distributed

_MASK64 = 2**64 - 1


def mix(*numbers: int) -> int:
    """A 63-bit seed from ``numbers`` (SplitMix64 steps): nearby inputs give unrelated seeds."""
    state = 0x9E3779B97F4A7C15
    for number in numbers:
        state = (state ^ (int(number) & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        state = (state ^ (state >> 27)) * 0x94D049BB133111EB & _MASK64
        state ^= state >> 31
    return state >> 1


def seed_generators(seed: int, every_device: bool = True) -> None:
    """Python's, NumPy's and torch's global generators from one seed (NumPy takes its low 32
    bits); torch's on every CUDA device too, or with ``every_device=False`` the CPU's only."""
    random.seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    (torch if every_device else torch.default_generator).manual_seed(seed)


@contextlib.contextmanager
def seeded_streams(seed: int, hand_back_torch: bool = True) -> Iterator[None]:
    """Run the block with torch's CPU generator, Python's and NumPy's global ones seeded by ``seed``.

    With ``hand_back_torch`` (the main process), torch's generator gets its
    previous state back afterwards, so the model's draws (dropout) never
    shift. Python's and NumPy's stay reseeded: saving and restoring their
    states costs 40-130 us a batch here against 2 us for torch's, and what
    the model draws from them is then a function of the batch's seed too,
    which keeps a resumed run exact. A DataLoader worker draws only for
    loading and hands nothing back. CUDA generators are left alone: loading
    runs on the CPU.
    """
    with torch.random.fork_rng(devices=[], enabled=hand_back_torch):
        seed_generators(seed, every_device=False)
        yield


def global_state() -> dict[str, Any]:
    """Every global generator's state (torch, CUDA, NumPy, Python), in tensors and plain values."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": _plain(np.random.get_state(legacy=False)),
        "python": _plain(random.getstate()),
    }


def set_global_state(state: dict[str, Any]) -> None:
    """Restore what :func:`global_state` captured."""
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np.random.set_state(_from_file(state["numpy"]))
    python = state["python"]
    if len(python) > 3:  # written before 2026-11-27: version, the 625 words, gauss in one list
        python = [python[0], python[1:-1], python[-1]]
    random.setstate(_native(python))


# Attributes never searched for generators: the data itself, and what is not an order.
_NOT_SEARCHED = {"dataset", "data_source", "collate_fn", "worker_init_fn", "indices", "weights"}
_STATE_ACCESS: tuple[tuple[type, Callable, Callable], ...] = (
    (torch.Generator, torch.Generator.get_state, torch.Generator.set_state),
    (random.Random, random.Random.getstate, random.Random.setstate),
    (np.random.RandomState, lambda g: g.get_state(legacy=False), np.random.RandomState.set_state),
    (
        np.random.Generator,
        lambda g: g.bit_generator.state,
        lambda g, s: setattr(g.bit_generator, "state", s),
    ),
)
_GENERATORS = tuple(kind for kind, _, _ in _STATE_ACCESS)


def generators_of(root: Any, depth: int = 3) -> dict[str, Any]:
    """The random generators an object keeps in its attributes, by attribute path.

    What decides a sampler's order besides the global generators: a
    ``DataLoader``'s ``generator``, a ``SubsetRandomSampler(generator=...)``'s,
    a user's batch sampler's ``random.Random``. Searched ``depth`` attributes
    deep (loader -> batch sampler -> sampler -> generator); the data set and
    plain containers are not searched. The paths name the same generators in
    a later run of the same script, so states saved by path can be put back.
    """
    found: dict[str, Any] = {}
    seen: set[int] = set()

    def search(value: Any, path: str, left: int) -> None:
        if id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, _GENERATORS):
            found[path] = value
            return
        if left == 0 or not hasattr(value, "__dict__") or isinstance(value, (type, torch.Tensor)):
            return
        for name, attribute in sorted(vars(value).items()):
            if name not in _NOT_SEARCHED and not isinstance(attribute, (list, tuple, dict)):
                search(attribute, f"{path}.{name}", left - 1)

    search(root, "", depth)
    return found


def generator_states(generators: dict[str, Any]) -> dict[str, Any]:
    """The states of :func:`generators_of`'s generators, in tensors and plain values."""
    return {path: _plain(_access(g)[0](g)) for path, g in generators.items()}


def set_generator_states(generators: dict[str, Any], states: dict[str, Any]) -> None:
    """Put saved states back into the generators found at the same paths (others are left)."""
    for path, state in states.items():
        generator = generators.get(path)
        if generator is not None:
            _access(generator)[1](generator, _from_file(state))


def _access(generator: Any) -> tuple[Callable, Callable]:
    """How to read and how to set ``generator``'s state (NumPy's legacy one as a dict)."""
    return next((get, put) for kind, get, put in _STATE_ACCESS if isinstance(generator, kind))


def _from_file(state: Any) -> Any:
    """A generator's state as :func:`_plain` wrote it, made native again; a NumPy MT19937
    state as files written before 2026-11-27 hold it (a dict of ``keys``/``pos``/
    ``has_gauss``/``cached_gaussian``, or that list for a generator of the data's) as NumPy's
    legacy tuple."""
    if isinstance(state, dict) and "keys" in state:
        state = [state[key] for key in ("keys", "pos", "has_gauss", "cached_gaussian")]
    if isinstance(state, list) and len(state) == 4 and torch.is_tensor(state[0]):
        return ("MT19937", state[0].numpy().astype(np.uint32), *state[1:])
    return _native(state)


def _plain(value: Any) -> Any:
    """A Python or NumPy generator's state as tensors, lists and numbers (arrays as (tensor,
    dtype) pairs): what ``torch.load(weights_only=True)`` reads back."""
    if isinstance(value, np.ndarray):
        return {"array": torch.from_numpy(value.astype(np.int64)), "dtype": str(value.dtype)}
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return [_plain(item) for item in value]
    return value


def _native(value: Any) -> Any:
    """What :func:`_plain` was given: arrays and tuples again."""
    if isinstance(value, dict) and set(value) == {"array", "dtype"}:
        return value["array"].numpy().astype(value["dtype"])
    if isinstance(value, dict):
        return {key: _native(item) for key, item in value.items()}
    if isinstance(value, list):
        return tuple(_native(item) for item in value)
    return value


# -- hapi.seed_everything --
#
# ``hapi.seed_everything``: one call that makes a run reproducible, with a stream per process.
#
# Seeding every process alike (``torch.manual_seed(0)`` at the top of a script run by
# torchrun) makes every process draw the same random numbers during training: a GAN's
# ``train_step`` feeds the same noise to every copy of the generator, dropout drops the same
# units on every rank, and the processes' batches are less independent than they look.
# Seeding each process differently at the top (``torch.manual_seed(seed + rank)``) breaks
# what must agree: synthetic data or a split made after seeding then differs per process, and
# ``fit`` would shard a different data set on each.
#
# :func:`seed_everything` does both, each at its moment. At the call it seeds Python's, NumPy's
# and torch's global generators (CPU and every CUDA device) alike on every process, so what
# the script builds next -- data, splits, the network -- is the same everywhere. Then, with
# ``per_process=True``, each ``fit`` moves every process but the first to a stream of its own,
# mixed from (seed, rank, the how-many-th fit since seeding), before it draws anything: the
# noise and dropout of training differ between processes and are the same run after run. The
# first process keeps the stream it had, so one process trains exactly as a hand loop seeded
# with ``torch.manual_seed(seed)`` does. ``fit``'s shuffling stays agreed (it is drawn on the
# first process and sent to the others); a DataLoader's workers need nothing more (``fit``
# loads each batch under a seed of (shuffling seed, epoch, batch, rank)). A resume puts every
# process's saved generator states back, so it continues each stream exactly.

_per_process_seed: int | None = None  # the seed of the last seed_everything(per_process=True)
_fits_since_seeding = 0


def seed_everything(seed: int, per_process: bool = True) -> int:
    """Seed Python's ``random``, NumPy's and torch's global generators alike on every process.

    Call it once at the top of the script, before building data and network (every
    process runs it with the same ``seed``). A run started again with the same seed on as
    many processes draws the same numbers on each.

    Args:
        seed: the run's seed, an integer from 0 to 2**63 - 1.
        per_process: give every process its own stream for training (the default): each
            ``fit`` moves every process but the first to a stream mixed from (seed, rank,
            fit number), so the noise a ``train_step`` of your own draws and the units
            dropout drops differ between processes. ``False`` leaves every process on the
            same stream, as Lightning's ``seed_everything`` does.

    Returns:
        ``seed``: what every process's generators got (NumPy's: its low 32 bits).

    Raises:
        TypeError: ``seed`` is not an integer.
        ValueError: ``seed`` is negative or does not fit in 63 bits.
    """
    global _per_process_seed, _fits_since_seeding
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(
            f"seed_everything(seed) needs an integer seed; received {type(seed).__name__} "
            f"{seed!r}. Pass e.g. hapi.seed_everything(42)."
        )
    seed = int(seed)
    if not 0 <= seed < 2**63:
        raise ValueError(
            f"seed_everything(seed) takes a seed from 0 to 2**63 - 1; received {seed}. Pass a "
            "non-negative integer that fits in 63 bits."
        )
    seed_generators(seed)
    _per_process_seed = seed if per_process else None
    _fits_since_seeding = 0
    return seed


def streams_for_training() -> None:
    """At the start of ``fit``: after ``seed_everything(per_process=True)``, every process but
    the first moves to a stream of its own for this fit (see the comment above
    :func:`seed_everything`)."""
    global _fits_since_seeding
    if _per_process_seed is None:
        return
    _fits_since_seeding += 1  # counted on every process alike: each fit has its own streams
    if distributed.rank() != 0:
        seed_generators(mix(_per_process_seed, distributed.rank(), _fits_since_seeding))
