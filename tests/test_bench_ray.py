"""`rlflow bench --ray`: the same rows as a local run, one model per task, and a dead worker costs one model at most.

The cluster is a local Ray instance (2 CPUs, one measurement slot), started once for the module.
"""
from __future__ import annotations

import os

import pytest

from rlflow.bench.run import BenchConfig, run_bench
from tests.conftest import save

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster():
    """One local Ray instance for the module, with the measurement slot `rlflow bench --ray` asks for."""
    from rlflow.bench.cluster import MEASUREMENT_SLOT

    ray.init(num_cpus=2, resources={MEASUREMENT_SLOT: 1}, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture
def models(tmp_path):
    """Two -tiny zoo models and an MLP (the one the worker-killing tasks pick on)."""
    from rlflow import zoo

    folder = tmp_path / "models"
    paths = [zoo.build(name, folder).path for name in ("resnet-18-tiny", "bert-base-tiny")]
    return sorted(paths)


@pytest.fixture
def mlp_and_cnn(tmp_path, matmul_model, cnn_opset9_ir3_path):
    folder = tmp_path / "models"
    folder.mkdir()
    save(matmul_model, folder / "mlp.onnx")
    (folder / "cnn.onnx").write_bytes(open(cnn_opset9_ir3_path, "rb").read())
    return sorted(folder.glob("*.onnx"))


def _kinds(results) -> list[tuple[str, str, str]]:
    """What does not depend on timing: which (model, method) rows there are, and their status."""
    return sorted((r["model"], r["method"], r["status"]) for r in results["rows"])


def test_a_ray_run_gives_the_rows_of_a_local_run(cluster, models, tmp_path):
    from rlflow.bench.cluster import run_on_ray

    config = BenchConfig(methods=("greedy", "random"), time_limit=1, rounds=3)
    here = run_bench(models, config, tmp_path / "here", progress=False)
    there = run_on_ray(models, BenchConfig(**{**config.__dict__, "ray": "local"}), tmp_path / "ray", progress=False)
    assert _kinds(there) == _kinds(here) and all(status == "ok" for *_, status in _kinds(there))
    assert there["complete"] and there["config"]["ray"] == "local"
    assert all(r["node"] for r in there["rows"])  # the machine each row ran on
    assert (tmp_path / "ray" / "results.md").exists()


def _dies_once(model, config, settings):
    """A task whose worker process is killed the first time it runs on the MLP (a marker file remembers)."""
    from rlflow.bench.cluster import _measure_model

    marker = os.environ["RLFLOW_TEST_MARKER"]
    if model.endswith("mlp.onnx") and not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(1)
    return _measure_model(model, config, settings)


def _always_dies(model, config, settings):
    from rlflow.bench.cluster import _measure_model

    if model.endswith("mlp.onnx"):
        os._exit(1)
    return _measure_model(model, config, settings)


@pytest.mark.parametrize("task, mlp_status", [(_dies_once, "ok"), (_always_dies, "failed")])
def test_a_killed_worker_is_retried_once_and_never_harms_the_other_models(cluster, mlp_and_cnn, tmp_path,
                                                                          monkeypatch, task, mlp_status):
    import sys

    from rlflow.bench import cluster as bench_ray
    from rlflow.measure.session import SessionSettings

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import the tests package
    monkeypatch.setenv("RLFLOW_TEST_MARKER", str(tmp_path / "died"))
    ray.shutdown()  # the workers must see the marker's environment variable
    ray.init(num_cpus=2, resources={bench_ray.MEASUREMENT_SLOT: 1}, include_dashboard=False, log_to_driver=False,
             configure_logging=False, runtime_env={"env_vars": {"RLFLOW_TEST_MARKER": str(tmp_path / "died")}})
    config = BenchConfig(methods=("greedy",), time_limit=1, rounds=3, ray="local")
    rows = [row for _, run in bench_ray.bench_on_ray(mlp_and_cnn, config, SessionSettings(), task=task)
            for row in run.rows]
    by_model = {row.model: row for row in rows}
    assert by_model["cnn"].status == "ok", by_model["cnn"].error
    assert by_model["mlp"].status == mlp_status
    if mlp_status == "failed":
        assert by_model["mlp"].error.startswith("ray: ")


def test_without_ray_nothing_of_ray_is_imported():
    import subprocess
    import sys

    code = "import sys, rlflow.bench.run, rlflow.cli, rlflow.optimize.pipeline; print('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
