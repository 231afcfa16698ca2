"""A simulated cluster that loses a node mid-run (slow: `make fuzz`): the node's running task is retried elsewhere,
and nothing else is lost.  The cluster is the session's (tests/cluster/conftest.py), with a third node added; models: the mlp_and_cnn fixture's."""
from __future__ import annotations

import os
import time

import pytest

from rlflow.bench.run import BenchConfig

ray = pytest.importorskip("ray")


def _stalls_first_time(marker: str):
    """A task that, the first time it runs on the MLP, says where it runs and waits to be removed with its node."""

    def task(job, config, settings, tables):
        from rlflow.bench.cluster import measure_model

        if job.name == "mlp" and not os.path.exists(marker):
            with open(marker + ".tmp", "w") as f:
                f.write(ray.get_runtime_context().get_node_id())
            os.replace(marker + ".tmp", marker)
            time.sleep(300)
        return measure_model(job, config, settings, tables)

    return task


@pytest.mark.slow
def test_a_removed_node_costs_its_running_task_only_which_is_retried(two_nodes, tmp_path, mlp_and_cnn):
    import sys
    import threading

    from rlflow.bench import cluster as bench_ray
    from rlflow.measure.session import SessionSettings

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    two_nodes.add_node()  # three nodes: one is lost
    marker = tmp_path / "running"

    def remove_the_stalled_node():
        while not marker.exists():
            time.sleep(0.2)
        two_nodes.remove(two_nodes.node_of(marker.read_text()))

    remover = threading.Thread(target=remove_the_stalled_node, daemon=True)
    remover.start()
    config = BenchConfig(methods=("greedy",), time_limit=1, rounds=3, ray=two_nodes.address)
    rows = [row for _, run in bench_ray.bench_on_ray(mlp_and_cnn, config, SessionSettings(),
                                                    task=_stalls_first_time(str(marker))) for row in run.rows]
    remover.join(timeout=60)
    assert sorted((r.model, r.status) for r in rows) == [("cnn", "ok"), ("mlp", "ok")]
    assert len(two_nodes.nodes) == 2 and marker.exists()
