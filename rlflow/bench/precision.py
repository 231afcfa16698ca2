"""`rlflow bench-precision`: rlflow's `--precision` beside the quantizers a user would pick instead, on the same data.

Per model: rlflow's output (`optimize` with `--precision`, every other setting its default), its exact output
(without `--precision`: what the precision step adds is the difference) and each peer's
(`rlflow.bench.precision_peers`) are measured interleaved against the input in one comparison, and each one's error
is taken on the same samples: the model's held-out npz beside it (`<name>.heldout.npz`, as the zoo's trained decoders
have), the given `--data`, or random inputs, which the row says.  A peer that tunes on data
(onnxconverter-fp16-mixed) tunes on the first of those samples, within rlflow's budget.  A peer that builds its own
graph of a zoo decoder (genai-int4, `rlflow.bench.builder_precision`) is fed each feed translated into its inputs, in
the timing and in the error; a zoo decoder's random samples and timing feed are decoder steps for that (an all-ones
mask, positions after the cache), for every row.  A peer that cannot quantize a model, or writes one onnxruntime
cannot run, is a row that says why; the run goes on.
"""
from __future__ import annotations

import json
import logging
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import onnx

from rlflow.bench.machine import environment, measure_bandwidth
from rlflow.bench.peers import NotApplicable
from rlflow.errors import InputError, ProviderError
from rlflow.files import write_text_atomic
from rlflow.graph.core import Graph
from rlflow.graph.external_data import tensor_bytes
from rlflow.graph.flops import count_bytes_read
from rlflow.graph.model_file import read_model
from rlflow.measure.accuracy import Evaluator, load_data, random_samples
from rlflow.measure.inputs import random_inputs
from rlflow.measure.session import SessionSettings, create_session, resolve_provider
from rlflow.measure.timing import compare
from rlflow.optimize.pipeline import optimize

log = logging.getLogger("rlflow")


@dataclass
class PrecisionBench:
    """Settings of a run, recorded in results.json."""

    precision: str = "int4"
    max_error: float | None = None
    peers: tuple[str, ...] = ()
    threads: int = 1
    rounds: int = 12
    seed: int = 0
    method: str | None = None
    time_limit: float | None = None
    data: str | None = None
    provider: str = "auto"
    """`auto`, `cpu` or `cuda`: where rlflow searches and every model is timed and its error taken."""
    at_peers_error: bool = False
    """rlflow's budget on each model is the least error any peer reached there (in place of `max_error`): rlflow
    beside the peers at no more error than any of them."""


def peer_names(spec: str, precision: str) -> tuple[str, ...]:
    """`all` (the peers of `precision`), `none`, or comma-separated names; InputError for an unknown one."""
    from rlflow.bench.precision_peers import PRECISION_PEERS

    if spec in ("all", "none"):
        return tuple(n for n, p in PRECISION_PEERS.items() if p == precision and spec == "all")
    names = tuple(n.strip() for n in spec.split(",") if n.strip())
    unknown = [n for n in names if n not in PRECISION_PEERS]
    if unknown:
        raise InputError(f"unknown peer(s) {', '.join(unknown)}: choose from {', '.join(PRECISION_PEERS)}")
    return names


def data_file(path: Path, data: str | None) -> str | None:
    """The npz a model's error is measured on: the given one, else the held-out npz beside the model, else None
    (random inputs)."""
    heldout = path.with_name(path.name[: -len(".onnx")] + ".heldout.npz")
    return data if data is not None else str(heldout) if heldout.exists() else None


def bench_model(path: Path, config: PrecisionBench) -> list[dict]:
    """One row per method and peer on the model at `path`."""
    from rlflow.bench.builder_precision import as_step, as_steps, builder_peer
    from rlflow.bench.genai_builder import decoder_of
    from rlflow.bench.precision_peers import BUILT_PEERS, PRECISION_PEERS, run_precision_peer

    given = read_model(path)
    graph = Graph.from_model(given, None, source=str(path), checked=True)
    data = data_file(path, config.data)
    samples = load_data(data, given) if data else random_samples(given, graph.input_shapes, config.seed)
    feed = random_inputs(given, config.seed, graph.input_shapes)  # what `compare` feeds every model by default
    if decoder_of(given, path) is not None and samples.random:  # a random mask and positions are no decoder step,
        samples, feed = as_steps(samples), as_step(feed)  # and the builder's peer can take steps only
    settings = SessionSettings(provider=resolve_provider(config.provider), threads=config.threads)
    evaluator = Evaluator(given, samples, settings, budget=math.inf)
    rows, built, candidates, errors = [], {}, {}, {}
    for name in config.peers:  # first: with `at_peers_error`, their least error is rlflow's budget
        start = time.monotonic()
        try:
            if name in BUILT_PEERS:  # its own graph, fed its own inputs
                built[name] = builder_peer(name, PRECISION_PEERS[name], given, path, settings)
                model, extra = built[name].model, {"settings": built[name].settings}
            else:
                model, extra = run_precision_peer(name, str(path), samples.feeds[0], config.max_error), {}
            seconds = time.monotonic() - start
            create_session(model, settings)  # a model onnxruntime refuses is the peer's row, not the run's end
            candidates[name] = (model, seconds, extra)
            errors[name] = built[name].error(given, samples, settings) if name in built else (evaluator.error(model),
                                                                                                {})
        except (NotApplicable, ProviderError) as exc:
            reason = str(exc) if isinstance(exc, NotApplicable) else f"{name} wrote a model that does not run: {exc}"
            rows.append({"model": path.stem, "method": name, "status": "not applicable", "reason": reason})
    budget = config.max_error
    if config.at_peers_error:
        reached = [e.max_error for e, _ in errors.values() if math.isfinite(e.max_error)]
        budget = min(reached) if reached else None
    with tempfile.TemporaryDirectory(prefix="rlflow-bench-precision-") as tmp:
        if samples.random:  # rlflow's budget holds on the rows' own samples (steps, for a zoo decoder)
            data = str(Path(tmp) / "samples.npz")
            np.savez(data, **{k: np.stack([f[k] for f in samples.feeds]) for k in samples.feeds[0]})
        for name, precision in (("rlflow-exact", None), ("rlflow", config.precision)):  # what precision adds
            start = time.monotonic()
            result = optimize(path, precision=precision, max_error=budget if precision else None,
                              data=data if precision else None,
                              method=config.method, time_limit=config.time_limit, threads=config.threads,
                              seed=config.seed, provider=config.provider)
            candidates[name] = (result.output_model, time.monotonic() - start,
                                {"outcome": result.outcome, "reason": result.reason,
                                 "layers": (result.precision or {}).get("layers"),
                                 "max_error_given": (result.precision or {}).get("max_error"),
                                 "precision_stop": (result.precision or {}).get("stop_reason")})
            errors[name] = evaluator.error(result.output_model), {}
    bandwidth = measure_bandwidth(settings)["gbs"] * 1e9
    names = list(candidates)
    feeds = [feed, *(built[n].feeds(feed) if n in built else feed for n in names)]
    comparison = compare([given, *(candidates[n][0] for n in names)], settings, rounds=config.rounds,
                         seed=config.seed, feeds=feeds, labels=["input", *names])
    for i, name in enumerate(names, start=1):
        model, seconds, extra = candidates[name]
        error, said = errors[name]
        read = bytes_read(model, {k: v.shape for k, v in feeds[i].items()})
        rows.append({"model": path.stem, "method": name, "status": "ok", "speedup": comparison.ratios[i].as_dict(),
                     "latency_ms": comparison.timings[i].median_ms, "input_ms": comparison.timings[0].median_ms,
                     "bytes_read": read, "memory_fraction": read / (comparison.timings[i].median_ms * 1e-3) / bandwidth,
                     "max_error": error.max_error, "logits": error.logits, "samples": error.source,
                     "weight_bytes": _weight_bytes(model), "input_weight_bytes": _weight_bytes(given),
                     "seconds": seconds, **extra, **said})
    return rows


def bytes_read(model: onnx.ModelProto, shapes) -> int:
    """`count_bytes_read` of `model` at the measured input `shapes` (its dynamic dimensions set there, then put back):
    what one run reads as stored, an int4 weight half a byte a value, a float16 one two."""
    inputs = {vi.name: vi for vi in model.graph.input}
    saved = {name: [_copied(dim) for dim in vi.type.tensor_type.shape.dim] for name, vi in inputs.items()
             if name in shapes}
    try:
        for name in saved:
            dims = inputs[name].type.tensor_type.shape.dim
            for dim, value in zip(dims, shapes[name]):
                dim.dim_value = int(value)
        return count_bytes_read(model)
    finally:
        for name, dims in saved.items():
            del inputs[name].type.tensor_type.shape.dim[:]
            inputs[name].type.tensor_type.shape.dim.extend(dims)


def _copied(dim: onnx.TensorShapeProto.Dimension) -> onnx.TensorShapeProto.Dimension:
    copy = onnx.TensorShapeProto.Dimension()
    copy.CopyFrom(dim)
    return copy


def _weight_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the initializers, as stored (from their shapes: a large model's weights lie in a file aside)."""
    return sum(tensor_bytes(t) for t in model.graph.initializer)


def run(models: Sequence[Path], config: PrecisionBench, out: Path) -> dict:
    """Every model's rows into `out`/results.json and results.md; returns what was written."""
    rows = []
    for path in models:
        log.info("bench-precision: %s", path)
        rows += bench_model(Path(path), config)
    results = {"config": config.__dict__, "environment": environment(SessionSettings(provider=resolve_provider(config.provider),
                                                                            threads=config.threads)),
               "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "results.json", json.dumps(results, indent=2, default=str) + "\n")
    write_text_atomic(out / "results.md", table(rows))
    return results


def table(rows: list[dict]) -> str:
    """The rows as a Markdown table: speed, error and weight bytes side by side, next-token loss where measured."""
    lines = ["| model | method | speedup | latency ms | memory | max error | loss increase | agreement | weights MiB "
             "| samples |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['model']} | {r['method']} | {r['status']}: {r['reason']} | | | | | | | |")
            continue
        s, logits = r["speedup"], r.get("logits") or {}
        loss = (f"{(logits['loss_candidate'] - logits['loss_reference']) / logits['loss_reference']:+.2%}"
                if "loss_reference" in logits else "")
        agree = f"{logits['agreement']:.1%}" if logits else ""
        lines.append(f"| {r['model']} | {r['method']} | {s['median']:.3f}x [{s['low']:.3f}, {s['high']:.3f}] | "
                     f"{r['latency_ms']:.3f} | {r['memory_fraction']:.1%} | {r['max_error']:.2e} | {loss} | {agree} | "
                     f"{r['weight_bytes'] / 2**20:.1f} | {r['samples']} |")
    return "\n".join(lines) + "\n"
