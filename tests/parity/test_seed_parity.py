"""Keras' tests of seeding a whole program, translated to hapi.seed_everything.

Keras 3's ``keras.utils.set_random_seed(seed)`` seeds Python's, NumPy's and
the backend's generators alike; ``hapi.seed_everything(seed)`` does the same
on one process (on several, each process gets a stream of its own).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import hapi


def test_set_random_seed():
    """keras/src/utils/rng_utils_test.py::TestRandomSeedSetting::test_set_random_seed.

    A network with dropout built after seeding, predicting over NumPy data
    read in a shuffled order: the same seed gives the same outputs.
    """

    def get_model_output():
        network = nn.Sequential(nn.Linear(10, 10), nn.Dropout(0.5), nn.Linear(10, 10))
        model = hapi.Model(network, inputs=1, labels=0)
        x = torch.from_numpy(np.random.random((32, 10)).astype("float32"))
        loader = DataLoader([(row,) for row in x], batch_size=16, shuffle=True)
        return model.predict(loader, stack_outputs=True, verbose=0)[0]

    hapi.seed_everything(42)
    y1 = get_model_output()
    hapi.seed_everything(42)
    y2 = get_model_output()
    torch.testing.assert_close(y1, y2)


def test_set_random_seed_refuses_a_seed_that_is_no_integer():
    """keras/src/utils/rng_utils.py::set_random_seed's check of its argument (no upstream test).

    Keras raises ValueError for a seed that is not an int; torch-hapi raises
    TypeError, as for every argument of the wrong type, and takes NumPy's
    integers too.
    """
    with pytest.raises(TypeError, match="needs an integer seed"):
        hapi.seed_everything("42")
    assert hapi.seed_everything(np.int32(42)) == 42
