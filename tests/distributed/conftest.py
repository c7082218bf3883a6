"""Fixtures the expert-parallel tests share."""

from pathlib import Path

import pytest
from test_ep import RTOL, config
from test_ep_layerwise import SEED

import matrixopt.train.trainer as trainer
from matrixopt.train.config import TrainConfig, from_dict


@pytest.fixture(scope="session")
def ep_single(tmp_path_factory) -> Path:
    """One process's runs of the expert-parallel configs at ``SEED`` (one folder per optimizer of ``RTOL``), which
    the layer-wise and the FSDP2 runs must reproduce."""
    out = tmp_path_factory.mktemp("ep-single")
    for name in RTOL:
        trainer.train(from_dict(TrainConfig, config(name, seed=SEED)), out / name, progress=False)
    return out
