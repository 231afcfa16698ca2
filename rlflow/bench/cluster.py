"""`rlflow bench --ray`: each model is one task on a Ray cluster, with all its methods and peers.

Timings must never share a machine's cores, so a task asks for the custom resource MEASUREMENT_SLOT, of which each
node offers one (`ray start ... --resources '{"rlflow_measurement": 1}'`; a local cluster started here gets it).  The
model is the natural cell: its cost table is filled before its methods run, on the node that measures them.  A task
whose worker dies is retried once (Ray places the retry wherever a slot is free); after that its model's rows say it
failed and why, and the other models are unharmed.  Rows come back as tasks finish, so `run_bench` writes results
as it goes; Ctrl-C cancels what is left and keeps them.  `run_on_ray` is the entry point; `rlflow.bench.run` never
imports this module.

Nothing here is imported without `--ray`: one machine needs no cluster.
"""
from __future__ import annotations

import logging
import platform
from pathlib import Path
from typing import Callable, Iterator, Sequence

from rlflow.bench.machine import measure_peak
from rlflow.bench.peers import PEERS
from rlflow.bench.results import Row
from rlflow.bench.run import BenchConfig, ModelBench, bench_model, run_bench
from rlflow.errors import RlflowError
from rlflow.measure.session import SessionSettings

log = logging.getLogger("rlflow")

MEASUREMENT_SLOT = "rlflow_measurement"
"""The custom resource a node offers once, so that no two models are measured on one machine at a time."""

RETRIES = 1
"""Times a model's task is retried after its worker died."""


def run_on_ray(models: Sequence[Path], config: BenchConfig, out_dir, progress: bool = True) -> dict:
    """`run_bench` with each model a task on the Ray cluster `config.ray` names (`local`: one started here)."""
    return run_bench(models, config, out_dir, progress, schedule=bench_on_ray)


def _measure_model(model: str, config: BenchConfig, settings: SessionSettings) -> ModelBench:
    """The task: the model benched on whatever node holds the slot, against that node's own matmul peak."""
    return bench_model(Path(model), config, settings, measure_peak(settings))


def bench_on_ray(models: Sequence[Path], config: BenchConfig, settings: SessionSettings,
                 task: Callable[[str, BenchConfig, SessionSettings], ModelBench] = _measure_model,
                 ) -> Iterator[tuple[Path, ModelBench]]:
    """(model, its bench) as each task finishes, on the cluster `config.ray` names (`local`: one started here).

    `task` is what runs per model (tests replace it to kill a worker).

    Raises:
        RlflowError: Ray is not installed, or the cluster cannot be reached.
    """
    try:
        import ray
    except ImportError:
        raise RlflowError("--ray needs Ray: pip install 'rlflow[ray]'") from None
    started_here = not ray.is_initialized()
    if started_here:
        _connect(ray, config.ray)
    if not ray.cluster_resources().get(MEASUREMENT_SLOT):
        raise RlflowError(f"no node of the Ray cluster offers a measurement slot: start each node with "
                          f"ray start ... --resources '{{\"{MEASUREMENT_SLOT}\": 1}}'")
    remote = ray.remote(num_cpus=0, resources={MEASUREMENT_SLOT: 1}, max_retries=RETRIES)(task)
    pending = {remote.remote(str(Path(m).resolve()), config, settings): Path(m) for m in models}
    try:
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                model = pending.pop(ref)
                try:
                    yield model, ray.get(ref)
                except ray.exceptions.RayError as exc:  # the worker died twice, or the task raised
                    yield model, _failed(model, config, exc)
    finally:
        for ref in pending:  # Ctrl-C, or the caller stopped reading
            ray.cancel(ref, force=True)
        if started_here:
            ray.shutdown()


def _connect(ray, address: str) -> None:
    try:
        if address == "local":
            ray.init(resources={MEASUREMENT_SLOT: 1}, include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
        else:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
    except Exception as exc:  # noqa: BLE001 - Ray raises ConnectionError, RuntimeError and its own types
        raise RlflowError(f"cannot reach the Ray cluster at '{address}': {str(exc).splitlines()[0][:200]}") from None


def _failed(model: Path, config: BenchConfig, exc: Exception) -> ModelBench:
    reason = f"ray: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
    methods = (*config.methods, *(PEERS if config.peers else ()))
    return ModelBench([Row(model.stem, method, "failed", reason, node=platform.node()) for method in methods],
                      loaded=False)
