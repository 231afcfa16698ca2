"""Fixtures of the controller tests: two -tiny zoo models of different sizes and a private cost-model table (and the
world model's, for the tests of its training)."""
from __future__ import annotations

import pytest

# the world model's fixtures, for the tests of its training (test_wm_train.py)
from tests.worldmodel.conftest import tiny_model, wm_cost_model  # noqa: F401


@pytest.fixture(scope="session")
def zoo_paths(tmp_path_factory) -> dict[str, str]:
    """resnet-18-tiny (a CNN) and bert-base-tiny (a transformer), built into a temporary folder."""
    from rlflow import zoo

    out = tmp_path_factory.mktemp("zoo")
    return {name: str(zoo.build(name, out).path) for name in ("resnet-18-tiny", "bert-base-tiny")}


@pytest.fixture(scope="session")
def cost_model(tmp_path_factory):
    from rlflow.measure.costmodel.model import CostModel

    return CostModel(cache_dir=tmp_path_factory.mktemp("costmodel"))
