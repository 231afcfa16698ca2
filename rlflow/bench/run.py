"""Batch benchmarking: every method (and peer tool) on every model, measured the same way.

Each row is one model under one method: the method's output measured interleaved against the input in one process
(speedup with its bootstrap interval), verified on random data, with its optimisation time; the methods' outputs of a
model are measured together (`rlflow.bench.method_rows`), each peer's against the input on its own.  A model that
fails under one method is reported as failed in that row and the run goes on.  The rows and the files written from
them (results.json with every setting recorded, results.csv, results.md and two plots) are `rlflow.bench.results`;
the machine's peak and versions are `rlflow.bench.machine`.
"""
from __future__ import annotations

import logging
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Sequence

import onnx
from tqdm import tqdm

from rlflow.bench.builder_reference import bench_references, bench_row
from rlflow.bench.machine import environment, measure_peak
from rlflow.bench.method_rows import Measured, device_errors, failed_row, measure_outputs, measurement_seed, method_rows
from rlflow.bench.peers import NotApplicable, peer_settings, run_peer, zoo_hints
from rlflow.bench.results import Row, summarize, write_results
from rlflow.errors import RlflowError
from rlflow.files import cache_dir
from rlflow.graph.core import Graph
from rlflow.graph.flops import count_bytes_read, count_flops, count_params
from rlflow.graph.model_file import max_ir_version
from rlflow.measure.memory import release_freed_memory, shares_weights
from rlflow.measure.session import SessionSettings, check_capture, resolve_provider
from rlflow.measure.shape_profiles import load_profiled, parse_profile
from rlflow.measure.timing import compare
from rlflow.measure.verify import verify
from rlflow.optimize.options import METHODS
from rlflow.optimize.pipeline import verification_shapes
from rlflow.train.ship import is_held_out

log = logging.getLogger("rlflow")


@dataclass
class BenchConfig:
    """Settings of a benchmark run, all recorded in results.json.

    Attributes:
        methods: rlflow search methods to run on every model.
        peers: the peer tools to run too, by name (`rlflow.bench.peers.PEERS`), those installed.
        references: also time onnxruntime-genai's builder's graph of a zoo decoder (`rlflow.bench.builder_reference`),
            when its venv exists.
        provider: execution provider (`auto`, `cpu`, `cuda`).
        threads: onnxruntime intra-op threads.
        time_limit: seconds of search per model and method (None: each method's default,
            `rlflow.optimize.options.DEFAULT_TIME_LIMITS`).
        rounds: interleaved rounds of the bench's own input-vs-output measurements (optimize()'s gate runs with its
            default plan, as a user's run does).
        seed: random inputs and measurement order.
        agent: method agent's checkpoint (None: the shipped agent).
        profiles: shape profiles in the `--profile` syntax (`rlflow.measure.shape_profiles`), each model measured at
            all of them (none: at the shapes it loads with), the peers' outputs as rlflow's.
        ray: for `rlflow.bench.cluster.run_on_ray`, the Ray cluster each model runs on as one task: `local` starts one
            on this machine, anything else is the address of a running cluster (`auto`, `ray://host:10001`); None for
            a run here, without Ray.
        shared_path: on a cluster, every node reads the models (and `agent`) at their paths: nothing is shipped.
        cuda_graph: CUDA only: every measurement runs the models as captured CUDA graphs (`SessionSettings`).
        fix_dims: symbolic input dimensions fixed in every model before anything runs on it (`--fix-dim`), so the
            methods, the peers and the input they are compared with all have them fixed.
        fix_values: inputs whose every element is declared one value (`--fix-value`), read so by every model alike.
        control: also measure a copy of the input with the methods' outputs (`--control`,
            `rlflow.bench.method_rows.CONTROL`): the row that says what a figure on the model can be told apart from.
    """

    methods: tuple[str, ...] = ("agent", "greedy", "taso", "random")
    peers: tuple[str, ...] = ()
    references: bool = False
    provider: str = "auto"
    threads: int = 1
    time_limit: float | None = None
    rounds: int = 30
    seed: int = 0
    agent: str | None = None
    profiles: tuple[str, ...] = ()
    ray: str | None = None
    shared_path: bool = False
    cuda_graph: bool = False
    fix_dims: dict[str, int] | None = None
    fix_values: dict[str, float] | None = None
    control: bool = False


def find_models(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """ONNX files named directly or found (not recursively) in folders; rlflow's own outputs are skipped."""
    models = []
    for path in map(Path, paths):
        if path.is_dir():
            models += sorted(p for p in path.glob("*.onnx") if not p.name.endswith(".rlflow.onnx"))
        elif path.exists():
            models.append(path)
        else:
            raise RlflowError(f"{path}: no such file or folder")
    if not models:
        raise RlflowError("no .onnx models found in " + ", ".join(map(str, paths)))
    return models


Schedule = Callable[[Sequence[Path], "BenchConfig", SessionSettings], Iterable[tuple[Path, "ModelBench"]]]
"""Runs `bench_model` on every model somewhere and yields (model, its bench) as each finishes."""


def run_bench(models: Sequence[Path], config: BenchConfig, out_dir: str | os.PathLike, progress: bool = True,
              schedule: Schedule | None = None) -> dict:
    """Benchmarks every model under every method (and peer); writes and returns the results.

    Results are written after every model, so an interrupted run keeps what it measured (`complete` says whether it
    finished).  `schedule`: where the models run (default: here, one after the other; `rlflow.bench.cluster.run_on_ray`
    passes one that runs each model as a task on a Ray cluster).
    """
    unknown = [m for m in config.methods if m not in METHODS]
    if unknown:
        raise RlflowError(f"unknown method(s) {', '.join(unknown)}: choose from {', '.join(METHODS)}")
    provider = resolve_provider(config.provider)
    check_capture(provider, config.cuda_graph)
    settings = SessionSettings(provider=provider, threads=config.threads, cuda_graph=config.cuda_graph)
    peak = measure_peak(settings)
    runs_per_model = len(config.methods) + len(config.peers) + config.control
    rows: list[Row] = []
    warmups: dict[str, float | None] = {}
    tables: dict | None = None
    started = time.monotonic()
    if schedule is not None:
        finished = schedule(models, config, settings)
    else:
        finished = ((model, bench_model(model, config, settings, peak)) for model in models)
    with tqdm(total=len(models) * runs_per_model, desc="bench", unit="run", disable=not progress) as bar:
        try:
            for model, run in finished:
                rows += run.rows
                release_freed_memory()  # the next model's searches start from a heap the last one left scattered
                if run.loaded:
                    warmups[model.stem] = run.warmup_seconds
                tables = run.cost_tables or tables
                bar.total += len(run.rows) - runs_per_model  # a decoder's builder row; a model that failed to load
                bar.update(len(run.rows))
                bar.set_postfix_str(model.stem)
                write_results(_results(config, settings, peak, started, rows, warmups, tables, complete=False),
                              Path(out_dir))
        except KeyboardInterrupt:
            log.warning("interrupted: the rows of %d models are kept in %s", len({r.model for r in rows}), out_dir)
            raise
    results = _results(config, settings, peak, started, rows, warmups, tables, complete=True)
    write_results(results, Path(out_dir))
    return results


@dataclass
class ModelBench:
    """One model's rows, whether it loaded, the seconds its cost-table warm-up took (None: not done), and on a cluster
    the cost tables' travel so far (`rlflow.cluster.travel.TableMerger.summary`)."""

    rows: list[Row]
    loaded: bool = True
    warmup_seconds: float | None = None
    cost_tables: dict | None = None


def bench_model(model: Path, config: BenchConfig, settings: SessionSettings, peak: dict) -> ModelBench:
    """One model under every method and peer of `config`.

    A method that fails gets a failed row; the others still run.  Rows record the machine they ran on.
    """
    # the agent's provenance file (<checkpoint stem>.json beside it) says which models it never trained on
    agent = _agent_path(config, settings)
    agent_meta = (agent.parent, agent.stem)
    node = platform.node()
    try:
        graph = load_profiled(model, [parse_profile(p) for p in config.profiles], config.fix_dims,
                               config.fix_values)
        static = graph.to_model(static=True)
        flops, params, bytes_read = count_flops(static), count_params(static), count_bytes_read(static)
        warmup = warm_cost_table(graph, replace(settings, cuda_graph=False))  # the cost table is not captured
        tool_options = dict(use_gpu=settings.provider == "CUDAExecutionProvider", **zoo_hints(static, model))
        references = bench_references(static, model) if config.references else ()  # the genai builder's, for decoders
    except RlflowError as exc:
        return ModelBench([Row(model.stem, method, "failed", f"load: {exc}", node=node)
                           for method in (*config.methods, *config.peers)], loaded=False)
    settings = _settings_for(graph, settings)
    rows = method_rows(graph, config.methods, settings, config)
    for method in (*config.peers, *references):
        try:
            if method in references:
                rows.append(bench_row(graph, static, settings, config))
            else:
                rows.append(_run_peer(graph, method, tool_options, settings, config))
        except Exception as exc:  # noqa: BLE001 - one failure must not stop the run
            log.debug("%s / %s failed", model.stem, method, exc_info=True)
            rows.append(failed_row(model.stem, method, exc))
    for row in rows:
        row.params, row.flops, row.heldout, row.node = params, flops, is_held_out(model.stem, *agent_meta), node
        row.bytes_read = bytes_read
        if row.status == "ok":
            row.baseline_peak_fraction = flops / (row.baseline_ms * 1e-3) / (peak["gflops"] * 1e9)
            row.peak_fraction = flops / (row.latency_ms * 1e-3) / (peak["gflops"] * 1e9)
            if peak.get("gbs"):
                row.baseline_memory_fraction = bytes_read / (row.baseline_ms * 1e-3) / (peak["gbs"] * 1e9)
                row.memory_fraction = bytes_read / (row.latency_ms * 1e-3) / (peak["gbs"] * 1e9)
    return ModelBench(rows, warmup_seconds=warmup)


def _settings_for(graph: Graph, settings: SessionSettings) -> SessionSettings:
    """The settings with weights shared between sessions where the model's size calls for it, as optimize() does."""
    return replace(settings, share_weights=shares_weights(graph))


def warm_cost_table(graph: Graph, settings: SessionSettings) -> float | None:
    """Fills the cost table for the model's own graph before any method runs on it; returns the seconds it took, or
    None when the cost model cannot take the graph (the methods' own rows then say what fails on it).

    The table is shared on disk, so whichever method ran first on a model would otherwise pay, inside its time limit,
    for measuring the groups every later method then reads for free.  Groups of rewritten graphs are still measured by
    whichever method reaches them first.
    """
    from rlflow.measure.costmodel.model import CostModel

    start = time.monotonic()
    try:
        cost_model = CostModel(settings)
        cost_model.graph_cost(graph)
        cost_model.save()
    except Exception as exc:  # noqa: BLE001 - a warm-up must not stop the run: every method still gets its row
        log.warning("cost table warm-up failed on %s: %s", graph.source or "graph", str(exc).splitlines()[0][:200])
        return None
    return time.monotonic() - start


def _results(config: BenchConfig, settings: SessionSettings, peak: dict, started: float, rows: list[Row],
             warmups: dict[str, float | None], tables: dict | None, complete: bool) -> dict:
    """What results.json holds: the settings, the machine, every row so far and their per-method summary (and on a
    cluster, the cost tables' travel)."""
    records = [asdict(r) for r in rows]
    results = {"config": asdict(config), "agent": _acting_agent(config, settings), "settings": settings.as_dict(),
               "environment": environment(settings),
               "peak": peak, "seconds": time.monotonic() - started, "complete": complete,
               "cost_table_warmup_seconds": warmups, "summary": summarize(records), "rows": records,
               "heldout_from": _heldout_from(config, settings)}
    if tables is not None:
        results["cost_tables"] = tables
    return results


def _agent_path(config: BenchConfig, settings: SessionSettings) -> Path:
    """The checkpoint method agent plays: `--agent`, else the one shipped for the bench's provider."""
    from rlflow.search.agent import shipped_agent

    return Path(config.agent) if config.agent else shipped_agent(settings.provider)


def _heldout_from(config: BenchConfig, settings: SessionSettings) -> str:
    """The agent metadata that says which rows are held out (the checkpoint's JSON, whether or not it acted)."""
    from rlflow.agents.checkpoint import shown_path

    return shown_path(_agent_path(config, settings).with_suffix(".json"))


def _acting_agent(config: BenchConfig, settings: SessionSettings) -> dict | None:
    """The checkpoint method agent played (path and SHA-256), or None when the bench did not run it."""
    if "agent" not in config.methods:
        return None
    from rlflow.agents.checkpoint import checkpoint_identity

    return checkpoint_identity(_agent_path(config, settings))


def _run_peer(graph: Graph, name: str, tool_options: dict, settings: SessionSettings, config: BenchConfig) -> Row:
    """A peer tool on the model (`run_peer`, with `peer_tools`' keywords `tool_options`), checked and measured exactly
    like rlflow's output: with its measurement shapes fixed, or where the bench has several profiles, as the user has
    it (dynamic) and measured at every profile, as rlflow's output must run at all of them (a peer handed the primary
    profile's static model folded its shape computations and was timed at that profile only)."""
    start = time.monotonic()
    model = Path(graph.source or "graph").stem
    profiled = bool(graph.profiles)
    source = graph.to_model(static=not profiled)
    scratch = cache_dir("peers")  # on disk: a large model's peer writes its input and output there, not to /tmp
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rlflow-peer-", dir=scratch) as folder:
        try:
            source, output = run_peer(name, source, folder, **tool_options)
        except ImportError:
            return Row(model, name, "not installed", "pip install 'rlflow[peers]'", "peer")
        except NotApplicable as exc:
            return Row(model, name, "not applicable", str(exc), "peer")
        seconds = time.monotonic() - start
        tool_settings = peer_settings(output)
        restored = _restore_inputs(source, output)
        if restored:
            tool_settings["inputs_restored"] = ", ".join(restored)
        output.ir_version = min(output.ir_version, max_ir_version())
        verification = verify(source, output, seeds=(config.seed, config.seed + 1, config.seed + 2),
                              shapes=verification_shapes(graph)[:1])
        seed = measurement_seed(config.seed, model)
        if profiled:
            (measured,) = measure_outputs(graph, [Graph.from_model(output, dict(graph.input_shapes))], settings,
                                          config.rounds, seed)
        else:
            measured = Measured.of(compare([source, output], settings, rounds=config.rounds, seed=seed))
        device = device_errors(source, output, settings, graph)
    ratio = measured.ratio
    return Row(model, name, "ok" if verification.ok else "wrong output",
               verification.message, "peer", baseline_ms=measured.baseline_ms, latency_ms=measured.latency_ms,
               speedup=ratio.median, speedup_low=ratio.low, speedup_high=ratio.high, faster=ratio.faster,
               rewritten=True, verified=verification.ok, max_rel_error=verification.max_rel_norm, seconds=seconds,
               peer_settings=tool_settings, profiles=measured.per_profile, **device)


def _restore_inputs(source: onnx.ModelProto, output: onnx.ModelProto) -> list[str]:
    """Declares again, unused, the inputs a peer's output dropped (one read for its shape alone, as `--fix-value`
    leaves it, once the peer folds that away), so that it runs on the model's inputs as a user's code feeds them;
    returns their names."""
    kept = {vi.name for vi in output.graph.input}
    dropped = [vi for vi in source.graph.input if vi.name not in kept]
    output.graph.input.extend(dropped)
    return [vi.name for vi in dropped]
