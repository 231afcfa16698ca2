"""The bench's rlflow rows: every method run on a model as a user runs it, then their outputs measured together.

The outputs are measured in one interleaved comparison against the input, each distinct graph once: methods that
reach the same graph (the agent's fuse-everything candidate is often greedy's first two steps), or graphs that differ
only by what onnxruntime's own optimisations remove (`rlflow.measure.as_run`), get the same figure, and those that
differ are compared within the same rounds and sessions, not across two runs whose drift alone can part them by a few
percent.  The measuring helpers here serve the peers' rows too (`rlflow.bench.run`).
"""
from __future__ import annotations

import logging
import time
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import onnx

from rlflow.bench.results import Row
from rlflow.graph.core import Graph
from rlflow.measure.as_run import fingerprint_as_run
from rlflow.measure.profile_comparison import compare_profiled
from rlflow.measure.session import SessionSettings
from rlflow.measure.timing import Comparison, Ratio
from rlflow.measure.verify import verify
from rlflow.optimize.pipeline import optimize, verification_shapes
from rlflow.optimize.result import Result

log = logging.getLogger("rlflow")


@dataclass
class Measured:
    """One output's figures from a comparison against the input: the primary profile's timings (input, output), the
    combined ratio and the per-profile entries of a row."""

    baseline_ms: float
    latency_ms: float
    ratio: Ratio
    per_profile: list[dict]

    @classmethod
    def of(cls, comparison: Comparison) -> Measured:
        """The output of a two-model comparison at one shape, against the input."""
        before, after = comparison.timings
        return cls(before.median_ms, after.median_ms, comparison.ratios[1], [])


def method_rows(graph: Graph, methods: Sequence[str], settings: SessionSettings, config) -> list[Row]:
    """A row per method (`config` a `rlflow.bench.run.BenchConfig`): optimize() as a user runs it, then every distinct
    rewritten output measured afresh, together, against the input.

    optimize() hands back a rewrite only when its own measurement puts the whole interval above 1, so that measurement
    is chosen for being favourable (winner's curse); a row reports the independent one, with other inputs and session
    order, and keeps the gate's median as `gate_speedup` (also when the gate rejected the rewrite; NaN when no verified
    rewrite reached it) with optimize()'s `reason` and `outcome`.  A kept input is the input: speedup exactly 1.  A
    method that fails gets a failed row and the others go on.
    """
    model = Path(graph.source or "graph").stem
    finished: dict[str, tuple[Result, float]] = {}
    failed: dict[str, Row] = {}
    for method in methods:
        start = time.monotonic()
        try:
            result = optimize(graph, provider=settings.provider.replace("ExecutionProvider", "").lower(),
                              threads=settings.threads, method=method, time_limit=config.time_limit, seed=config.seed,
                              agent=config.agent if method == "agent" else None, cuda_graph=settings.cuda_graph,
                              fix_dims=config.fix_dims, fix_values=config.fix_values)
        except Exception as exc:  # noqa: BLE001 - one failure must not stop the run
            failed[method] = failed_row(model, method, exc)
            continue
        result.output_model = None  # what optimize would write: the row needs the graph, not this beside it
        finished[method] = (result, time.monotonic() - start)
    same_as, as_run = _same_outputs({m: r.graph for m, (r, _) in finished.items() if r.rewritten}, settings)
    distinct = {m: finished[m][0].graph for m, first in same_as.items() if first == m}
    if config.control:
        distinct[CONTROL] = graph.clone()
    measured, device = _measure(graph, distinct, settings, config, failed, model)
    rows = []
    for method in methods:
        if method in failed:
            rows.append(failed[method])
            continue
        result, seconds = finished[method]
        first = same_as.get(method, "")
        if first in failed:  # its output's measurement failed
            rows.append(replace(failed[first], method=method))
            continue
        rows.append(_row(model, method, result, seconds, measured.get(first), device.get(first, {}),
                         same_output_as=first if first != method else "", same_as_run=method in as_run))
    if config.control:
        rows.append(failed.get(CONTROL) or _control_row(model, measured[CONTROL]))
    return rows


CONTROL = "control"
"""The bench's control row (`--control`): a copy of the input, measured with the methods' outputs as one of them.  It
computes what the input does in the same nodes, so its speedup is 1 but for the measurement: how far it strays, and
how wide its interval is, is what a figure on this model can be told apart from no change."""


def _control_row(model: str, measured: Measured) -> Row:
    ratio = measured.ratio
    return Row(model, CONTROL, "ok", kind=CONTROL, baseline_ms=measured.baseline_ms, latency_ms=measured.latency_ms,
               speedup=ratio.median, speedup_low=ratio.low, speedup_high=ratio.high, faster=ratio.faster,
               verified=True, max_rel_error=0.0, seconds=0.0, profiles=measured.per_profile)


def _same_outputs(outputs: dict[str, Graph], settings: SessionSettings) -> tuple[dict[str, str], set[str]]:
    """method -> the first method whose output is the same graph or, where outputs differ, the same graph once
    onnxruntime has optimised it; and the methods whose output is the same as that method's only as run."""
    prints = {method: graph.fingerprint() for method, graph in outputs.items()}
    first_with: dict[str, str] = {}  # a fingerprint -> the first method whose output has it
    same_as = {method: first_with.setdefault(key, method) for method, key in prints.items()}
    if len(first_with) > 1:
        for method in list(first_with.values()):
            key = fingerprint_as_run(outputs[method], settings)  # None: it cannot be saved, so it stays apart
            first_with.setdefault(f"run:{key or method}", method)
            same_as[method] = first_with[f"run:{key or method}"]
        same_as = {method: same_as[first] for method, first in same_as.items()}
    return same_as, {m for m, first in same_as.items() if prints[m] != prints[first]}


def _measure(graph: Graph, outputs: dict[str, Graph], settings: SessionSettings, config, failed: dict[str, Row],
             model: str) -> tuple[dict[str, Measured], dict[str, dict]]:
    """Each method's distinct output measured (together; where that fails, each alone, so that one output that
    cannot run, such as one onnxruntime cannot capture, costs only its own rows) and its device errors; a failure
    goes into `failed`."""
    measured, device = {}, {}
    seed = measurement_seed(config.seed, model)
    try:
        measured = dict(zip(outputs, measure_outputs(graph, list(outputs.values()), settings, config.rounds, seed)))
    except Exception as exc:  # noqa: BLE001 - measured one at a time below
        log.debug("%s: the outputs measured together failed (%s); measuring each alone", model, exc)
    for method, output in outputs.items():
        try:
            if method not in measured:
                (measured[method],) = measure_outputs(graph, [output], settings, config.rounds, seed)
            if method != CONTROL:  # the input's copy: its device error is the input's own, which the rows hold
                device[method] = device_errors(graph, output, settings, graph)
        except Exception as exc:  # noqa: BLE001 - one failure must not stop the run
            measured.pop(method, None)
            failed[method] = failed_row(model, method, exc)
    return measured, device


def _row(model: str, method: str, result: Result, seconds: float, measured: Measured | None, device: dict,
         same_output_as: str, same_as_run: bool) -> Row:
    if measured is None:  # the input kept: optimize()'s own comparison, whose output is the input
        measured = Measured.of(result.comparison)
    verification = result.verification if result.rewritten else None  # else the output is the input itself
    ratio = measured.ratio
    return Row(model, method, "ok", baseline_ms=measured.baseline_ms, latency_ms=measured.latency_ms,
               speedup=ratio.median, speedup_low=ratio.low, speedup_high=ratio.high, faster=ratio.faster,
               rewritten=result.rewritten, verified=verification.ok if verification else True,
               max_rel_error=verification.max_rel_norm if verification else 0.0,
               seconds=seconds, search_seconds=result.search_seconds,
               gate_speedup=result.gate.median if result.gate else float("nan"), reason=result.reason,
               outcome=result.outcome, search_stop=result.search_stop,
               candidates_measured=result.candidates_measured, rewrites=result.applied, profiles=measured.per_profile,
               same_output_as=same_output_as, same_as_run=same_as_run, **device)


def failed_row(model: str, method: str, exc: Exception) -> Row:
    return Row(model, method, "failed", f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")


def measurement_seed(seed: int, model: str) -> int:
    """The seed of a model's measurement in a bench run (its random inputs, the order its sessions are built and run
    in): the run's seed mixed with the model's name.  With one seed for every model, an effect of that order fell
    alike on all of them and did not average out over a run (the input's copy read faster than the input on 20 of 24
    models: docs/measurement.md)."""
    return zlib.crc32(f"{seed}:{model}".encode())


def measure_outputs(graph: Graph, outputs: Sequence[Graph], settings: SessionSettings, rounds: int,
                    seed: int) -> list[Measured]:
    """`outputs` against `graph` in one interleaved comparison at each of `graph`'s profiles."""
    compared = compare_profiled([graph, *outputs], settings, rounds=rounds, seed=seed)
    primary: Comparison = compared.comparisons[0]
    return [Measured(primary.timings[0].median_ms, primary.timings[i].median_ms, compared.ratios[i],
                     [{"label": p.label, "weight": p.weight, **_ratio_fields(c.ratios[i])}
                      for p, c in zip(compared.profiles, compared.comparisons)])
            for i in range(1, len(outputs) + 1)]


def _ratio_fields(ratio: Ratio) -> dict:
    return {"speedup": ratio.median, "speedup_low": ratio.low, "speedup_high": ratio.high}


def device_errors(source: onnx.ModelProto | Graph, output: onnx.ModelProto | Graph, settings: SessionSettings,
                  graph: Graph) -> dict[str, float]:
    """On CUDA, Row's `device_error` and `input_device_error`: the output and the input run on the device, each against
    the input on the CPU, on random inputs (random positions and masks for a decoder); {} elsewhere (a Graph is
    exported only then).

    Outputs are verified on the CPU, but a contrib operator's CUDA kernel may compute something else (onnxruntime's
    notes say GroupQueryAttention's CUDA rotary derives the keys' positions from the cache length): an output whose
    device error is far above the input's does not compute the same function there."""
    if settings.provider != "CUDAExecutionProvider":
        return {}
    source, output = (m.to_model(static=False) if isinstance(m, Graph) else m for m in (source, output))
    shapes = verification_shapes(graph)[:1]

    def error(model: onnx.ModelProto) -> float:
        checked = verify(source, model, seeds=(0,), shapes=shapes, tolerance=float("inf"),
                         candidate_provider=settings.provider)
        return checked.max_rel_norm if checked.outputs else float("inf")  # none: it failed to run there

    key = (id(graph), graph.source, settings.provider)  # the input's is the same for every row of a model
    if key not in _INPUT_DEVICE_ERRORS:
        _INPUT_DEVICE_ERRORS[key] = error(source)
    return {"device_error": error(output), "input_device_error": _INPUT_DEVICE_ERRORS[key]}


_INPUT_DEVICE_ERRORS: dict[tuple, float] = {}
"""`device_errors`' input errors by model: a large decoder's sessions take seconds to build, on a lease's clock."""
