"""hapi.rng: the generators' states a resumable checkpoint keeps, in every layout it was written in."""

from __future__ import annotations

import random

import numpy as np
import torch

from hapi.rng import generator_states, global_state, set_generator_states, set_global_state


def _draws(numpy_generator=np.random):
    return random.random(), float(numpy_generator.rand()), float(torch.rand(()))


def test_the_global_states_round_trip_through_a_safe_file(tmp_path):
    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    torch.save(global_state(), tmp_path / "state.pt")
    expected = _draws()
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    set_global_state(torch.load(tmp_path / "state.pt", weights_only=True))
    assert _draws() == expected


def test_files_written_by_earlier_versions_restore_the_same_streams():
    """Backups written before 2026-11-27 held NumPy's state as a dict of keys/pos/has_gauss/
    cached_gaussian, Python's as one flat list, a RandomState of the data's as a list of four:
    a run resumed from such a backup draws what the interrupted one would have."""
    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, python_gauss = random.getstate()
    earlier = {
        "torch": torch.get_rng_state(),
        "cuda": [],
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(gauss),
        },
        "python": [version, *internal, python_gauss],
    }
    expected = _draws()
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    set_global_state(earlier)
    assert _draws() == expected

    own = np.random.RandomState(7)
    _, keys, pos, has_gauss, gauss = own.get_state()
    listed = [torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)]
    expected_own = own.rand(3).tolist()
    other = np.random.RandomState(0)
    set_generator_states({".sampler.rng": other}, {".sampler.rng": listed})
    assert other.rand(3).tolist() == expected_own


def test_generators_of_the_data_round_trip():
    generators = {"a": random.Random(1), "b": np.random.RandomState(2), "c": torch.Generator()}
    generators["d"] = np.random.default_rng(3)
    states = generator_states(generators)
    expected = [generators["a"].random(), generators["b"].rand(), generators["d"].random()]
    expected.append(float(torch.rand((), generator=generators["c"])))
    set_generator_states(generators, states)
    again = [generators["a"].random(), generators["b"].rand(), generators["d"].random()]
    again.append(float(torch.rand((), generator=generators["c"])))
    assert again == expected
