"""The cluster tests' simulated cluster: a head without a measurement slot and two nodes with one each, every node
with its own rlflow cache and the driver with one of its own (`rlflow.cluster.simulated`), started once for the session."""
from __future__ import annotations

import os

import pytest

# the world model's tiny model, for training on the cluster
from tests.worldmodel.conftest import tiny_model  # noqa: F401


@pytest.fixture(scope="session")
def two_nodes(tmp_path_factory):
    ray = pytest.importorskip("ray")
    from rlflow.cluster.simulated import simulated_cluster

    root = tmp_path_factory.mktemp("cluster")
    before = os.environ.get("RLFLOW_CACHE")
    with simulated_cluster(2, root) as cluster:
        os.environ["RLFLOW_CACHE"] = str(root / "driver")
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        try:
            yield cluster
        finally:
            ray.shutdown()
            os.environ["RLFLOW_CACHE"] = before
