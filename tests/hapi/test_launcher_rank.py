"""hapi.distributed.rank()/world_size()/is_main() before a Model exists: what the launcher said."""

from __future__ import annotations

import os

import pytest

from hapi import distributed

LAUNCHER = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "SLURM_PROCID",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
)


@pytest.fixture
def env(monkeypatch):
    for name in LAUNCHER:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _place():
    return distributed.rank(), distributed.world_size(), distributed.is_main()


def test_alone_it_is_rank_0_of_1(env):
    assert _place() == (0, 1, True)


def test_torchrun_and_spawn_variables_answer_before_the_group_exists(env):
    env.setenv("WORLD_SIZE", "4")
    env.setenv("RANK", "3")
    assert _place() == (3, 4, False)
    env.setenv("RANK", "0")
    assert _place() == (0, 4, True)


def test_srun_variables_answer_without_changing_the_environment(env):
    env.setenv("SLURM_STEP_NUM_TASKS", "2")
    env.setenv("SLURM_PROCID", "1")
    before = dict(os.environ)
    assert _place() == (1, 2, False)
    assert dict(os.environ) == before  # setup() sets RANK/WORLD_SIZE; asking does not
    env.setenv("WORLD_SIZE", "1")  # a launcher's WORLD_SIZE wins over Slurm's, as in setup()
    assert _place() == (0, 1, True)


def test_values_that_make_no_sense_answer_as_one_process_instead_of_failing(env):
    for world, rank in (("two", "1"), ("2", "x"), ("2", "2"), ("2", "-1"), ("2", "")):
        env.setenv("WORLD_SIZE", world)
        env.setenv("RANK", rank)
        assert _place() == (0, 1, True), (world, rank)
