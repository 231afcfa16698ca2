"""Batch benchmarking: every method (and peer tool) on every model, measured the same way.

Each row is one model under one method: the method's output measured interleaved against the input in one process
(speedup with its bootstrap interval), verified on random data, with its optimisation time.  A model that fails under
one method is reported as failed in that row and the run goes on.  Results: results.json (every setting recorded),
results.csv, results.md and two plots.
"""
from __future__ import annotations

import csv
import datetime
import io
import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from tqdm import tqdm

from rlflow.errors import RlflowError
from rlflow.files import write_text_atomic
from rlflow.graph import Graph, load
from rlflow.model_file import max_ir_version, read_model
from rlflow.measure.flops import count_flops, count_params
from rlflow.measure.memory import shares_weights
from rlflow.measure.session import SessionSettings, check_capture, resolve_provider
from rlflow.measure.profiled import compare_profiled
from rlflow.measure.timing import Ratio, compare, time_model
from rlflow.measure.verify import verify
from rlflow.controller.ship import is_held_out
from rlflow.optimize import METHODS, optimize, verification_shapes
from rlflow.peers import PEERS, NotApplicable, peer_settings, peer_tools, zoo_hints
from rlflow.profiles import Profile, arrange, attach, parse_profile

log = logging.getLogger("rlflow")

PEAK_MATMUL_SIZE = 512


@dataclass
class BenchConfig:
    """Settings of a benchmark run, all recorded in results.json.

    Attributes:
        methods: rlflow search methods to run on every model.
        peers: also run the peer tools (`rlflow.peers.PEERS`: onnxsim, onnxoptimizer, onnxslim, the onnxscript
            optimizer, onnxruntime's transformers optimizer) when installed.
        provider: execution provider (`auto`, `cpu`, `cuda`).
        threads: onnxruntime intra-op threads.
        time_limit: seconds of search per model and method (None: each method's default, `DEFAULT_TIME_LIMITS`).
        rounds: interleaved rounds of the bench's own input-vs-output measurements (optimize()'s gate runs with its
            default plan, as a user's run does).
        seed: random inputs and measurement order.
        agent: method agent's checkpoint (None: the shipped agent).
        profiles: shape profiles in the `--profile` syntax (`rlflow.profiles`), each model measured at all of them
            (none: at the shapes it loads with); peers are measured at the first (heaviest) only.
        ray: for `rlflow.bench_ray.run_on_ray`, the Ray cluster each model runs on as one task: `local` starts one
            on this machine, anything else is the address of a running cluster (`auto`, `ray://host:10001`); None for
            a run here, without Ray.
        cuda_graph: CUDA only: every measurement runs the models as captured CUDA graphs (`SessionSettings`).
    """

    methods: tuple[str, ...] = ("agent", "greedy", "taso", "random")
    peers: bool = False
    provider: str = "auto"
    threads: int = 1
    time_limit: float | None = None
    rounds: int = 30
    seed: int = 0
    agent: str | None = None
    profiles: tuple[str, ...] = ()
    ray: str | None = None
    cuda_graph: bool = False


@dataclass
class Row:
    """One model under one method."""

    model: str
    method: str
    status: str
    error: str = ""
    kind: str = "rlflow"
    params: int = 0
    flops: int = 0
    baseline_ms: float = float("nan")
    latency_ms: float = float("nan")
    speedup: float = float("nan")
    speedup_low: float = float("nan")
    speedup_high: float = float("nan")
    faster: bool = False
    rewritten: bool = False
    verified: bool = False
    max_rel_error: float = float("nan")
    seconds: float = float("nan")
    search_seconds: float = float("nan")
    heldout: bool = False
    gate_speedup: float = float("nan")
    reason: str = ""
    outcome: str = ""
    candidates_measured: int = 0
    rewrites: list[str] = field(default_factory=list)
    baseline_peak_fraction: float = float("nan")
    peak_fraction: float = float("nan")
    peer_settings: dict = field(default_factory=dict)  # what a peer ran with (ort-transformers: type, heads, fusions)
    profiles: list[dict] = field(default_factory=list)  # with several profiles: label, weight, speedup, low, high each
    node: str = ""  # the machine it ran on (a Ray run spreads models over several)


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


def measure_peak(settings: SessionSettings, size: int = PEAK_MATMUL_SIZE) -> dict:
    """The machine's matrix-product throughput through onnxruntime (GFLOP/s) with the bench's own settings."""
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((size, size)).astype(np.float32), "W")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "peak",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [size, size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [size, size])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=max_ir_version())
    timing = time_model(model, settings, warmup=3, repeats=20)
    gflops = 2 * size ** 3 / (timing.min_ms * 1e-3) / 1e9
    return {"gflops": gflops, "matmul": [size, size, size], "best_ms": timing.min_ms, "median_ms": timing.median_ms}


def environment(settings: SessionSettings) -> dict:
    """The machine and software versions the results were measured with."""
    import onnxruntime

    from rlflow import __version__

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "onnxruntime": onnxruntime.__version__, "onnx": onnx.__version__, "rlflow": __version__,
            "provider": settings.provider}


Schedule = Callable[[Sequence[Path], "BenchConfig", SessionSettings], Iterable[tuple[Path, "ModelBench"]]]
"""Runs `bench_model` on every model somewhere and yields (model, its bench) as each finishes."""


def run_bench(models: Sequence[Path], config: BenchConfig, out_dir: str | os.PathLike, progress: bool = True,
              schedule: Schedule | None = None) -> dict:
    """Benchmarks every model under every method (and peer); writes and returns the results.

    Results are written after every model, so an interrupted run keeps what it measured (`complete` says whether it
    finished).  `schedule`: where the models run (default: here, one after the other; `rlflow.bench_ray.run_on_ray`
    passes one that runs each model as a task on a Ray cluster).
    """
    unknown = [m for m in config.methods if m not in METHODS]
    if unknown:
        raise RlflowError(f"unknown method(s) {', '.join(unknown)}: choose from {', '.join(METHODS)}")
    provider = resolve_provider(config.provider)
    check_capture(provider, config.cuda_graph)
    settings = SessionSettings(provider=provider, threads=config.threads, cuda_graph=config.cuda_graph)
    peak = measure_peak(settings)
    runs_per_model = len(config.methods) + (len(PEERS) if config.peers else 0)
    rows: list[Row] = []
    warmups: dict[str, float | None] = {}
    started = time.monotonic()
    if schedule is not None:
        finished = schedule(models, config, settings)
    else:
        finished = ((model, bench_model(model, config, settings, peak)) for model in models)
    with tqdm(total=len(models) * runs_per_model, desc="bench", unit="run", disable=not progress) as bar:
        try:
            for model, run in finished:
                rows += run.rows
                if run.loaded:
                    warmups[model.stem] = run.warmup_seconds
                bar.update(len(run.rows))
                bar.set_postfix_str(model.stem)
                write_results(_results(config, settings, peak, started, rows, warmups, complete=False), Path(out_dir))
        except KeyboardInterrupt:
            log.warning("interrupted: the rows of %d models are kept in %s", len({r.model for r in rows}), out_dir)
            raise
    results = _results(config, settings, peak, started, rows, warmups, complete=True)
    write_results(results, Path(out_dir))
    return results


@dataclass
class ModelBench:
    """One model's rows, whether it loaded, and the seconds its cost-table warm-up took (None: not done)."""

    rows: list[Row]
    loaded: bool = True
    warmup_seconds: float | None = None


def bench_model(model: Path, config: BenchConfig, settings: SessionSettings, peak: dict) -> ModelBench:
    """One model under every method and peer of `config`.

    A method that fails gets a failed row; the others still run.  Rows record the machine they ran on.
    """
    peers = PEERS if config.peers else ()
    # the agent's provenance file (<checkpoint stem>.json beside it) says which models it never trained on
    agent_meta = (Path(config.agent).parent, Path(config.agent).stem) if config.agent else ()
    node = platform.node()
    try:
        graph = _load_profiled(model, [parse_profile(p) for p in config.profiles])
        static = graph.to_model(static=True)
        flops, params = count_flops(static), count_params(static)
        warmup = warm_cost_table(graph, replace(settings, cuda_graph=False))  # the cost table is not captured
        tools = peer_tools(use_gpu=settings.provider == "CUDAExecutionProvider", **zoo_hints(static, model))
    except RlflowError as exc:
        return ModelBench([Row(model.stem, method, "failed", f"load: {exc}", node=node)
                           for method in (*config.methods, *peers)], loaded=False)
    rows = []
    settings = _settings_for(graph, settings)
    for method in (*config.methods, *peers):
        try:
            if method in peers:
                row = _run_peer(graph, method, tools[method], settings, config)
            else:
                row = _run_method(graph, method, settings, config)
        except Exception as exc:  # noqa: BLE001 - one failure must not stop the run
            log.debug("%s / %s failed", model.stem, method, exc_info=True)
            row = Row(model.stem, method, "failed", f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        row.params, row.flops, row.heldout, row.node = params, flops, is_held_out(model.stem, *agent_meta), node
        if row.status == "ok":
            row.baseline_peak_fraction = flops / (row.baseline_ms * 1e-3) / (peak["gflops"] * 1e9)
            row.peak_fraction = flops / (row.latency_ms * 1e-3) / (peak["gflops"] * 1e9)
        rows.append(row)
    return ModelBench(rows, warmup_seconds=warmup)


def _settings_for(graph: Graph, settings: SessionSettings) -> SessionSettings:
    """The settings with weights shared between sessions where the model's size calls for it, as optimize() does."""
    return replace(settings, share_weights=shares_weights(graph))


def _load_profiled(model: Path, profiles: list[Profile]) -> Graph:
    """The model at the heaviest profile's shapes, measured at every profile (none: at the shapes it loads with)."""
    if not profiles:
        return load(model)
    proto = read_model(model)
    profiles = arrange(profiles, proto)
    graph = Graph.from_model(proto, profiles[0].shapes, source=str(model), checked=True)
    attach(graph, profiles)
    return graph


def warm_cost_table(graph: Graph, settings: SessionSettings) -> float | None:
    """Fills the cost table for the model's own graph before any method runs on it; returns the seconds it took, or
    None when the cost model cannot take the graph (the methods' own rows then say what fails on it).

    The table is shared on disk, so whichever method ran first on a model would otherwise pay, inside its time limit,
    for measuring the groups every later method then reads for free.  Groups of rewritten graphs are still measured by
    whichever method reaches them first.
    """
    from rlflow.measure.costmodel import CostModel

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
             warmups: dict[str, float | None], complete: bool) -> dict:
    records = [asdict(r) for r in rows]
    return {"config": asdict(config), "settings": settings.as_dict(), "environment": environment(settings),
            "peak": peak, "seconds": time.monotonic() - started, "complete": complete,
            "cost_table_warmup_seconds": warmups, "summary": summarize(records), "rows": records}


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if values else None


def _limit(seconds: float | None) -> str:
    return "each method's default (agent 10 s, searches 60 s)" if seconds is None else f"{seconds:.0f} s"


def summarize(rows: Sequence[dict]) -> dict:
    """Per method: geometric-mean speedup and mean times, over all models and over the agent's held-out ones."""
    out = {}
    for method in dict.fromkeys(r["method"] for r in rows):
        for part, chosen in (("all", [r for r in rows if r["method"] == method and r["status"] == "ok"]),
                             ("heldout", [r for r in rows if r["method"] == method and r["status"] == "ok"
                                          and r.get("heldout")])):
            if chosen:
                out.setdefault(method, {})[part] = {
                    "models": len(chosen),
                    "geomean_speedup": float(np.exp(np.mean(np.log([r["speedup"] for r in chosen])))),
                    "slower": sum(r["speedup_high"] < 1.0 for r in chosen),
                    "below_0.99": sum(r["speedup_low"] < 0.99 for r in chosen),
                    "mean_seconds": float(np.mean([r["seconds"] for r in chosen])),
                    "mean_search_seconds": _mean([r["search_seconds"] for r in chosen if r["kind"] == "rlflow"]),
                }
    return out


def _run_method(graph: Graph, method: str, settings: SessionSettings, config: BenchConfig) -> Row:
    """optimize() as a user runs it; a rewritten output is then measured afresh against the input.

    optimize() hands back a rewrite only when its own measurement puts the whole interval above 1, so that measurement
    is chosen for being favourable (winner's curse); the row reports an independent one, with other inputs and session
    order, and keeps the gate's median as `gate_speedup` (also when the gate rejected the rewrite; NaN when no
    verified rewrite reached it) with optimize()'s `reason` and `outcome`.  A kept input is the input: speedup exactly 1.
    """
    start = time.monotonic()
    result = optimize(graph, provider=settings.provider.replace("ExecutionProvider", "").lower(),
                      threads=settings.threads, method=method, time_limit=config.time_limit, seed=config.seed,
                      agent=config.agent if method == "agent" else None, cuda_graph=settings.cuda_graph)
    seconds = time.monotonic() - start
    comparison = result.comparison
    per_profile = []
    if result.rewritten:
        measured = compare_profiled([graph, result.graph], settings, rounds=config.rounds, seed=config.seed + 1)
        comparison = measured.comparisons[0]
        per_profile = [{"label": p.label, "weight": p.weight, **_ratio_fields(c.ratios[1])}
                       for p, c in zip(measured.profiles, measured.comparisons)]
        ratio = measured.ratios[1]
    else:
        ratio = comparison.ratios[1]
    before, after = comparison.timings
    verification = result.verification if result.rewritten else None  # else the output is the input itself
    return Row(Path(graph.source or "graph").stem, method, "ok", baseline_ms=before.median_ms,
               latency_ms=after.median_ms, speedup=ratio.median, speedup_low=ratio.low, speedup_high=ratio.high,
               faster=ratio.faster, rewritten=result.rewritten,
               verified=verification.ok if verification else True,
               max_rel_error=verification.max_rel_norm if verification else 0.0,
               seconds=seconds, search_seconds=result.search_seconds,
               gate_speedup=result.gate.median if result.gate else float("nan"), reason=result.reason,
               outcome=result.outcome,
               candidates_measured=result.candidates_measured, rewrites=result.applied, profiles=per_profile)


def _ratio_fields(ratio: Ratio) -> dict:
    return {"speedup": ratio.median, "speedup_low": ratio.low, "speedup_high": ratio.high}


def _run_peer(graph: Graph, name: str, tool: Callable, settings: SessionSettings, config: BenchConfig) -> Row:
    """A peer tool on the model with its measurement shapes fixed, checked and measured exactly like rlflow's output."""
    start = time.monotonic()
    source = graph.to_model(static=True)
    try:
        output = tool(source)
    except ImportError:
        return Row(Path(graph.source or "graph").stem, name, "not installed", "pip install 'rlflow[peers]'", "peer")
    except NotApplicable as exc:
        return Row(Path(graph.source or "graph").stem, name, "not applicable", str(exc), "peer")
    seconds = time.monotonic() - start
    tool_settings = peer_settings(output)
    output.ir_version = min(output.ir_version, max_ir_version())
    verification = verify(source, output, seeds=(config.seed, config.seed + 1, config.seed + 2),
                          shapes=verification_shapes(graph)[:1])
    comparison = compare([source, output], settings, rounds=config.rounds, seed=config.seed)
    ratio = comparison.ratios[1]
    return Row(Path(graph.source or "graph").stem, name, "ok" if verification.ok else "wrong output",
               verification.message, "peer", baseline_ms=comparison.timings[0].median_ms,
               latency_ms=comparison.timings[1].median_ms, speedup=ratio.median, speedup_low=ratio.low,
               speedup_high=ratio.high, faster=ratio.faster, rewritten=True, verified=verification.ok,
               max_rel_error=verification.max_rel_norm, seconds=seconds, peer_settings=tool_settings)


# ---------------------------------------------------------------------------------------------------- reports
CSV_FIELDS = [f for f in Row.__dataclass_fields__]


def write_results(results: dict, out_dir: Path) -> None:
    """results.json, results.csv, results.md, speedup.png and time.png, each written atomically."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out_dir / "results.json", json.dumps(results, indent=2, default=str) + "\n")
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_FIELDS)
    writer.writeheader()
    for row in results["rows"]:
        writer.writerow({**row, "rewrites": ";".join(row["rewrites"]),
                         "peer_settings": json.dumps(row["peer_settings"], sort_keys=True) if row.get("peer_settings")
                         else "", "profiles": "; ".join(_profile_text(p) for p in row.get("profiles", []))})
    write_text_atomic(out_dir / "results.csv", buffer.getvalue())
    write_text_atomic(out_dir / "results.md", markdown_table(results))
    plot_results(results, out_dir)


def _profile_text(profile: dict) -> str:
    return (f"{profile['label']} (weight {profile['weight']:g}): {profile['speedup']:.3f} "
            f"[{profile['speedup_low']:.3f}, {profile['speedup_high']:.3f}]")


def markdown_table(results: dict) -> str:
    """The results as a markdown table, with the settings they were measured under."""
    env, cfg, peak = results["environment"], results["config"], results["peak"]
    lines = [
        "# rlflow bench results", "",
        f"Measured {env['date']} on {env['cpu']} ({env['cores']} cores), {env['provider']}"
        f"{', CUDA graph capture' if results['settings'].get('cuda_graph') else ''}, "
        f"{results['settings']['threads']} thread(s), graph optimisation '{results['settings']['opt_level']}', "
        f"onnxruntime {env['onnxruntime']}, onnx {env['onnx']}, rlflow {env['rlflow']}. "
        f"Search time limit {_limit(cfg['time_limit'])} per model and method; {cfg['rounds']} interleaved rounds per "
        f"measurement; seed {cfg['seed']}. Matrix-product peak measured by the bench: {peak['gflops']:.1f} GFLOP/s. "
        f"Before the methods run on a model, the cost table is filled for its graph (outside every method's time; "
        f"{sum(s for s in results.get('cost_table_warmup_seconds', {}).values() if s is not None):.0f} s in all)."
        + (f" Method agent: `{cfg['agent']}`." if cfg.get("agent") else ""),
        "",
        "Speedup = input latency / output latency under ORT_ENABLE_ALL, median of interleaved rounds with a 95% "
        "bootstrap interval; **bold** where the interval lies above 1. A rewritten output is measured afresh, apart from "
        "the measurement optimize() chose it by; a kept input is the input itself (speedup exactly 1). `peak` = achieved FLOP/s of the output as a "
        "fraction of the measured peak. Error = worst relative-norm error of the output against the input on random "
        "inputs.", "",
        *([] if results.get("complete", True) else ["**Partial results: the run was still going or was interrupted.**", ""]),
        "| model | method | status | input ms | output ms | speedup [95% CI] | peak | error | rewrites | time s |",
        "| --- | --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in results["rows"]:
        if r["status"] not in ("ok", "wrong output"):
            lines.append(f"| {r['model']} | {r['method']} | {r['status']}: {r['error']} | | | | | | | |")
            continue
        speed = f"{r['speedup']:.3f} [{r['speedup_low']:.3f}, {r['speedup_high']:.3f}]"
        if r["faster"]:
            speed = f"**{speed}**"
        lines.append(f"| {r['model']}{' †' if r.get('heldout') else ''} | {r['method']} | {r['status']} "
                     f"| {r['baseline_ms']:.3f} | {r['latency_ms']:.3f} "
                     f"| {speed} | {r['peak_fraction']:.1%} | {r['max_rel_error']:.1e} "
                     f"| {len(r['rewrites']) if r['kind'] == 'rlflow' else 'peer'} "
                     f"| {r['seconds']:.1f} |")
    profiled = [r for r in results["rows"] if r.get("profiles")]
    if cfg.get("profiles"):
        lines += ["", "## Per profile", "",
                  f"Profiles: {', '.join(f'`{p}`' for p in cfg['profiles'])}. A method's speedup above is the weighted "
                  "geometric mean of its speedups at these profiles (and of their bounds); peers were measured at the "
                  "heaviest profile only. Rewritten outputs, per profile:", ""]
        lines += [f"- {r['model']} / {r['method']}: " + "; ".join(_profile_text(p) for p in r["profiles"])
                  for r in profiled] or ["- none"]
    if any(r.get("heldout") for r in results["rows"]):
        lines += ["", "† held out: the shipped agent never trained on this architecture (rlflow/agents/default.json)."]
    lines += ["", "## Per method", "",
              "Geometric-mean speedup; `slower` counts intervals entirely below 1, `< 0.99` intervals reaching below "
              "0.99; time is the whole optimisation (search, verification, final measurement), search time the "
              "search alone.", "",
              "| method | models | geomean speedup | slower | < 0.99 | mean time s | mean search s "
              "| held out: models | geomean | mean search s |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for method, parts in results.get("summary", {}).items():
        a, h = parts.get("all"), parts.get("heldout")
        if a is None:
            continue
        held = (f"{h['models']} | {h['geomean_speedup']:.3f} | {_fmt(h['mean_search_seconds'])}" if h
                else "0 | | ")
        lines.append(f"| {method} | {a['models']} | {a['geomean_speedup']:.3f} | {a['slower']} | {a['below_0.99']} "
                     f"| {a['mean_seconds']:.1f} | {_fmt(a['mean_search_seconds'])} | {held} |")
    return "\n".join(lines + _outcome_lines(results["rows"]) + _peer_settings_lines(results["rows"])) + "\n"


def outcome(row: dict) -> str:
    """optimize()'s `Result.outcome` for an rlflow row; '' for peers and for rows recorded before it was kept."""
    return (row.get("outcome") or "") if row["kind"] == "rlflow" else ""


def _outcome_lines(rows: Sequence[dict]) -> list[str]:
    """Per method: how many models ended each way, with the gate's median for each rejected rewrite."""
    methods = list(dict.fromkeys(r["method"] for r in rows if outcome(r)))
    if not methods:
        return []
    lines = ["", "## What each search's rewrite came to", "",
             "`gate rejected`: the search's verified rewrite was not measurably faster in optimize()'s final "
             "measurement (its median speedup there in brackets), so the input was kept. `out of time`: the search "
             "kept the input with candidates it would have measured left unmeasured when its time ran out.", "",
             "| method | rewritten | gate rejected | not verified | out of time | nothing found |",
             "| --- | ---: | --- | ---: | ---: | ---: |"]
    for method in methods:
        mine = [r for r in rows if r["method"] == method and outcome(r)]
        count = {kind: sum(outcome(r) == kind for r in mine)
                 for kind in ("rewritten", "not verified", "out of time", "nothing found")}
        rejected = [r for r in mine if outcome(r) == "gate rejected"]
        detail = ", ".join(f"{r['model']} ({r['gate_speedup']:.3f})" for r in rejected)
        lines.append(f"| {method} | {count['rewritten']} | {len(rejected)}{': ' + detail if detail else ''} "
                     f"| {count['not verified']} | {count['out of time']} | {count['nothing found']} |")
    return lines


def _peer_settings_lines(rows: Sequence[dict]) -> list[str]:
    """The settings each configurable peer ran with on each model (onnxruntime's transformers optimizer's model type,
    heads, hidden size and where each came from, and the fused operators it reported)."""
    chosen = [r for r in rows if r.get("peer_settings")]
    if not chosen:
        return []
    lines = ["", "## Peer settings", "",
             "As each peer ran; `source` says where model type, heads and hidden size came from (`zoo`: the zoo "
             "entry's hints, `graph`: read from the graph, `optimizer`: 0 passed, detected by the tool itself); "
             "`fused` counts the fused operators the tool reported in its output.", "",
             "| model | peer | settings |", "| --- | --- | --- |"]
    for r in chosen:
        settings = ", ".join(f"{k}={json.dumps(v, sort_keys=True)}" for k, v in sorted(r["peer_settings"].items()))
        lines.append(f"| {r['model']} | {r['method']} | {settings.replace('|', '/')} |")
    return lines


def _fmt(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds:.1f}"


def plot_results(results: dict, out_dir: Path) -> None:
    """speedup.png (per model and method: median and interval, on an axis zoomed to the data, since the differences
    are a few percent) and time.png (optimisation time, log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["rows"] if r["status"] == "ok"]
    if not rows:
        return
    models = sorted({r["model"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    width = 0.8 / len(methods)
    x = np.arange(len(models))
    for name in ("speedup.png", "time.png"):
        fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(models) + 2), 4))
        for k, method in enumerate(methods):
            by_model = {r["model"]: r for r in rows if r["method"] == method}
            offset = x + (k - (len(methods) - 1) / 2) * width
            if name == "time.png":
                ax.bar(offset, [by_model[m]["seconds"] if m in by_model else np.nan for m in models], width,
                       label=method)
                continue
            ys = np.array([by_model[m]["speedup"] if m in by_model else np.nan for m in models])
            low = np.array([by_model[m]["speedup_low"] if m in by_model else np.nan for m in models])
            high = np.array([by_model[m]["speedup_high"] if m in by_model else np.nan for m in models])
            ax.errorbar(offset, ys, yerr=[ys - low, high - ys], fmt="o", markersize=4, capsize=2, label=method)
        if name == "speedup.png":
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_ylabel("speedup over ORT_ENABLE_ALL")
            ax.set_title("median and 95% interval; an input kept as it is scores exactly 1", fontsize=9)
        else:
            ax.set_yscale("log")
            ax.set_ylabel("optimisation time (s)")
        ax.set_xticks(x, models, rotation=30, ha="right")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        tmp = out_dir / f".{name}.tmp.png"
        fig.savefig(tmp, dpi=120)
        plt.close(fig)
        tmp.replace(out_dir / name)
