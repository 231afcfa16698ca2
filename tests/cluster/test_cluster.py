"""`--ray` on several nodes without a shared disk: models travel with their tasks, cost tables come home and merge
(a node lost mid-run: tests/test_cluster_failures.py).

The cluster is simulated on this machine (`rlflow.cluster.simulated`): a head without a measurement slot and nodes
with one each, every node with its own rlflow cache; the driver has a cache of its own too.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from rlflow.bench.run import BenchConfig

ray = pytest.importorskip("ray")


def _kinds(results) -> list[tuple[str, str, str]]:
    return sorted((r["model"], r["method"], r["status"]) for r in results["rows"])


def _removed_after_packing(monkeypatch):
    """Every run's model files are deleted once the driver has packed them, before any task runs."""
    from rlflow.bench import cluster as bench_ray

    packed = bench_ray._jobs

    def jobs_then_remove(ray, models, config):
        jobs = packed(ray, models, config)
        for model in models:
            model.unlink()
        return jobs

    monkeypatch.setattr(bench_ray, "_jobs", jobs_then_remove)


def _costs(cache) -> int:
    return sum(len(json.loads(p.read_text())["costs"]) for p in cache.glob("costmodel-*.json"))


def test_models_travel_and_cost_tables_come_home(two_nodes, mlp_and_cnn, tmp_path, monkeypatch):
    from rlflow.bench.cluster import run_on_ray

    config = BenchConfig(methods=("greedy",), time_limit=1, rounds=3)
    here = [("cnn", "greedy", "ok"), ("mlp", "greedy", "ok")]  # as a run here (tests/cluster/test_bench_ray.py)
    copies = tmp_path / "copies"
    shutil.copytree(mlp_and_cnn[0].parent, copies)
    _removed_after_packing(monkeypatch)
    first = run_on_ray(mlp_and_cnn, BenchConfig(**{**config.__dict__, "ray": two_nodes.address}), tmp_path / "ray",
                       progress=False)
    assert not any(m.exists() for m in mlp_and_cnn)
    assert _kinds(first) == here
    tables = first["cost_tables"]
    assert tables["added"] > 0 and tables["known_before"] == 0
    assert _costs(Path(tables["cache"])) >= tables["added"]  # merged into the driver's own cache
    assert sum(n["tasks"] for n in tables["per_node"].values()) == 2

    # a second run: every node starts from the merged table, so no group measured before is measured again
    again = sorted(copies.glob("*.onnx"))
    second = run_on_ray(again, BenchConfig(**{**config.__dict__, "ray": two_nodes.address}), tmp_path / "ray2",
                        progress=False)
    assert not any(m.exists() for m in again) and _kinds(second) == here
    assert second["cost_tables"]["known_before"] == 0
    assert sum(n["installed"] for n in second["cost_tables"]["per_node"].values()) > 0


def test_a_model_too_big_for_the_object_store_is_refused_before_submission(two_nodes, mlp_and_cnn, monkeypatch):
    from rlflow.bench import cluster as bench_ray
    from rlflow.errors import RlflowError
    from rlflow.measure.session import SessionSettings

    monkeypatch.setattr(bench_ray, "store_capacity", lambda ray: 100)
    config = BenchConfig(methods=("greedy",), time_limit=1, rounds=3, ray=two_nodes.address)
    with pytest.raises(RlflowError, match=r"does not fit Ray's object store .*--shared-path"):
        next(bench_ray.bench_on_ray(mlp_and_cnn, config, SessionSettings()))
    shared = BenchConfig(**{**config.__dict__, "shared_path": True})  # every node reads the paths: nothing shipped
    assert len(list(bench_ray.bench_on_ray(mlp_and_cnn[:1], shared, SessionSettings()))) == 1


def _killing(marker, always: bool):
    """A task that kills its worker process on the MLP: the first time only (a marker file remembers), or always."""

    def task(job, config, settings, tables):
        from rlflow.bench.cluster import measure_model

        if job.name == "mlp" and (always or not os.path.exists(marker)):
            open(marker, "w").close()
            os._exit(1)
        return measure_model(job, config, settings, tables)

    return task


@pytest.mark.parametrize("always, mlp_status", [(False, "ok"), (True, "failed")])
def test_a_killed_worker_is_retried_once_and_never_harms_the_other_models(two_nodes, mlp_and_cnn, tmp_path,
                                                                          always, mlp_status):
    import sys

    from rlflow.bench import cluster as bench_ray
    from rlflow.measure.session import SessionSettings

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import the tests package
    config = BenchConfig(methods=("greedy",), time_limit=1, rounds=3, ray=two_nodes.address)
    task = _killing(str(tmp_path / "died"), always)
    rows = [row for _, run in bench_ray.bench_on_ray(mlp_and_cnn, config, SessionSettings(), task=task)
            for row in run.rows]
    by_model = {row.model: row for row in rows}
    assert by_model["cnn"].status == "ok", by_model["cnn"].error
    assert by_model["mlp"].status == mlp_status
    if mlp_status == "failed":
        assert by_model["mlp"].error.startswith("ray: ")
