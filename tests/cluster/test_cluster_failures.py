"""A simulated cluster that loses a node mid-run (slow: `make fuzz`): the node's running task is retried elsewhere,
and nothing else is lost.  The cluster is `rlflow.cluster.simulated`'s; models: the mlp_and_cnn fixture's."""
from __future__ import annotations

import os
import time

import pytest

from rlflow.bench.run import BenchConfig

ray = pytest.importorskip("ray")


def _stalls_first_time(job, config, settings, tables):
    """A task that, the first time it runs on the MLP, says where it runs and waits to be removed with its node."""
    from rlflow.bench.cluster import measure_model

    marker = os.path.join(os.environ["RLFLOW_TEST_MARKER_DIR"], "running")
    if job.name == "mlp" and not os.path.exists(marker):
        with open(marker + ".tmp", "w") as f:
            f.write(ray.get_runtime_context().get_node_id())
        os.replace(marker + ".tmp", marker)
        time.sleep(300)
    return measure_model(job, config, settings, tables)


@pytest.mark.slow
def test_a_removed_node_costs_its_running_task_only_which_is_retried(tmp_path, mlp_and_cnn, monkeypatch):
    import sys
    import threading

    from rlflow.bench import cluster as bench_ray
    from rlflow.cluster.simulated import simulated_cluster
    from rlflow.measure.session import SessionSettings

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    monkeypatch.setenv("RLFLOW_TEST_MARKER_DIR", str(tmp_path))  # the nodes inherit it
    with simulated_cluster(3, tmp_path / "nodes") as cluster:
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        try:
            marker = tmp_path / "running"

            def remove_the_stalled_node():
                while not marker.exists():
                    time.sleep(0.2)
                cluster.remove(cluster.node_of(marker.read_text()))

            remover = threading.Thread(target=remove_the_stalled_node, daemon=True)
            remover.start()
            config = BenchConfig(methods=("greedy",), time_limit=1, rounds=3, ray=cluster.address)
            rows = [row for _, run in bench_ray.bench_on_ray(mlp_and_cnn, config, SessionSettings(),
                                                            task=_stalls_first_time) for row in run.rows]
            remover.join(timeout=60)
        finally:
            ray.shutdown()
    assert sorted((r.model, r.status) for r in rows) == [("cnn", "ok"), ("mlp", "ok")]
    assert len(cluster.nodes) == 2
