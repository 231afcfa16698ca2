"""`rlflow bench --ray`: each model is one task on a Ray cluster, with all its methods and peers.

A task holds its node's measurement slot (`rlflow.cluster.connection`), so no two models are timed on one machine at
once.  The model is the natural cell: its cost table is filled before its methods run, on the node that measures
them.  Nothing needs a shared disk (`rlflow.cluster.travel`): each model travels as bytes with its task (refused
before submission when it does not fit the object store, unless `--shared-path`), and so does an `--agent`
checkpoint; the task writes them into a folder of its own, installs the driver's cost tables of its node's kind,
and sends back its rows and what it added to its node's tables, which the driver merges into its own cache.  A task
whose worker or node dies is retried once (Ray places the retry wherever a slot is free); after that its model's rows
say it failed and why, and the other models are unharmed.  Rows come back as tasks finish, so `run_bench` writes
results as it goes; Ctrl-C cancels what is left and keeps them.  `run_on_ray` is the entry point; `rlflow.bench.run`
never imports this module.

Nothing here is imported without `--ray`: one machine needs no cluster.
"""
from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, Sequence

from rlflow.bench.machine import measure_peak
from rlflow.bench.results import Row
from rlflow.bench.run import BenchConfig, ModelBench, bench_model, run_bench
from rlflow.cluster.connection import MEASUREMENT_SLOT, RETRIES, connected, node_label
from rlflow.cluster.travel import (
    TableMerger,
    check_fits,
    pack_file,
    pack_model,
    ship_tables,
    store_capacity,
    tables_home,
    travel_size,
)
from rlflow.measure.memory import release_freed_memory
from rlflow.measure.session import SessionSettings

log = logging.getLogger("rlflow")


@dataclass
class Job:
    """One model's task: object references to the model's `Parcel` (its bytes, put as soon as packed) and to the
    agent checkpoint's (put once for every job), or the model's path when every node reads it (`--shared-path`)."""

    name: str
    parcel: object = None
    path: str | None = None
    agent: object = None

    def materialize(self, folder: Path, config: BenchConfig) -> tuple[Path, BenchConfig]:
        """The model's path on this node and the config its bench runs with (`agent` pointing at the copy here)."""
        import ray

        if self.agent is not None:
            config = replace(config, agent=str(ray.get(self.agent).unpack(folder / "agent")))
        model = ray.get(self.parcel).unpack(folder / "model") if self.parcel is not None else Path(self.path)
        return model, config


def run_on_ray(models: Sequence[Path], config: BenchConfig, out_dir, progress: bool = True) -> dict:
    """`run_bench` with each model a task on the Ray cluster `config.ray` names (`local`: one started here)."""
    return run_bench(models, config, out_dir, progress, schedule=bench_on_ray)


def measure_model(job: Job, config: BenchConfig, settings: SessionSettings, tables: dict) -> tuple[ModelBench, dict]:
    """The task: the model benched in a folder of its own on whatever node holds the slot, against that node's own
    matmul peak; returns its bench and what it added to the node's cost tables."""
    import ray

    node = node_label()
    with tempfile.TemporaryDirectory(prefix="rlflow-task-") as folder, tables_home(ray, tables) as home:
        model, config = job.materialize(Path(folder), config)
        run = bench_model(model, config, settings, measure_peak(settings))
    release_freed_memory()  # a worker process serves task after task, as a bench over a zoo does
    for row in run.rows:
        row.node = node
    return run, {"node": node, **home}


def bench_on_ray(models: Sequence[Path], config: BenchConfig, settings: SessionSettings,
                 task: Callable[[Job, BenchConfig, SessionSettings, dict], tuple[ModelBench, dict]] = measure_model,
                 ) -> Iterator[tuple[Path, ModelBench]]:
    """(model, its bench) as each task finishes, on the cluster `config.ray` names (`local`: one started here).

    `task` is what runs per model (tests replace it to kill a worker or a node).

    Raises:
        RlflowError: Ray is not installed, the cluster cannot be reached, no node offers a measurement slot, or a
            model does not fit the object store.
    """
    with connected(config.ray) as ray:
        jobs = _jobs(ray, models, config)
        merger = TableMerger()
        tables = ship_tables(ray)
        remote = ray.remote(num_cpus=0, resources={MEASUREMENT_SLOT: 1}, max_retries=RETRIES,
                            retry_exceptions=False)(task)
        pending = {remote.remote(job, config, settings, tables): Path(model) for job, model in zip(jobs, models)}
        try:
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                for ref in done:
                    model = pending.pop(ref)
                    try:
                        run, home = ray.get(ref)
                    except ray.exceptions.RayError as exc:  # the worker or its node died twice, or the task raised
                        yield model, _failed(model, config, exc)
                        continue
                    merger.merge(home["node"], home)
                    run.cost_tables = merger.summary()
                    yield model, run
        finally:
            for ref in pending:  # Ctrl-C, or the caller stopped reading
                ray.cancel(ref, force=True)


def _jobs(ray, models: Sequence[Path], config: BenchConfig) -> list[Job]:
    """Each model's job, its bytes put into the object store as soon as packed (so the driver never holds them all),
    after every model has been checked against the store's size (nothing to put with `--shared-path`)."""
    if config.shared_path:
        return [Job(Path(m).stem, path=str(Path(m).resolve())) for m in models]
    sizes = {Path(m).name: travel_size(m) for m in models}
    if config.agent:
        sizes[Path(config.agent).name] = travel_size(config.agent, model=False)
    check_fits(sizes, store_capacity(ray))
    agent_ref = ray.put(pack_file(config.agent)) if config.agent else None
    return [Job(Path(m).stem, parcel=ray.put(pack_model(m)), agent=agent_ref) for m in models]


def _failed(model: Path, config: BenchConfig, exc: Exception) -> ModelBench:
    reason = f"ray: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
    methods = (*config.methods, *config.peers)
    return ModelBench([Row(model.stem, method, "failed", reason, node="") for method in methods], loaded=False)
