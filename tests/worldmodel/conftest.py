"""Fixtures of the world-model tests: a tiny zoo model and a private cost-model table."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """resnet-18-tiny, built into a temporary folder."""
    from rlflow import zoo

    return str(zoo.build("resnet-18-tiny", tmp_path_factory.mktemp("zoo")).path)


@pytest.fixture(scope="session")
def wm_cost_model(tmp_path_factory):
    from rlflow.measure.costmodel.model import CostModel

    return CostModel(cache_dir=tmp_path_factory.mktemp("costmodel"))
