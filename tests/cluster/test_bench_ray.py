"""`rlflow bench --ray` on a Ray instance this run starts (`--ray` without an address): every row, and (slow) the
same rows as a run here on -tiny zoo models.

Several nodes without a shared disk, and killed workers: tests/test_cluster.py.
"""
from __future__ import annotations

import pytest

from rlflow.bench.run import BenchConfig, run_bench

ray = pytest.importorskip("ray")


def _kinds(results) -> list[tuple[str, str, str]]:
    """What does not depend on timing: which (model, method) rows there are, and their status."""
    return sorted((r["model"], r["method"], r["status"]) for r in results["rows"])


def _same_rows_here_and_on_a_local_instance(models, methods, tmp_path):
    from rlflow.bench.cluster import run_on_ray

    config = BenchConfig(methods=methods, time_limit=1, rounds=3)
    here = run_bench(models, config, tmp_path / "here", progress=False)
    there = run_on_ray(models, BenchConfig(**{**config.__dict__, "ray": "local"}), tmp_path / "ray", progress=False)
    assert _kinds(there) == _kinds(here) and all(status == "ok" for *_, status in _kinds(there))
    assert there["complete"] and there["config"]["ray"] == "local"
    assert all(r["node"] for r in there["rows"])  # the machine each row ran on
    assert (tmp_path / "ray" / "results.md").exists()
    assert not ray.is_initialized()  # the instance the run started is stopped


def test_a_local_ray_run_gives_every_row_and_stops_the_instance_it_started(mlp_and_cnn, tmp_path):
    from rlflow.bench.cluster import run_on_ray

    config = BenchConfig(methods=("greedy",), time_limit=1, rounds=3, ray="local")
    results = run_on_ray(mlp_and_cnn[1:], config, tmp_path / "ray", progress=False)  # the MLP
    assert _kinds(results) == [("mlp", "greedy", "ok")] and results["complete"]
    assert results["rows"][0]["node"] and (tmp_path / "ray" / "results.md").exists()
    assert not ray.is_initialized()


@pytest.mark.slow
def test_a_local_ray_run_gives_the_rows_of_a_run_here_on_tiny_zoo_models(tmp_path):
    from rlflow import zoo

    models = sorted(zoo.build(name, tmp_path / "models").path for name in ("resnet-18-tiny", "bert-base-tiny"))
    _same_rows_here_and_on_a_local_instance(models, ("greedy", "random"), tmp_path)


def test_without_ray_nothing_of_ray_is_imported():
    import subprocess
    import sys

    code = ("import sys, rlflow.bench.run, rlflow.cli, rlflow.optimize.pipeline, rlflow.train.ppo, "
            "rlflow.train.worldmodel.loop; print('ray' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_an_address_where_nothing_listens_is_one_line_at_once(mlp_and_cnn, tmp_path):
    from rlflow.bench.cluster import run_on_ray
    from rlflow.errors import RlflowError

    with pytest.raises(RlflowError, match=r"cannot reach the Ray cluster at '127\.0\.0\.1:1': "):
        run_on_ray(mlp_and_cnn, BenchConfig(methods=("greedy",), ray="127.0.0.1:1"), tmp_path / "out", progress=False)
    assert not ray.is_initialized()
